"""Speculation measured end to end: the same prompts through a plain engine and a speculative
one in the same process, alternating prompt by prompt so drift in machine speed hits both alike.

Reports tau (mean tokens emitted per target forward), tokens/s of each, their ratio (speedup)
with a 95 % bootstrap interval over the prompt batches (how much the speedup depends on which
prompts ran and on the machine's drift while they ran; not the drift between runs, which on the
shared VMs here moves a speedup by more than that: compare runs, not intervals), per-position
acceptance, whether every greedy output is token-identical (lossless), and for the steps that
drafted: where their time went (draft, verification, bookkeeping) and the target rows verified per
emitted token.
"""

import random
import time

import torch
from tqdm import tqdm

from engine.engine import Engine
from engine.params import SamplingParams
from engine.stats import AcceptanceStats


def warm_up(engines: list[Engine], prompt: list[int]) -> None:
    """A short untimed run on each engine: first-use costs (kernel builds, thread pools, first
    allocations) fall on no timed batch, and on neither side of a comparison; the counters
    reported are the timed batches' alone."""
    for engine in engines:
        run_batch(engine, [prompt], SamplingParams(max_tokens=8))
        engine.counters.clear()
        engine.drafting_seconds.clear()


def run_batch(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Run prompts to completion together: (token ids per prompt, seconds, acceptance stats)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {i: [] for i in ids}
    stats = []
    start = time.perf_counter()
    with torch.inference_mode():  # held for the run, as the engine loop's thread holds it (engine/inference.py)
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.token_ids)
                if out.finished and out.acceptance is not None:
                    stats.append(out.acceptance)
    return [tokens[i] for i in ids], time.perf_counter() - start, stats


def evaluate(base: Engine, spec: Engine, prompts: list[list[int]], max_tokens: int, batch_size: int = 1,
             temperature: float = 0.0, rounds: int = 1) -> dict:
    """rounds: passes over the prompts' batches, each batch's order flipped from pass to pass (more
    batches for the speedup's interval: at batch 16 a prompt file gives two or three)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0 if temperature else None)
    per_batch: list[tuple[int, float, int, float]] = []  # (base tokens, base s, spec tokens, spec s)
    merged, identical = AcceptanceStats(), True
    warm_up([base, spec], prompts[0])
    batches = [(r, k, prompts[start : start + batch_size])
               for r in range(rounds) for k, start in enumerate(range(0, len(prompts), batch_size))]
    for r, k, batch in tqdm(batches, desc="bench spec", unit="batch"):
        # Who goes first alternates: the second of a pair runs on caches and clocks the first warmed.
        base_first = (k + r) % 2 == 0
        if base_first:
            base_out, base_s, _ = run_batch(base, batch, params)
        spec_out, spec_s, stats = run_batch(spec, batch, params)
        if not base_first:
            base_out, base_s, _ = run_batch(base, batch, params)
        identical &= base_out == spec_out
        per_batch.append((sum(map(len, base_out)), base_s, sum(map(len, spec_out)), spec_s))
        for s in stats:
            merged.merge(s)
    base_tps, spec_tps = _tokens_per_s(per_batch)
    summary = merged.to_dict()
    return {
        "num_prompts": len(prompts),
        "batch_size": batch_size,
        "rounds": rounds,
        "max_tokens": max_tokens,
        "method": spec.config.speculative.method,
        "num_speculative_tokens": spec.config.speculative.num_speculative_tokens,
        "draft_confidence_threshold": spec.draft_confidence_threshold,
        "draft_top_k": spec.config.speculative.draft_top_k,
        "speculative_token_tree": spec.config.speculative.speculative_token_tree,
        "disable_by_batch_size": spec.config.speculative.disable_by_batch_size,
        "tau": summary["mean_acceptance_length"],
        "speedup": round(spec_tps / base_tps, 3),
        "speedup_ci95": _bootstrap_speedup(per_batch),
        "tokens_per_s_spec": round(spec_tps, 2),
        "tokens_per_s_base": round(base_tps, 2),
        "lossless": identical if params.greedy else None,
        "per_position_acceptance_rate": summary["per_position_acceptance_rate"],
        "drafted": summary["drafted"],
        "accepted": summary["accepted"],
        **_drafting_split(spec),
    }


def _drafting_split(spec: Engine) -> dict:
    """Where a step that drafted spent its time (ms, mean over those steps) and how many target
    rows it verified per token it emitted (1 would be plain decoding's)."""
    steps = spec.counters["drafting_steps"]
    if not steps:
        return {"drafting_steps": 0}
    seconds = spec.drafting_seconds
    return {
        "drafting_steps": steps,
        "drafting_step_ms": {part: round(seconds[part] * 1e3 / steps, 2) for part in ("draft", "verify", "bookkeeping")},
        "verify_rows_per_token": round(spec.counters["verify_rows"] / spec.counters["drafting_step_tokens"], 3),
    }


def _bootstrap_speedup(per_batch: list[tuple[int, float, int, float]], resamples: int = 2000) -> tuple[float, float] | None:
    """2.5th and 97.5th percentiles of the speedup over batches resampled with replacement (None
    for a single batch: there is nothing to resample)."""
    if len(per_batch) < 2:
        return None
    rng = random.Random(0)
    speedups = []
    for _ in range(resamples):
        sample = rng.choices(per_batch, k=len(per_batch))
        base_tps, spec_tps = _tokens_per_s(sample)
        speedups.append(spec_tps / base_tps)
    speedups.sort()
    return round(speedups[int(0.025 * resamples)], 3), round(speedups[int(0.975 * resamples) - 1], 3)


def _tokens_per_s(batches: list[tuple[int, float, int, float]]) -> tuple[float, float]:
    """Pooled (base, spec) tokens/s over (base tokens, base s, spec tokens, spec s) batches."""
    base_tokens, base_s, spec_tokens, spec_s = (sum(col) for col in zip(*batches))
    return base_tokens / base_s, spec_tokens / spec_s
