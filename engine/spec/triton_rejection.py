"""Verification for CUDA as one Triton launch: same contract as `rejection.verify`, plus the
per-sequence bookkeeping that follows it.

Design: one program per sequence. Its rows start at draft_start_b + b (each earlier sequence owns
its drafts plus a bonus row), so a device-side cumsum of num_drafts is the only set-up. The
program walks its drafts (a chain, or a tree by draft_parents) down from the root in one pass
over them, each tested only if it continues the last accepted one: greedy rows against a
precomputed argmax, sampled rows by the accept test. Then it emits the argmax at the row where
the walk ended, or an inverse-CDF sample there over the vocabulary in BLOCK_V chunks (one pass
for the total weight, a second that stops at the chunk holding the sample), with the residual
max(0, p - q) (or p with the rejected drafts zeroed) formed on the fly from the rows already in
memory.

Greedy rows use torch's argmax over the logits, so ties break exactly as in the reference.

Numerics: the accept test is exact (fp64, where the product of two fp32 values is exact, as in the
reference's Python floats). The CDF accumulates in fp32 while the reference uses an fp64 cumsum;
the partial sums differ by ~1e-6 relative, so a sample can differ only when u lands within that
of a CDF boundary. For 16-bit probabilities, p - q is rounded to that dtype as torch does.
"""

import torch
import triton
import triton.language as tl

from engine.spec.rejection import VerifyInput, VerifyOutput

# Vocabulary entries per chunk of the inverse-CDF loops: 4 KB of fp32 per load keeps enough
# loads in flight for the single program that owns a sequence.
BLOCK_V = 1024
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """fp32 x rounded to DTYPE (nearest, ties to even), kept in fp32. bf16 is rounded by hand:
    x.to(tl.bfloat16) does the same on GPU, but the interpreter truncates."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    elif DTYPE == tl.float16:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _weights(p_row, q_row, offs, q_end, drafts, parents, n, at, vocab, stride_pv, stride_qv,
             HAS_Q: tl.constexpr, HAS_TREE: tl.constexpr, RESIDUAL_DTYPE: tl.constexpr):
    """Sampling weights at offs for a walk that ended at draft `at` (-1: the root): dense q, the
    residual max(0, p - q) after a rejection (q_end = vocab; 0: p itself, the bonus row); one-hot
    q, p without at's children (all were tried and rejected). q_end is a bound rather than a flag
    because the interpreter mishandles a scalar bool broadcast into a load mask."""
    p = tl.load(p_row + offs * stride_pv, mask=offs < vocab, other=0.0).to(tl.float32)
    if HAS_Q:
        q = tl.load(q_row + offs * stride_qv, mask=offs < q_end, other=0.0).to(tl.float32)
        # torch rounds p - q to the promoted dtype of p and q (bf16 for bf16 inputs); so do we.
        w = _round(tl.maximum(p - q, 0.0), RESIDUAL_DTYPE)
    else:
        w = p
        for j in range(0, n):
            if HAS_TREE:
                parent = tl.load(parents + j).to(tl.int32)
            else:
                parent = j - 1
            excluded = tl.where(parent == at, tl.load(drafts + j), -1)
            w = tl.where(offs == excluded, 0.0, w)
    return w


@triton.jit
def _sample(p_row, q_row, q_end, drafts, parents, n, at, u, vocab, stride_pv, stride_qv,
            HAS_Q: tl.constexpr, HAS_TREE: tl.constexpr, RESIDUAL_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr):
    """inverse_cdf(weights, u): the first index whose cumulative weight exceeds u * total."""
    total = 0.0
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        w = _weights(p_row, q_row, offs, q_end, drafts, parents, n, at, vocab, stride_pv, stride_qv,
                     HAS_Q, HAS_TREE, RESIDUAL_DTYPE)
        total += tl.sum(w, 0)
    threshold = u * total

    found = vocab  # vocab = not found yet
    last_positive = -1
    running = 0.0
    start = 0
    while (start < vocab) & (found == vocab):
        offs = start + tl.arange(0, BLOCK_V)
        w = _weights(p_row, q_row, offs, q_end, drafts, parents, n, at, vocab, stride_pv, stride_qv,
                     HAS_Q, HAS_TREE, RESIDUAL_DTYPE)
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
def _verify_kernel(
    draft_ids, draft_parents, num_drafts, draft_start, greedy, argmax, target_probs, draft_probs, uniforms,
    tokens, num_accepted, path,
    vocab, width, path_width,
    stride_pt, stride_pv, stride_qt, stride_qv, stride_ut, stride_uc,
    HAS_Q: tl.constexpr, HAS_TREE: tl.constexpr, RESIDUAL_DTYPE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    seq = tl.program_id(0)
    n = tl.load(num_drafts + seq).to(tl.int32)
    first_draft = tl.load(draft_start + seq)
    first_row = first_draft + seq
    is_greedy = tl.load(greedy + seq) != 0
    out = tokens + seq.to(tl.int64) * width
    accepted = path + seq.to(tl.int64) * path_width

    # Walk down from the root (a chain is the tree with parents i - 1), testing the children of
    # the last accepted draft `at` in order (row 1 + at holds the logits after it).
    a = 0
    at = -1
    rejected = 0  # children of `at` rejected so far
    rejected_mass = tl.load(uniforms).to(tl.float64) * 0.0  # their p (fp64, as the reference's floats)
    rejected_q = first_draft  # the rejected draft's row of a dense q (chains only)
    for i in range(0, n):
        if HAS_TREE:
            parent = tl.load(draft_parents + first_draft + i).to(tl.int32)
        else:
            parent = i - 1
        if parent == at:
            draft = tl.load(draft_ids + first_draft + i)
            at_row = first_row + 1 + at
            if is_greedy:
                ok = tl.load(argmax + at_row) == draft
            else:
                # Accept with probability p(d) / (p's mass not yet rejected here) for one-hot q,
                # min(1, p(d) / q(d)) for a dense q: u * mass < p(d), exact in fp64.
                p_d = tl.load(target_probs + at_row * stride_pt + draft * stride_pv).to(tl.float32).to(tl.float64)
                u = tl.load(uniforms + (first_row + i) * stride_ut).to(tl.float64)
                if HAS_Q:
                    q_d = tl.load(draft_probs + (first_draft + i) * stride_qt + draft * stride_qv)
                    mass = q_d.to(tl.float32).to(tl.float64)
                else:
                    mass = 1.0 - rejected_mass
                ok = u * mass < p_d
                rejected_mass += tl.where(ok, 0.0, p_d)
            if ok:
                tl.store(out + a, draft)
                tl.store(accepted + a, i)
                a += 1
                at = i
                rejected = 0
                rejected_mass = rejected_mass * 0.0
            else:
                rejected += 1
                rejected_q = first_draft + i

    # The token after the walk: the argmax at its last row, or a sample of the residual there.
    at_row = first_row + 1 + at
    if is_greedy:
        last = tl.load(argmax + at_row)
    else:
        u = tl.load(uniforms + at_row * stride_ut + stride_uc)
        last = _sample(target_probs + at_row * stride_pt, draft_probs + rejected_q * stride_qt,
                       tl.where(rejected > 0, vocab, 0), draft_ids + first_draft, draft_parents + first_draft,
                       n, at, u, vocab, stride_pv, stride_qv, HAS_Q, HAS_TREE, RESIDUAL_DTYPE, BLOCK_V).to(tl.int64)

    tl.store(out + a, last)
    tl.store(num_accepted + seq, a)


def triton_verify(inp: VerifyInput) -> VerifyOutput:
    """`rejection.verify` on the logits' device (CUDA, or CPU under TRITON_INTERPRET=1).

    The small per-sequence inputs may live on the CPU (as `make_verify_input` builds them); they
    are copied to the logits' device. The output width needs max(num_drafts) on the host, the
    only sync (none when num_drafts is already on the CPU).
    """
    device = inp.target_logits.device
    b = inp.num_drafts.shape[0]
    width = int(inp.num_drafts.max()) + 1 if b else 1
    tokens = torch.full((b, width), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(b, dtype=torch.long, device=device)
    path = torch.full((b, max(width - 1, 1)), -1, dtype=torch.long, device=device)
    if b == 0:
        return VerifyOutput(tokens, num_accepted, path)
    assert inp.target_probs is not None or bool(inp.greedy.all()), "sampled sequences need target_probs"

    num_drafts = inp.num_drafts.to(device, torch.long)
    draft_ids = inp.draft_ids.to(device, torch.long)
    greedy = inp.greedy.to(device, torch.int8)
    uniforms = inp.uniforms.to(device)
    argmax = inp.target_logits.argmax(dim=-1)
    # Unused pointers still need a tensor: greedy-only batches never read p, one-hot q never reads q.
    probs = inp.target_probs if inp.target_probs is not None else inp.target_logits
    q = inp.draft_probs if inp.draft_probs is not None else probs
    vocab = inp.target_logits.shape[-1]
    parents = inp.draft_parents.to(device, torch.long) if inp.draft_parents is not None else draft_ids  # unread
    _verify_kernel[(b,)](
        draft_ids, parents, num_drafts, torch.cumsum(num_drafts, 0) - num_drafts, greedy, argmax, probs, q, uniforms,
        tokens, num_accepted, path,
        vocab, width, path.shape[1],
        *probs.stride(), *q.stride(), *uniforms.stride(),
        HAS_Q=inp.draft_probs is not None, HAS_TREE=inp.draft_parents is not None, RESIDUAL_DTYPE=_TL_DTYPES[torch.promote_types(probs.dtype, q.dtype)],
        BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
    )
    return VerifyOutput(tokens, num_accepted, path)
