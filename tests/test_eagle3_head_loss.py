"""The training head's fused lm_head + soft-label loss against the same loss written out in autograd."""

import pytest
import torch
import torch.nn.functional as F

from tools.eagle3_training import head_loss


@pytest.mark.parametrize("chunk_rows", [7, 512])  # many chunks (the last one short), and one
def test_fused_loss_and_gradients_match_autograd(monkeypatch, chunk_rows):
    monkeypatch.setattr(head_loss, "CHUNK_ROWS", chunk_rows)
    gen = torch.Generator().manual_seed(0)
    n, h, vocab, positions = 45, 32, 200, 60
    hidden = torch.randn(n, h, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(vocab, h, generator=gen).requires_grad_()
    target_p = torch.softmax(3 * torch.randn(positions, vocab, generator=gen), dim=-1)
    p_rows = torch.randint(0, positions, (n,), generator=gen)
    with torch.no_grad():  # labels the head gets right for some rows, so accuracy is neither 0 nor 1
        labels = torch.where(torch.arange(n) % 3 == 0, F.linear(hidden.float(), weight).argmax(-1),
                             torch.randint(0, vocab, (n,), generator=gen))

    loss, accuracy = head_loss.head_soft_label_loss(hidden, weight, target_p, p_rows, labels)
    (0.8 * loss).backward()
    fused = hidden.grad.float(), weight.grad.clone()
    hidden.grad = weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
    reference = -(target_p[p_rows] * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
    (0.8 * reference).backward()

    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    assert accuracy == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    assert 0 < accuracy < 1
    for mine, theirs in zip(fused, (hidden.grad.float(), weight.grad)):  # both round through bf16 GEMMs
        assert (mine - theirs).norm() < 0.01 * theirs.norm()
