"""Verification: which draft tokens the target accepts, and the token that follows them.

Inputs are ragged: sequence b owns rows [start_b, start_b + len(drafts[b]) + 1) of the target's
logits (one row per draft position plus the bonus position), with start_b the running sum of
the earlier sequences' len(drafts) + 1.

A proposal may be a tree (`parents`: draft i continues draft parents[i], -1 the last real
token; parents come first, siblings are distinct tokens); a chain is the tree whose parents are
i - 1. Its row i + 1 holds the target's logits after draft i's path. Each row has the target's
choice there: greedy, its argmax; sampled, a draw of the sampling distribution p at that row
with the uniform of the position it samples (engine.sampling.position_uniforms: the root's row
samples the position after the last real token, a draft's row the one after the draft). The
walk goes down from the root: a child is accepted when it is the target's choice at its parent's
row (at most one is: siblings differ); where no child is, the choice there is the token that
follows.

Greedy, the output is token-identical to plain greedy decoding. Sampled, it is token-identical
to plain sampling with the same seed (each position's token is p's draw with that position's
uniform, whatever was drafted), so the target's distribution is reproduced exactly: drafts are
the draft model's top choices (or n-gram lookups), a one-hot proposal q, for which accepting d
when p's draw is d is the rule min(1, p(d) / q(d)) = p(d) of Leviathan et al. and Chen et al.
(2023), and the draw on rejection follows p without d. With no drafts this is plain sampling,
so the engine has one sampling path. The output names the accepted drafts' indices (`paths`):
their KV must move to consecutive slots. The Triton kernel in triton_rejection.py computes the
same from the same inputs on CUDA.
"""

from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.params import SamplingParams
from engine.sampling import position_uniforms, probabilities


@dataclass
class VerifyInput:
    """The ragged per-sequence facts as host lists (a few per sequence: tensors of them cost more to
    build and read back than the walk itself on CPU; the Triton path copies them to its device), the
    per-row ones as tensors."""

    drafts: list[list[int]]  # per sequence, its draft tokens (target-vocabulary ids)
    target_logits: torch.Tensor  # [D + B, V]
    target_probs: torch.Tensor | None  # [D + B, V] sampling distribution p (rows of greedy sequences unused)
    greedy: list[bool]  # per sequence
    uniforms: torch.Tensor  # [D + B] fp32 in [0, 1): each row's draw (rows of greedy sequences unused)
    parents: list[list[int]] | None = None  # per sequence, each draft's parent (-1: the root); None: chains


@dataclass
class VerifyOutput:
    tokens: list[list[int]]  # per sequence: its accepted drafts, then one more token
    paths: list[list[int]]  # per sequence: the accepted drafts' indices among its drafts


def make_verify_input(params: list[SamplingParams], seeds: list[int], positions: list[int], drafts: list[list[int]],
                      logits: torch.Tensor, parents: list[list[int] | None] | None = None) -> VerifyInput:
    """Inputs for sequences with these params, seeds and drafts; positions: per sequence, the
    position its root row samples (its length); logits: [sum(len(d) + 1), V] in order; parents:
    per sequence, its drafts' parents for a tree, or None for a chain."""
    tree = None
    if parents is not None and any(t is not None for t in parents):
        tree = [t if t is not None else list(range(-1, len(d) - 1)) for d, t in zip(drafts, parents)]
    # Sampled sequences' rows: p, and each row's uniform. Greedy rows read neither (their uniforms
    # stay zero: one tensor, not a draw per sequence and step).
    probs, uniforms = None, torch.zeros(sum(len(d) + 1 for d in drafts))
    if not all(p.greedy for p in params):
        probs = torch.empty_like(logits)
        # The rows of sequences that sample alike go through `probabilities` together (per row, its
        # topk and softmax are ~0.2 ms of torch calls: a third of a batch-16 step's time at top-p);
        # a row's distribution does not depend on the rows beside it.
        groups: dict[tuple[float, int, float], tuple[SamplingParams, list[int]]] = {}
        row = 0
        for s, (p, d) in enumerate(zip(params, drafts)):
            if not p.greedy:
                groups.setdefault((p.temperature, p.top_k, p.top_p), (p, []))[1].extend(range(row, row + len(d) + 1))
                depths = _depths(tree[s] if tree else range(-1, len(d) - 1))
                uniforms[row : row + len(d) + 1] = torch.tensor(
                    position_uniforms(seeds[s], [positions[s]] + [positions[s] + k for k in depths]))
            row += len(d) + 1
        for p, rows in groups.values():
            index = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else rows
            probs[index] = probabilities(logits[index], p)
    return VerifyInput(drafts, logits, probs, [p.greedy for p in params], uniforms, tree)


def _depths(parents) -> list[int]:
    """Each draft's depth below the root (1: a child of the root); parents come first."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 + (depths[parent] if parent >= 0 else 0))
    return depths


def verify(inp: VerifyInput) -> VerifyOutput:
    argmax = _argmax_rows(inp.target_logits)
    starts, row = [], 0
    for drafts in inp.drafts:
        starts.append(row)
        row += len(drafts) + 1
    # A sampled row is drawn only when the walk reaches it (a tree's other rows are never needed;
    # a draw is a pass over the vocabulary); the root rows, always needed, in one call.
    roots = [start for start, greedy in zip(starts, inp.greedy) if not greedy]
    drawn = dict(zip(roots, _draw_rows(inp, roots))) if roots else {}

    def choice(r: int, greedy: bool) -> int:
        if greedy:
            return argmax[r]
        if r not in drawn:
            drawn[r] = _draw_rows(inp, [r])[0]
        return drawn[r]

    tokens, paths = [], []
    for s, (start, drafts, greedy) in enumerate(zip(starts, inp.drafts, inp.greedy)):
        parents = inp.parents[s] if inp.parents else range(-1, len(drafts) - 1)
        accepted, last = _accepted_path(drafts, parents, lambda at: choice(start + 1 + at, greedy))
        tokens.append([drafts[i] for i in accepted] + [last])
        paths.append(accepted)
    return VerifyOutput(tokens, paths)


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: on CPU by the native kernel (torch's took ~55 us a 4-row verification
    span and ~200 us a batch-16 step, 1-2 % of either), elsewhere by torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return cpu_kernels.kernels().argmax_rows(logits)
    return logits.argmax(dim=-1).tolist()


def _accepted_path(drafts: list[int], parents, choice) -> tuple[list[int], int]:
    """The drafts accepted from the root down, and the target's choice where the walk ended;
    choice(at): the target's choice after draft `at` (-1: the root), asked once per node reached."""
    accepted, at, chosen = [], -1, choice(-1)
    for i, (token, parent) in enumerate(zip(drafts, parents)):
        if parent == at and token == chosen:
            accepted.append(i)
            at, chosen = i, choice(i)
    return accepted, chosen


def _draw_rows(inp: VerifyInput, rows: list[int]) -> list[int]:
    """Each row's draw of p by its uniform, in one pass over the rows."""
    if inp.target_probs.device.type == "cpu" and inp.target_probs.dtype == torch.float32:
        # natively, without copying the rows (the same draws to rounding: sums by spans in vectors)
        return cpu_kernels.kernels().inverse_cdf(inp.target_probs, rows, inp.uniforms[rows])
    return reference_draw_rows(inp, rows)


def reference_draw_rows(inp: VerifyInput, rows: list[int]) -> list[int]:
    """_draw_rows by torch: the rows copied, then inverse_cdf."""
    return inverse_cdf(inp.target_probs[rows], inp.uniforms[rows])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Per row of weights [n, V] (need not sum to 1): the first index where the cumulative weight
    exceeds u * the row's total (u: [n]). A row's cumulative sum is a sequential scan, the same bits
    alone or among others."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    target = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp(max=weights.shape[-1] - 1).flatten().tolist()
