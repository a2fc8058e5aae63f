"""`pdspec train-eagle3`: the command that distills a target's answers and trains an EAGLE3 head on
them (deploy/cli.py adds it to the `pdspec` parser). Heavy imports wait until the command runs."""

import argparse
import math
from pathlib import Path

# Flags that must be a positive number (None: unset, the default's), checked before anything runs:
# a bad training flag was found only after hours of distillation.
_POSITIVE = ("max_prompts", "max_new_tokens", "batch_size", "draft_vocab", "draft_intermediate_size", "draft_layers",
             "epochs", "ttt_steps", "lr", "max_hours")


def _check_flags(args: argparse.Namespace) -> None:
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"--{name.replace('_', '-')}: must be a positive number, got {value}")
    if bad := [t for t in args.snapshot_tokens if not (math.isfinite(t) and t >= 1)]:
        raise ValueError(f"--snapshot-tokens: each must be a finite count of at least 1, got {bad[0]}")


def _train_eagle3(args: argparse.Namespace) -> int:
    from tools.prompts import read_conversations
    from tools.eagle3_training.distill import distill

    _check_flags(args)
    out = Path(args.out)
    prompts = read_conversations(Path(args.prompts))[: args.max_prompts]
    if args.stage in ("distill", "all"):
        distill(prompts, out / "data", args.target, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                store_features=not args.tokens_only)
    if args.stage in ("train", "all"):
        from tools.eagle3_training.distill import check_distilled
        from tools.eagle3_training.trainer import TrainConfig, train

        check_distilled(out / "data", len(prompts))  # a cut-short distillation is not trained on
        train(TrainConfig(target=args.target, data_dir=out / "data", out_dir=out, draft_vocab_size=args.draft_vocab,
                          intermediate_size=args.draft_intermediate_size, num_layers=args.draft_layers,
                          aux_layer_ids=args.aux_layers, epochs=args.epochs, ttt_steps=args.ttt_steps, lr=args.lr,
                          max_hours=args.max_hours, init_from=Path(args.init_from) if args.init_from else None,
                          snapshot_tokens=tuple(int(t) for t in args.snapshot_tokens)))
    return 0


def add_train_eagle3(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-eagle3", help="train an EAGLE3 draft head for a target by self-distillation")
    p.add_argument("--target", default=None, help="target HF model directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", required=True,
                   help="JSONL prompts: 'prompt', or MT-bench 'turns' (each turn answered after the previous answers)")
    p.add_argument("--out", required=True, help="output directory: data/, checkpoints/, and the exported head")
    p.add_argument("--stage", choices=["distill", "train", "all"], default="all",
                   help="distill: the target answers the prompts; train: fit the head on that data (both resume)")
    p.add_argument("--max-prompts", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length cap during distillation")
    p.add_argument("--batch-size", type=int, default=32, help="sequences decoded together during distillation")
    p.add_argument("--tokens-only", action="store_true",
                   help="distill the answers' tokens only (4 bytes a token instead of ~4.6 KB of features); "
                        "training recomputes the features with the target, one forward per batch")
    p.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary: the most frequent target tokens")
    p.add_argument("--draft-intermediate-size", type=int, default=None,
                   help="the head's MLP width (default: the target's; wider: more capacity, more work a draft row)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="the head's layers (default 1, EAGLE3's; more: a capacity experiment the engine does not serve)")
    p.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="LAYER",
                   help="the three target layers whose inputs the head reads (default: EAGLE3's 2, L/2, L-3; "
                        "L: the last layer's output)")
    p.add_argument("--epochs", type=float, default=2.0)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll depth")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--max-hours", type=float, default=None,
                   help="stop this invocation's training after this long (a checkpoint; run again to go on)")
    p.add_argument("--init-from", default=None, help="an exported head to continue training from (keeps its vocabulary)")
    p.add_argument("--snapshot-tokens", type=float, nargs="*", default=[],
                   help="export the head once training has seen each of these many tokens, to OUT/snapshots/ "
                        "(a data-vs-acceptance curve from one run, e.g. 1e6 2e6 4e6)")
    p.set_defaults(func=_train_eagle3)
