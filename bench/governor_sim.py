"""The speculation governor (engine/spec/governor.py) on a simulated noisy host: what its choices
cost against always taking the cheaper way. No model runs: steps are drawn. Plain steps take 3.35
ms and emit 1 token; drafting steps take `--draft-ms` (one value per scenario) and emit 1-4
tokens (1.6 on average); every step's time varies by 5 %, 1 % of steps take 3x (a shared host's
hiccups), and with `--spells` a step starts a spell of 10-60 steps 1.3-2x slower with that
probability. Per scenario, over seeds: ms per token against the cheaper way's under the same
noise (never or always drafting, whichever is cheaper there), and the drafting steps taken. Prints one JSON object, then a table.

    python -m bench.governor_sim [--draft-ms 6.2 4.6] [--spells 0 0.005 0.02] [--seeds 40] [--steps 3000]
"""

import argparse
import json
import random

from engine.spec.governor import SpeculationGovernor

PLAIN_MS = 3.35
TOKENS, WEIGHTS = [1, 2, 3, 4], [0.6, 0.25, 0.1, 0.05]  # a drafting step's emitted tokens


def run(seed: int, draft_ms: float, spells: float, steps: int, policy: str = "governed") -> tuple[float, int]:
    """ms per token and drafting steps of one simulated run; `policy`: governed, plain (never
    draft) or draft (always). A seed's host noise is the same under every policy (its own
    generator), so the policies are compared on the same host."""
    noise, draws = random.Random(seed), random.Random(seed + 1_000_003)
    governor = SpeculationGovernor()
    total_ms, tokens, drafted, slow_until, factor = 0.0, 0, 0, -1, 1.0
    for step in range(steps):
        if step > slow_until and noise.random() < spells:
            slow_until, factor = step + noise.randint(10, 60), noise.uniform(1.3, 2.0)
        slow = (factor if step <= slow_until else 1.0) * (3.0 if noise.random() < 0.01 else 1.0)
        jitter = noise.gauss(1, 0.05)
        draft = governor.should_draft(1) if policy == "governed" else policy == "draft"
        ms = (draft_ms if draft else PLAIN_MS) * jitter * slow
        emitted = draws.choices(TOKENS, WEIGHTS)[0] if draft else 1
        governor.record(1, draft, ms / 1e3, emitted)
        total_ms, tokens, drafted = total_ms + ms, tokens + emitted, drafted + draft
    return total_ms / tokens, drafted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draft-ms", type=float, nargs="+", default=[6.2, 4.6])
    ap.add_argument("--spells", type=float, nargs="+", default=[0.0, 0.005, 0.02])
    ap.add_argument("--seeds", type=int, default=40)
    ap.add_argument("--steps", type=int, default=3000)
    args = ap.parse_args()
    mean_tokens = sum(t * w for t, w in zip(TOKENS, WEIGHTS))
    rows = []
    for draft_ms in args.draft_ms:
        for spells in args.spells:
            runs = {policy: [run(seed, draft_ms, spells, args.steps, policy) for seed in range(args.seeds)]
                    for policy in ("governed", "plain", "draft")}
            ms = {policy: sum(r[0] for r in rs) / len(rs) for policy, rs in runs.items()}
            cheaper = min(ms["plain"], ms["draft"])
            rows.append({"draft_ms": draft_ms, "spells": spells, "ms_per_token": round(ms["governed"], 4),
                         "cheaper_way_ms_per_token": round(cheaper, 4), "vs_cheaper_way": round(ms["governed"] / cheaper, 4),
                         "drafting_ms_per_token": round(draft_ms / mean_tokens, 3),
                         "drafting_steps": round(sum(r[1] for r in runs["governed"]) / args.seeds)})
    print(json.dumps({"plain_ms": PLAIN_MS, "seeds": args.seeds, "steps": args.steps, "rows": rows}))
    print(f"\n| drafting step ms (ms a token) | spells | ms a token | the cheaper way's, same noise | ratio "
          f"| drafting steps of {args.steps} |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['draft_ms']} ({r['drafting_ms_per_token']}) | {r['spells']} | {r['ms_per_token']:.3f} "
              f"| {r['cheaper_way_ms_per_token']:.3f} | {r['vs_cheaper_way']:.3f} | {r['drafting_steps']} |")


if __name__ == "__main__":
    main()
