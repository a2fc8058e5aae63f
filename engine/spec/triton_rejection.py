"""Verification for CUDA as one Triton launch: same contract as `rejection.verify`, plus the
per-sequence bookkeeping that follows it.

Design: one program per sequence. Its rows start at draft_start_b + b (each earlier sequence owns
its drafts plus a bonus row), so a device-side cumsum of num_drafts is the only set-up. The
program walks its drafts (a chain, or a tree by draft_parents) down from the root in one pass
over them, each tested only if it continues the last accepted one, against the target's choice
at its parent's row: the argmax (greedy), or the row's inverse-CDF draw by its uniform (sampled:
over the vocabulary in BLOCK_V chunks, one pass for the total weight, a second that stops at the
chunk holding the draw), computed once per row the walk reaches. The choice where the walk ends
is the token that follows.

Greedy rows use torch's argmax over the logits, so ties break exactly as in the reference.

Numerics: the CDF accumulates in fp32 while the reference uses an fp64 cumsum; the partial sums
differ by ~1e-6 relative, so a draw can differ only when u lands within that of a CDF boundary.
"""

import torch
import triton
import triton.language as tl

from engine.spec.rejection import VerifyInput, VerifyOutput

# Vocabulary entries per chunk of the inverse-CDF loops: 4 KB of fp32 per load keeps enough
# loads in flight for the single program that owns a sequence.
BLOCK_V = 1024


@triton.jit
def _draw(p_row, u, vocab, stride_pv, BLOCK_V: tl.constexpr):
    """inverse_cdf(p_row, u): the first index whose cumulative weight exceeds u * total."""
    total = 0.0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        total += tl.sum(tl.load(p_row + offs * stride_pv, mask=offs < vocab, other=0.0).to(tl.float32), 0)
    threshold = u * total

    found = vocab  # vocab = not found yet
    last_positive = -1
    running = 0.0
    start = 0
    while (start < vocab) & (found == vocab):
        offs = start + tl.arange(0, BLOCK_V)
        w = tl.load(p_row + offs * stride_pv, mask=offs < vocab, other=0.0).to(tl.float32)
        cdf = running + tl.cumsum(w, 0)
        found = tl.min(tl.where(cdf > threshold, offs, vocab), 0)  # padding adds 0: never first
        last_positive = tl.maximum(last_positive, tl.max(tl.where(w > 0.0, offs, -1), 0))
        running += tl.sum(w, 0)
        start += BLOCK_V
    # fp32 keeps u * total below total for u < 1, but the chunked cumsum can end a rounding short
    # of the tree-summed total: if nothing exceeds the threshold, take the last token with weight
    # as exact arithmetic would, never a zero-weight one. No weight at all: the reference's clamp.
    return tl.where(found < vocab, found, tl.where(last_positive >= 0, last_positive, vocab - 1))


@triton.jit
def _choice(row, is_greedy, argmax, target_probs, uniforms, vocab, stride_pt, stride_pv, stride_u,
            BLOCK_V: tl.constexpr):
    """The target's choice at `row`: its argmax, or its draw by the row's uniform."""
    if is_greedy:
        choice = tl.load(argmax + row)
    else:
        u = tl.load(uniforms + row * stride_u)
        choice = _draw(target_probs + row * stride_pt, u, vocab, stride_pv, BLOCK_V).to(tl.int64)
    return choice


@triton.jit
def _verify_kernel(
    draft_ids, draft_parents, num_drafts, draft_start, greedy, argmax, target_probs, uniforms,
    tokens, num_accepted, path,
    vocab, width, path_width,
    stride_pt, stride_pv, stride_u,
    HAS_TREE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    n = tl.load(num_drafts + seq).to(tl.int32)
    first_draft = tl.load(draft_start + seq)
    first_row = first_draft + seq
    is_greedy = tl.load(greedy + seq) != 0
    out = tokens + seq.to(tl.int64) * width
    accepted = path + seq.to(tl.int64) * path_width

    # Walk down from the root (a chain is the tree with parents i - 1): a child of the last
    # accepted draft `at` is accepted when it is the choice at at's row (row 1 + at).
    a = 0
    at = -1
    choice = _choice(first_row, is_greedy, argmax, target_probs, uniforms, vocab, stride_pt, stride_pv, stride_u,
                     BLOCK_V)
    for i in range(0, n):
        if HAS_TREE:
            parent = tl.load(draft_parents + first_draft + i).to(tl.int32)
        else:
            parent = i - 1
        if parent == at:
            draft = tl.load(draft_ids + first_draft + i)
            if draft == choice:
                tl.store(out + a, draft)
                tl.store(accepted + a, i)
                a += 1
                at = i
                choice = _choice(first_row + 1 + i, is_greedy, argmax, target_probs, uniforms, vocab, stride_pt,
                                 stride_pv, stride_u, BLOCK_V)

    tl.store(out + a, choice)  # the choice where the walk ended follows the accepted drafts
    tl.store(num_accepted + seq, a)


def triton_verify(inp: VerifyInput) -> VerifyOutput:
    """`rejection.verify` on the logits' device (CUDA, or CPU under TRITON_INTERPRET=1): the per-sequence
    lists are copied to the device, the outputs read back (the step's one sync)."""
    device = inp.target_logits.device
    b = len(inp.drafts)
    if b == 0:
        return VerifyOutput([], [])
    assert inp.target_probs is not None or all(inp.greedy), "sampled sequences need target_probs"
    width = max(len(d) for d in inp.drafts) + 1
    tokens = torch.full((b, width), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    path = torch.full((b, max(width - 1, 1)), -1, dtype=torch.long, device=device)
    num_drafts = torch.tensor([len(d) for d in inp.drafts], dtype=torch.long, device=device)
    draft_ids = torch.tensor([t for d in inp.drafts for t in d], dtype=torch.long, device=device)
    greedy = torch.tensor(inp.greedy, dtype=torch.int8, device=device)
    uniforms = inp.uniforms.to(device)
    argmax = inp.target_logits.argmax(dim=-1)
    # Unused pointers still need a tensor: greedy-only batches never read p.
    probs = inp.target_probs if inp.target_probs is not None else inp.target_logits
    vocab = inp.target_logits.shape[-1]
    parents = (torch.tensor([p for ps in inp.parents for p in ps], dtype=torch.long, device=device)
               if inp.parents is not None else draft_ids)  # unread without a tree
    _verify_kernel[(b,)](
        draft_ids, parents, num_drafts, torch.cumsum(num_drafts, 0) - num_drafts, greedy, argmax, probs, uniforms,
        tokens, num_accepted, path,
        vocab, width, path.shape[1],
        *probs.stride(), uniforms.stride(0), HAS_TREE=inp.parents is not None,
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    rows = torch.cat([num_accepted[:, None], tokens, path], 1).tolist()  # one read back
    return VerifyOutput([row[1 : row[0] + 2] for row in rows], [row[1 + width : 1 + width + row[0]] for row in rows])
