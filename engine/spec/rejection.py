"""Verification: which draft tokens the target accepts, and the token that follows them.

Inputs are ragged: sequence b owns rows [start_b, start_b + len(drafts[b]) + 1) of the target's
logits (one row per draft position plus the bonus position), with start_b the running sum of
the earlier sequences' len(drafts) + 1. Per sequence:
- greedy: accept the longest prefix where draft == target argmax, then emit the target's argmax
  at the first mismatch (or the bonus token after a full acceptance) -- token-identical to plain
  greedy decoding;
- sampled: drafts are the draft model's top choices (or n-gram lookups), not samples, so the
  proposal q is one-hot: accept draft d with probability p(d) (the one-hot case of min(1, p/q),
  Leviathan et al.; Chen et al., 2023); on rejection emit a sample of p without d; after full
  acceptance a bonus sample of p. This reproduces the target distribution p exactly.
With no drafts this is plain sampling, so the engine has one sampling path.

A proposal may be a tree (`parents`: draft i continues draft parents[i], -1 the last real
token; parents come first, siblings are distinct tokens). Its row i + 1 holds the target's
logits after draft i's path, and acceptance walks down from the root, testing the current
node's children in proposal order:
- greedy: a child is accepted when it is the target's argmax at the current node's row (at most
  one can be);
- sampled: a child d is accepted with probability p(d) / (1 - the mass of p its rejected elder siblings hold); when all
  are rejected, the emitted token is a sample of p without them. Each token then comes out with
  probability p exactly: p(c1), (1 - p(c1)) p(c2) / (1 - p(c1)) = p(c2), ..., and for the others
  (1 - sum p(ci)) p(x) / (1 - sum p(ci)) (the one-hot case of SpecInfer's multi-candidate rule).
A chain is the tree whose parents are i - 1, and the walk is then the rules above. The output names the accepted drafts' indices (`paths`): their KV must move to
consecutive slots.

Randomness comes in as uniforms drawn from each sampled request's own generator, two per row:
the first of row start_b + i is draft i's accept test, the second of the row where the walk ends
its inverse-CDF sample. So a seeded request is reproducible. (Greedy requests draw none.) The
Triton kernel in triton_rejection.py computes the same from the same inputs on CUDA.
"""

from dataclasses import dataclass

import torch

from engine import cpu_kernels
from engine.params import SamplingParams
from engine.sampling import probabilities


@dataclass
class VerifyInput:
    """The ragged per-sequence facts as host lists (a few per sequence: tensors of them cost more to
    build and read back than the walk itself on CPU; the Triton path copies them to its device), the
    per-row ones as tensors."""

    drafts: list[list[int]]  # per sequence, its draft tokens (target-vocabulary ids)
    target_logits: torch.Tensor  # [D + B, V]
    target_probs: torch.Tensor | None  # [D + B, V] sampling distribution p (rows of greedy sequences unused)
    greedy: list[bool]  # per sequence
    uniforms: torch.Tensor  # [D + B, 2] fp32 in [0, 1)
    parents: list[list[int]] | None = None  # per sequence, each draft's parent (-1: the root); None: chains


@dataclass
class VerifyOutput:
    tokens: list[list[int]]  # per sequence: its accepted drafts, then one more token
    paths: list[list[int]]  # per sequence: the accepted drafts' indices among its drafts


def make_verify_input(params: list[SamplingParams], generators: list[torch.Generator], drafts: list[list[int]],
                      logits: torch.Tensor, parents: list[list[int] | None] | None = None) -> VerifyInput:
    """Inputs for sequences with these params and drafts; logits: [sum(len(d) + 1), V] in order;
    parents: per sequence, its drafts' parents for a tree, or None for a chain."""
    tree = None
    if parents is not None and any(t is not None for t in parents):
        tree = [t if t is not None else list(range(-1, len(d) - 1)) for d, t in zip(drafts, parents)]
    # Sampled sequences' rows: p, and two uniforms a row from the request's own generator. Greedy
    # rows read neither (their uniforms stay zero: one tensor, not a draw per sequence and step).
    probs, uniforms = None, torch.zeros(sum(len(d) + 1 for d in drafts), 2)
    if not all(p.greedy for p in params):
        probs = torch.empty_like(logits)
        # The rows of sequences that sample alike go through `probabilities` together (per row, its
        # topk and softmax are ~0.2 ms of torch calls: a third of a batch-16 step's time at top-p);
        # a row's distribution does not depend on the rows beside it.
        groups: dict[tuple[float, int, float], tuple[SamplingParams, list[int]]] = {}
        row = 0
        for p, g, d in zip(params, generators, drafts):
            if not p.greedy:
                groups.setdefault((p.temperature, p.top_k, p.top_p), (p, []))[1].extend(range(row, row + len(d) + 1))
                uniforms[row : row + len(d) + 1] = torch.rand(len(d) + 1, 2, generator=g)
            row += len(d) + 1
        for p, rows in groups.values():
            index = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] + 1 == len(rows) else rows
            probs[index] = probabilities(logits[index], p)
    return VerifyInput(drafts, logits, probs, [p.greedy for p in params], uniforms, tree)


def verify(inp: VerifyInput) -> VerifyOutput:
    argmax = _argmax_rows(inp.target_logits)
    tokens, paths, sampled, ends = [], [], [], []  # ends: a sampled walk's last row, the drafts rejected there
    row = 0
    for s, (drafts, greedy) in enumerate(zip(inp.drafts, inp.greedy)):
        n = len(drafts)
        parents = inp.parents[s] if inp.parents else range(-1, n - 1)
        if greedy:
            accepted = _greedy_path(drafts, parents, argmax[row:])
            last = argmax[row + 1 + accepted[-1]] if accepted else argmax[row]
        else:
            accepted, end = _stochastic_walk(inp, row, drafts, parents)
            sampled.append(s)
            ends.append(end)
            last = -1  # sampled below, with every sampled sequence's
        tokens.append([drafts[i] for i in accepted] + [last])
        paths.append(accepted)
        row += n + 1
    if ends:
        for s, token in zip(sampled, _sample_ends(inp, ends)):
            tokens[s][-1] = token
    return VerifyOutput(tokens, paths)


def _argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax: on CPU by the native kernel (torch's took ~55 us a 4-row verification
    span and ~200 us a batch-16 step, 1-2 % of either), elsewhere by torch."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return cpu_kernels.kernels().argmax_rows(logits)
    return logits.argmax(dim=-1).tolist()


def _greedy_path(drafts: list[int], parents, argmax: list[int]) -> list[int]:
    """The drafts accepted from the root down: argmax[0] is the target's choice after the root,
    argmax[i + 1] after draft i."""
    accepted, at = [], -1
    for i, (token, parent) in enumerate(zip(drafts, parents)):
        if parent == at and token == argmax[at + 1]:
            accepted.append(i)
            at = i
    return accepted


def _stochastic_walk(inp: VerifyInput, row: int, drafts: list[int], parents: list[int],
                     ) -> tuple[list[int], tuple[int, list[int]]]:
    """The accepted drafts (walking down as the module doc says), and where the walk ended: the row
    and the drafts rejected there (the token that follows is sampled from that row without them)."""
    p, u = inp.target_probs, inp.uniforms
    accepted, at, rejected = [], -1, []
    for i, (d, parent) in enumerate(zip(drafts, parents)):
        if parent != at:
            continue
        at_row = row + 1 + at
        mass = 1.0 - sum(float(p[at_row, t]) for t in rejected)  # p's mass not yet rejected here
        if float(u[row + i, 0]) * mass < float(p[at_row, d]):
            accepted.append(i)
            at, rejected = i, []
        else:
            rejected.append(d)
    return accepted, (row + 1 + at, rejected)


def _sample_ends(inp: VerifyInput, ends: list[tuple[int, list[int]]]) -> list[int]:
    """Per walk's end (row, drafts rejected there): a sample of p at that row without them, by the
    row's second uniform; all in one pass over the rows."""
    if inp.target_probs.device.type == "cpu" and inp.target_probs.dtype == torch.float32:
        # natively, without copying the rows (the same draws to rounding: sums by spans in vectors)
        rows = [row for row, _ in ends]
        return cpu_kernels.kernels().inverse_cdf(inp.target_probs, rows, inp.uniforms[rows, 1], [r for _, r in ends])
    return reference_sample_ends(inp, ends)


def reference_sample_ends(inp: VerifyInput, ends: list[tuple[int, list[int]]]) -> list[int]:
    """_sample_ends by torch: the rows copied, their rejected drafts zeroed, then inverse_cdf."""
    rows = [row for row, _ in ends]
    residual = inp.target_probs[rows]  # a copy
    for i, (_, rejected) in enumerate(ends):
        residual[i, rejected] = 0.0
    return inverse_cdf(residual, inp.uniforms[rows, 1])


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> list[int]:
    """Per row of weights [n, V] (need not sum to 1): the first index where the cumulative weight
    exceeds u * the row's total (u: [n]). A row's cumulative sum is a sequential scan, the same bits
    alone or among others."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    target = u.double()[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp(max=weights.shape[-1] - 1).flatten().tolist()
