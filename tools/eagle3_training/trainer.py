"""Train an EAGLE3 head on distilled data (see distill.py); resumable, with tqdm progress.

Draft vocabulary: the `draft_vocab_size` most frequent tokens of the target's answers. The head's
`norm` and `lm_head` start from the target's final norm and head rows for those tokens (its
output space is the target's), the rest from scratch. Loss: cross-entropy of each TTT unroll
step against the target's own next-token distribution over the draft vocabulary (soft labels,
recomputed from the stored last-layer output; answer positions only), weighted 0.8^step as in
EAGLE-3. Soft labels carry the target's whole ranking, not just its argmax: more signal per
distilled token, which is what a CPU-sized data budget is short of.
"""

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from engine.config import ModelConfig
from engine.conversions import fsync_tree, replace_durably, write_text_durably
from engine.layers import rms_norm
from engine.loader import load_weights
from engine.model_dir import resolve_model_dir
from engine.spec.eagle3_model import head_aux_layer_ids
from tools.eagle3_training.features import TargetFeatures
from tools.eagle3_training.head_loss import head_soft_label_loss
from tools.eagle3_training.model import TrainableEagle3, exported_depth, exported_mlp_width, exported_vocab
from tools.eagle3_training.run_dir import held
from tools.eagle3_training.shards import (answer_token_counts, answer_tokens, has_features, load_index, load_shard,
                                         repeated_samples, shard_paths)

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    target: str | None
    data_dir: Path
    out_dir: Path
    draft_vocab_size: int = 8192
    intermediate_size: int | None = None  # the head's MLP width (None: the target's)
    num_layers: int | None = None  # the head's layers (None: 1, EAGLE3's; more is for capacity experiments)
    aux_layer_ids: tuple[int, ...] | None = None  # the target layers the head reads (None: EAGLE3's default)
    epochs: float = 2.0
    ttt_steps: int = 3
    lr: float = 5e-4
    max_hours: float | None = None  # this run's budget: a resumed run gets it afresh
    init_from: Path | None = None  # an exported head to continue from (its draft vocabulary is kept)
    batch_tokens: int = 4096  # padded tokens per batch
    max_len: int = 1024  # longer samples are truncated (a third turn's prompt alone is ~430 tokens)
    warmup_steps: int = 100
    seed: int = 0
    checkpoint_every_s: float = 600.0
    # Export the head as it is once training has seen each of these many answer tokens (a data-
    # vs-acceptance curve from one run), to out_dir/snapshots/<millions>M.
    snapshot_tokens: tuple[int, ...] = ()


class TargetDistribution:
    """The target's next-token distribution over the draft vocabulary, from its last layer's output."""

    def __init__(self, norm: torch.Tensor, head_rows: torch.Tensor, eps: float):
        self.norm, self.head_rows, self.eps = norm, head_rows, eps

    @torch.no_grad()
    def probs(self, final_hidden: torch.Tensor) -> torch.Tensor:
        return torch.softmax(rms_norm(final_hidden.float(), self.norm, self.eps) @ self.head_rows.T, dim=-1)


def draft_vocab(counts: torch.Tensor, size: int, init: dict[str, torch.Tensor] | None) -> tuple[torch.Tensor, float]:
    """The `size` most frequent answer tokens (or the initial head's vocabulary), sorted, and the
    share of answer tokens they cover."""
    vocab = exported_vocab(init) if init is not None else counts.topk(min(size, counts.numel())).indices.sort().values
    return vocab, float(counts[vocab].sum() / counts.sum().clamp_min(1))


def _batches(shard: dict[str, torch.Tensor], cfg: TrainConfig, rng: random.Random,
             skip: frozenset[int] = frozenset()) -> list[list[int]]:
    """Sample indices (but `skip`) grouped by similar length, at most batch_tokens padded tokens per batch."""
    lengths = (shard["offsets"][1:] - shard["offsets"][:-1]).clamp_max(cfg.max_len).tolist()
    order = sorted((i for i in range(len(lengths)) if i not in skip), key=lambda i: lengths[i])
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > cfg.batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def collate(shard: dict[str, torch.Tensor], indices: list[int], max_len: int,
            target_features: TargetFeatures | None = None) -> tuple[torch.Tensor, ...]:
    """Samples padded into [B, T] tensors: features, final_hidden, tokens, valid, loss_mask (the
    answer). The features come from `target_features` when given (a tokens-only shard needs it),
    else from the shard."""
    offsets, prompt_lens = shard["offsets"], shard["prompt_lens"]
    lengths = [min(int(offsets[i + 1] - offsets[i]), max_len) for i in indices]
    samples = [shard["tokens"][int(offsets[i]) : int(offsets[i]) + n].long() for i, n in zip(indices, lengths)]
    if target_features is not None:
        stored = target_features([s.tolist() for s in samples])
    elif "features" in shard:
        stored = [(shard["features"][int(offsets[i]) :][:n], shard["final_hidden"][int(offsets[i]) :][:n])
                  for i, n in zip(indices, lengths)]
    else:
        raise ValueError("a shard without features (distilled tokens only) needs the target to recompute them")
    t = max(lengths)
    tokens = torch.zeros(len(indices), t, dtype=torch.long)
    features = torch.zeros(len(indices), t, stored[0][0].shape[1])
    final_hidden = torch.zeros(len(indices), t, stored[0][1].shape[1])
    valid = torch.zeros(len(indices), t, dtype=torch.bool)
    loss_mask = torch.zeros(len(indices), t, dtype=torch.bool)
    for row, (i, n, sample, (f, h)) in enumerate(zip(indices, lengths, samples, stored)):
        tokens[row, :n] = sample
        features[row, :n] = f.float()
        final_hidden[row, :n] = h.float()
        valid[row, :n] = True
        loss_mask[row, int(prompt_lens[i]) : n] = True
    return features, final_hidden, tokens, valid, loss_mask


def train(cfg: TrainConfig) -> Path:
    with held(cfg.out_dir):
        return _train(cfg)


def _train(cfg: TrainConfig) -> Path:
    torch.manual_seed(cfg.seed)
    shards = shard_paths(cfg.data_dir)
    ckpt_dir = cfg.out_dir / "checkpoints"
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model_dir(cfg.target)
    target = ModelConfig.from_dir(model_dir)
    weights = load_weights(model_dir, torch.float32, torch.device("cpu"))
    state = torch.load(ckpt_dir / "latest.pt", weights_only=False) if (ckpt_dir / "latest.pt").exists() else None
    if state is not None:  # a resumed run keeps the sample length it started with (512 before 1024 was the default)
        cfg = replace(cfg, max_len=state.get("data", {}).get("max_len", 512))
    init = load_weights(cfg.init_from, torch.float32, torch.device("cpu")) if cfg.init_from else None
    repeated = repeated_samples(shards)
    if state is None:
        vocab, coverage = draft_vocab(answer_token_counts(repeated, target.vocab_size), cfg.draft_vocab_size, init)
    else:
        vocab, coverage = state["draft_vocab"], state["coverage"]
    embed = weights["model.embed_tokens.weight"]
    aux = _aux_layers(cfg, state, target)
    model = TrainableEagle3(target, vocab, embed, *_head_shape(cfg, state, init), aux_layer_ids=aux)
    teacher = TargetDistribution(weights["model.norm.weight"], weights.get("lm_head.weight", embed)[vocab],
                                 target.rms_norm_eps)
    if init is not None:
        model.load_exported(init)
    else:  # the head starts as the target's own final norm and head, restricted to the draft vocabulary
        with torch.no_grad():
            model.norm.copy_(teacher.norm)
            model.lm_head.weight.copy_(teacher.head_rows)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    indexes = {p: load_index(p) for p in shards}  # read once: the schedule, the answers and the report count from them
    per_epoch = sum(len(_batches(indexes[p], cfg, random.Random(0), repeated[p])) for p in shards)
    total_steps = max(1, int(per_epoch * cfg.epochs))
    trained = cfg.epochs * sum(answer_tokens(indexes[p], cfg.max_len, repeated[p]) for p in shards)
    for tokens in cfg.snapshot_tokens:
        if tokens > trained:
            log.warning("no snapshot at %gM answer tokens: this run trains on %.2fM (%g epochs of the shards' "
                        "answers, repeats skipped)", tokens / 1e6, trained / 1e6, cfg.epochs)
    progress = {"step": 0, "tokens": 0, "answer_tokens": 0, "seconds": 0.0}
    # What the step count indexes: resumed on other shards or batching, the skip of the steps done
    # would land on other batches (some trained twice, others never). (More epochs go on in order.)
    data = {"shards": sorted(p.name for p in shards), "repeated": sum(map(len, repeated.values())),
            **{k: getattr(cfg, k) for k in ("batch_tokens", "max_len", "seed")}}
    if state is not None and state.get("data", data) != data:  # (runs started before this check: not checked)
        changed = ", ".join(k for k in data if state["data"].get(k) != data[k])
        raise ValueError(f"the run in {cfg.out_dir} was started on other data or settings ({changed} differ): "
                         "resuming would repeat or skip batches; give the same, or train into a new --out")
    objective = {k: getattr(cfg, k) for k in ("ttt_steps", "lr", "warmup_steps")}
    if state is not None:
        _check_resumable(state, objective, total_steps, cfg)
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        progress = state["progress"]
        if "answer_tokens" not in progress and cfg.snapshot_tokens:  # a run from before they were counted
            log.warning("the run in %s did not count answer tokens: no snapshot is taken in it", cfg.out_dir)
            cfg = replace(cfg, snapshot_tokens=())
    schedule = lambda step: min(1.0, (step + 1) / cfg.warmup_steps) * 0.5 * (1 + math.cos(math.pi * min(step / total_steps, 1.0)))
    # Shards distilled without features, or with other layers': the target recomputes them, one
    # forward per batch.
    stored = aux == target.aux_layer_ids and all(has_features(p) for p in shards)
    recompute = None if stored else TargetFeatures(cfg.target, max(cfg.batch_tokens, cfg.max_len), aux)
    # kept in every checkpoint
    meta = {"draft_vocab": vocab, "coverage": coverage, "data": data, "objective": objective, "total_steps": total_steps}
    _run(model, teacher, optim, schedule, repeated, cfg, progress, total_steps, ckpt_dir, meta, recompute)
    model.export(cfg.out_dir)
    write_text_durably(cfg.out_dir / "training.json", json.dumps(
        {"config": {k: str(v) for k, v in asdict(cfg).items()}, "draft_vocab_coverage": coverage,
         "samples": sum(indexes[p]["prompt_lens"].numel() - len(repeated[p]) for p in shards),
         "repeated_samples_skipped": data["repeated"], **progress,
         "total_steps": total_steps, "finished": progress["step"] >= total_steps}, indent=2) + "\n")
    return cfg.out_dir


def _head_shape(cfg: TrainConfig, state: dict | None, init: dict[str, torch.Tensor] | None) -> tuple[int | None, int]:
    """The head's MLP width and layers: a resumed run's own, or those of the head it continues from
    (the flags may be left out, not changed), else the config's."""
    if state is not None:
        model = state["model"]
        found = (model["up_proj.weight"].shape[0], 1 + sum(k.endswith(".input_layernorm") for k in model))
        source = f"the run in {cfg.out_dir} was started with"
    elif init is not None:
        found, source = (exported_mlp_width(init), exported_depth(init)), f"the head to continue from ({cfg.init_from}) has"
    else:
        return cfg.intermediate_size, cfg.num_layers or 1
    for flag, asked, have in (("--draft-intermediate-size", cfg.intermediate_size, found[0]),
                              ("--draft-layers", cfg.num_layers, found[1])):
        if asked not in (None, have):
            raise ValueError(f"{flag} {asked}: {source} {have}; give that (or train from scratch into a new --out)")
    return found


def _aux_layers(cfg: TrainConfig, state: dict | None, target: ModelConfig) -> tuple[int, ...]:
    """The target layers the head reads: a resumed run's or a continued head's own (the flag may be
    left out, not changed), else the config's, else EAGLE3's default."""
    asked = None if cfg.aux_layer_ids is None else target.check_aux_layer_ids(tuple(cfg.aux_layer_ids))
    if state is not None:  # (runs started before the flag existed read the default)
        found, source = tuple(state.get("aux_layer_ids", target.aux_layer_ids)), f"the run in {cfg.out_dir} was started with"
    elif cfg.init_from is not None:
        found = head_aux_layer_ids(cfg.init_from) or target.aux_layer_ids
        source = f"the head to continue from ({cfg.init_from}) reads"
    else:
        return asked or target.aux_layer_ids
    if asked not in (None, found):
        raise ValueError(f"--aux-layers {' '.join(map(str, asked))}: {source} "
                         f"{' '.join(map(str, found))}; give those (or train from scratch into a new --out)")
    return found


def _run(model, teacher, optim, schedule, repeated: dict[Path, frozenset[int]], cfg, progress, total_steps,
         ckpt_dir, meta: dict, recompute: TargetFeatures | None) -> None:
    """Train until total_steps (or out of time), over the shards of `repeated` (each with the
    samples it skips), in an order fixed by the seed and the epoch."""
    bar = tqdm(total=total_steps, initial=progress["step"], desc="training eagle3", unit="step")
    started, last_ckpt, step = time.time() - progress["seconds"], time.time(), 0  # started: of the whole run
    this_run = time.time()
    epoch = 0
    while progress["step"] < total_steps:
        rng = random.Random(cfg.seed + epoch)
        order = list(repeated)
        rng.shuffle(order)
        for path in order:
            if progress["step"] >= total_steps or _out_of_time(cfg, this_run):
                break  # (loading the shards left would only delay the checkpoint)
            shard = load_shard(path)
            for batch in _batches(shard, cfg, rng, repeated[path]):
                if step < progress["step"]:  # resuming: skip what the checkpoint already trained on
                    step += 1
                    continue
                if progress["step"] >= total_steps or _out_of_time(cfg, this_run):
                    break
                tensors = collate(shard, batch, cfg.max_len, recompute)
                metrics = _train_step(model, teacher, optim, schedule(progress["step"]), *tensors, cfg)
                seen = progress.get("answer_tokens", 0)
                step += 1
                progress["step"] = step
                progress["tokens"] += metrics.pop("tokens")
                progress["answer_tokens"] = seen + metrics.pop("answer_tokens")
                progress["seconds"] = time.time() - started
                bar.update(1)
                bar.set_postfix(metrics)
                _snapshots(model, cfg, seen, progress)
                if time.time() - last_ckpt > cfg.checkpoint_every_s:
                    _checkpoint(ckpt_dir, model, optim, progress, meta)
                    last_ckpt = time.time()
        epoch += 1
        if _out_of_time(cfg, this_run):
            break
    _checkpoint(ckpt_dir, model, optim, progress, meta)
    bar.close()


def _snapshots(model, cfg: TrainConfig, seen_before: int, progress: dict) -> None:
    """The head exported at each snapshot size (answer tokens) this step took training past (a size
    passed before this run resumed, or added after it was passed, is not taken later under its name)."""
    for tokens in cfg.snapshot_tokens:
        out = cfg.out_dir / "snapshots" / f"{tokens / 1e6:g}M"
        if seen_before < tokens <= progress["answer_tokens"] and not (out / "progress.json").exists():
            model.export(out)
            fsync_tree(out)
            write_text_durably(out / "progress.json", json.dumps(progress) + "\n")  # last: marks it complete


def _out_of_time(cfg: TrainConfig, since: float) -> bool:
    return cfg.max_hours is not None and time.time() - since > cfg.max_hours * 3600


def _train_step(model, teacher, optim, lr_scale, features, final_hidden, tokens, valid, loss_mask, cfg) -> dict:
    for group in optim.param_groups:
        group["lr"] = cfg.lr * lr_scale
    # bf16 GEMMs (AVX512-BF16/AMX where the CPU has them) with fp32 master weights and loss.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        normed = model.unroll_normed(features, tokens, valid, cfg.ttt_steps)
    loss, metrics = 0.0, {"tokens": int(valid.sum()), "answer_tokens": int(loss_mask.sum())}
    labels_at = [model.labels(tokens, loss_mask, k) for k in range(len(normed))]
    masks = [labels >= 0 for labels in labels_at]
    target_p, row_of = _target_probs(teacher, final_hidden, masks)
    for k, (step_normed, labels, mask) in enumerate(zip(normed, labels_at, masks)):
        if not mask.any():
            continue
        rows, cols = mask.nonzero(as_tuple=True)
        step_loss, accuracy = head_soft_label_loss(step_normed[mask], model.lm_head.weight, target_p,
                                                   row_of[rows, cols + 1 + k], labels[mask])
        loss = loss + 0.8**k * step_loss
        metrics[f"acc{k}"] = round(accuracy, 3)
    if not torch.is_tensor(loss):
        return metrics
    optim.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optim.step()
    metrics["loss"] = round(loss.item(), 3)
    return metrics


def _target_probs(teacher: TargetDistribution, final_hidden: torch.Tensor,
                  masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions the unroll steps' losses need, each position computed once.

    Index t of step k predicts token t+2+k, whose distribution comes from position t+1+k, so
    steps share most positions. Returns the distributions [n, N] and, per [B, T] position, its
    row among them."""
    needed = torch.zeros_like(masks[0])
    for k, mask in enumerate(masks):
        rows, cols = mask.nonzero(as_tuple=True)
        needed[rows, cols + 1 + k] = True
    row_of = torch.full(needed.shape, -1, dtype=torch.long)
    row_of[needed] = torch.arange(int(needed.sum()))
    return teacher.probs(final_hidden[needed]), row_of


def _check_resumable(state: dict, objective: dict, total_steps: int, cfg: TrainConfig) -> None:
    """The loss and learning rate a run trains with stay its own: resumed with other settings (a
    command missing the recipe's flags takes the CLI's defaults), it would go on silently with
    another unroll depth and a schedule jumping mid-run. (Runs from before this check: unchecked.)"""
    if (started := state.get("objective", objective)) != objective:
        changed = ", ".join(f"{k} {started[k]} (now {objective[k]})" for k in objective if started[k] != objective[k])
        raise ValueError(f"the run in {cfg.out_dir} was started with {changed}: give the same, or train into a new --out")
    if (before := state.get("total_steps", total_steps)) != total_steps:  # more epochs: a warm restart
        log.warning("the learning rate's cosine now spans %d steps (it spanned %d): --epochs %g restarts it at "
                    "%.2f of its peak", total_steps, before, cfg.epochs,
                    0.5 * (1 + math.cos(math.pi * min(state["progress"]["step"] / total_steps, 1.0))))


def _checkpoint(ckpt_dir: Path, model, optim, progress, meta: dict) -> None:
    tmp = ckpt_dir / "latest.pt.tmp"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict(), "progress": dict(progress),
                "aux_layer_ids": model.aux_layer_ids, **meta}, tmp)
    replace_durably(tmp, ckpt_dir / "latest.pt")
