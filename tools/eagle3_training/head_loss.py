"""The head's lm_head and its soft-label cross-entropy in one pass over row chunks.

Written out, the loss of one unroll step holds [rows, 8192] logits, their fp32 copy, the
log-softmax and its product with the target's distribution, and the same again in the backward:
~80 MB a tensor, each a fresh mmap the kernel zeroes page by page (a sixth of a training step
went to that), and the elementwise passes over them cost as much as the head's GEMMs. Here the
logits of a few hundred rows live at a time: their gradient is softmax(z) - p (p sums to 1), so
it is formed at once, chunk by chunk, and the backward only scales what the forward kept.
"""

import torch
import torch.nn.functional as F

CHUNK_ROWS = 512  # [512, 8192] fp32 logits: 16 MB, under the allocator's mmap threshold


class _HeadSoftLabelLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_p, p_rows, labels):
        n = hidden.shape[0]
        h, w = hidden.to(torch.bfloat16), weight.to(torch.bfloat16)  # bf16 GEMMs, as under autocast
        grad_h = torch.empty(n, hidden.shape[1], dtype=torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32)
        loss, correct = torch.zeros((), dtype=torch.float64), 0
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, n))
            logits = F.linear(h[rows], w).float()
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            p = target_p[p_rows[rows]]
            # -sum p log softmax(z) = lse - sum p z (p sums to 1): no log-softmax tensor
            loss += lse.sum(dtype=torch.float64) - torch.linalg.vecdot(p, logits).sum(dtype=torch.float64)
            correct += int((logits.argmax(-1) == labels[rows]).sum())
            grad_z = logits.sub_(lse).exp_().sub_(p).to(torch.bfloat16)  # softmax(z) - p, in place
            grad_h[rows] = grad_z @ w
            grad_w += grad_z.T @ h[rows]
        ctx.save_for_backward(grad_h, grad_w)
        ctx.hidden_dtype = hidden.dtype
        accuracy = torch.tensor(correct / max(n, 1))
        ctx.mark_non_differentiable(accuracy)
        return (loss / max(n, 1)).float(), accuracy

    @staticmethod
    def backward(ctx, grad_loss, _grad_accuracy):
        grad_h, grad_w = ctx.saved_tensors
        n = max(grad_h.shape[0], 1)
        scale = grad_loss / n
        return (grad_h * scale).to(ctx.hidden_dtype), grad_w * scale, None, None, None


def head_soft_label_loss(hidden: torch.Tensor, weight: torch.Tensor, target_p: torch.Tensor,
                         p_rows: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Mean over rows of -sum_v p(v) log softmax(hidden @ weight.T)(v), and the share of rows whose
    argmax is `labels`.

    hidden: [n, H], the head's normed output at the trained positions; weight: [N, H], its lm_head;
    target_p: [m, N] the target's distributions, row p_rows[i] for hidden row i; labels: [n]."""
    loss, accuracy = _HeadSoftLabelLoss.apply(hidden, weight, target_p, p_rows, labels)
    return loss, float(accuracy)
