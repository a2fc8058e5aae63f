"""EAGLE3 head accuracy, teacher-forced, on prompts the head never saw.

The target answers the prompts greedily (self-distillation, as for training; kept in --work so a
second head is measured on the same answers), then the head runs over every answer position as in
training-time test: draft position 1 from the target's features, draft position 2 from the head's
own hidden state and the true token before it. Reported:
- top-k accuracy: how often the target's token is among the head's k most likely, at position 1,
  and at position 2 given position 1 was right (what a tree of width k could accept);
- chain tau at K = 2 predicted from the top-1 rates: 1 + a1 + a1 * a2;
- calibration: the head's top-token probability at position 1 against how often the target
  agrees, which `speculative.draft_confidence_threshold` relies on;
- the share of answer tokens outside the draft vocabulary (a ceiling on every rate above).
Prints one JSON object, then a table. Measured acceptance in `bench spec` runs 0.01-0.02 lower at
position 1: verification steps start after accepted stretches, so easy positions come up less.

    python -m bench.draft_accuracy [--prompts bench/prompts/chat_eval.jsonl] [--draft DIR] [--work DIR]
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.loader import load_weights
from engine.model_dir import resolve_model_dir
from engine.runner import EMBEDDED_DRAFT_DIR
from engine.spec.eagle3_model import head_aux_layer_ids
from tools.prompts import read_prompts
from tools.eagle3_training.distill import distill
from tools.eagle3_training.features import TargetFeatures
from tools.eagle3_training.model import TrainableEagle3, exported_depth, exported_mlp_width, exported_vocab
from tools.eagle3_training.shards import load_shard, shard_paths
from tools.eagle3_training.trainer import collate

TOP_K = (1, 2, 4, 8)
BINS = torch.linspace(0, 1, 11)


def load_head(draft_dir: Path, target: str | None) -> TrainableEagle3:
    model_dir = resolve_model_dir(target)
    weights = load_weights(model_dir, torch.float32, torch.device("cpu"))
    exported = load_weights(draft_dir, torch.float32, torch.device("cpu"))
    head = TrainableEagle3(ModelConfig.from_dir(model_dir), exported_vocab(exported),
                           weights["model.embed_tokens.weight"], exported_mlp_width(exported), exported_depth(exported),
                           head_aux_layer_ids(draft_dir))
    head.load_exported(exported)
    return head.eval()


def _shifted(mask: torch.Tensor, by: int) -> torch.Tensor:
    """mask[t + by] at t (False past the end)."""
    return F.pad(mask[:, by:], (0, by), value=False)


@torch.no_grad()
def measure(head: TrainableEagle3, data_dir: Path, target: str | None = None) -> dict:
    """target: recomputes the features of a head that reads other layers than distillation stores."""
    recompute = None if head.aux_layer_ids == head.target.aux_layer_ids else TargetFeatures(target, 1 << 12,
                                                                                          head.aux_layer_ids)
    max_len = 1 << 16 if recompute is None else 1 << 12  # recomputed: as many tokens as one forward takes
    hits1 = {k: 0 for k in TOP_K}
    hits1_with_2 = {k: 0 for k in TOP_K}  # position 1 right where position 2 is an answer token too
    hits12 = {k: 0 for k in TOP_K}
    positions = out_of_vocab = 0
    probs, agrees = [], []
    for path in shard_paths(data_dir):
        shard = load_shard(path)
        for i in range(shard["prompt_lens"].numel()):
            features, _, tokens, valid, answer = collate(shard, [i], max_len=max_len, target_features=recompute)
            logits = head.unroll(features, tokens, valid, steps=2)
            at1, at2 = _shifted(answer, 2), _shifted(answer, 3)  # positions whose draft tokens are answer tokens
            label1, label2 = head.labels(tokens, answer, 0), head.labels(tokens, answer, 1)
            ranked1, ranked2 = (step.topk(max(TOP_K), -1).indices for step in logits)  # best first
            for k in TOP_K:
                hit1 = (ranked1[..., :k] == label1[..., None]).any(-1) & at1
                hit2 = (ranked2[..., :k] == label2[..., None]).any(-1) & at2
                hits1[k] += int(hit1.sum())
                hits1_with_2[k] += int((hit1 & at2).sum())
                hits12[k] += int((hit1 & hit2).sum())
            positions += int(at1.sum())
            out_of_vocab += int(((label1 < 0) & at1).sum())
            top_prob, top = torch.softmax(logits[0], -1).max(-1)
            probs.append(top_prob[at1])
            agrees.append((top == label1)[at1])
    if positions == 0:
        raise ValueError(f"{data_dir}: the distilled answers hold no position to measure")
    a1 = {k: hits1[k] / positions for k in TOP_K}
    a2 = {k: hits12[k] / max(hits1_with_2[k], 1) for k in TOP_K}
    return {
        "positions": positions,
        "out_of_vocab": round(out_of_vocab / positions, 4),
        "top_k_position_1": {k: round(v, 4) for k, v in a1.items()},
        "top_k_position_2_given_1": {k: round(v, 4) for k, v in a2.items()},
        "chain_tau_k2": round(1 + a1[1] + a1[1] * a2[1], 4),
        "calibration": _calibration(torch.cat(probs), torch.cat(agrees)),
    }


def _calibration(probs: torch.Tensor, agrees: torch.Tensor) -> list[dict]:
    rows = []
    for low, high in zip(BINS[:-1].tolist(), BINS[1:].tolist()):
        inside = (probs >= low) & ((probs < high) if high < 1 else (probs <= high))
        n = int(inside.sum())
        rows.append({"prob": f"{low:.1f}-{high:.1f}", "positions": n,
                     "agree": round(agrees[inside].float().mean().item(), 3) if n else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=Path, default=Path("bench/prompts/chat_eval.jsonl"))
    ap.add_argument("--draft", type=Path, default=EMBEDDED_DRAFT_DIR, help="EAGLE3 head directory")
    ap.add_argument("--target", default=None, help="target model directory (default: the embedded model)")
    ap.add_argument("--work", type=Path, default=None, help="keep the target's answers here (reused when present)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        _check_work_dir(work, {"prompts": str(args.prompts.resolve()), "target": args.target,
                               "max_new_tokens": args.max_new_tokens})
        distill(read_prompts(args.prompts), work, args.target, max_new_tokens=args.max_new_tokens)
        result = {"draft": str(args.draft), "prompts": str(args.prompts), **measure(load_head(args.draft, args.target), work, args.target)}
    print(json.dumps(result))
    _table(result)


def _check_work_dir(work: Path, answers_of: dict) -> None:
    """A kept work directory holds answers to one prompt file, target and length: refuse another."""
    record = work / "answers_of.json"
    if record.exists() and json.loads(record.read_text()) != answers_of:
        raise SystemExit(f"--work {work} holds answers to {record.read_text().strip()}; use another directory")
    work.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(answers_of))


def _table(r: dict) -> None:
    print(f"\n{r['positions']} answer positions, {r['out_of_vocab']:.1%} outside the draft vocabulary; "
          f"predicted chain tau at K = 2: {r['chain_tau_k2']:.3f}")
    print("| k | position 1 in top-k | position 2 in top-k, given position 1 |\n|---|---|---|")
    for k in TOP_K:
        print(f"| {k} | {r['top_k_position_1'][k]:.3f} | {r['top_k_position_2_given_1'][k]:.3f} |")
    print("\n| head probability | positions | target agrees |\n|---|---|---|")
    for row in r["calibration"]:
        print(f"| {row['prob']} | {row['positions']} | {row['agree']} |")


if __name__ == "__main__":
    main()
