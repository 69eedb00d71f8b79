"""The chunked cross-entropy equals ``F.cross_entropy`` on fp32 logits, value and gradient."""
import pytest
import torch
import torch.nn.functional as F

from ds_async.models.loss import causal_lm_loss, chunked_cross_entropy


@pytest.mark.parametrize("chunk", [1, 16, 37, 1000])
def test_chunked_equals_full_cross_entropy(chunk):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 37, 101, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 101, (2, 37), generator=gen)
    labels[0, :5] = -100  # ignored positions count neither in the sum nor in the mean
    x = logits.clone().requires_grad_()
    got = chunked_cross_entropy(x, labels, chunk)
    got.backward()
    y = logits.clone().requires_grad_()
    want = F.cross_entropy(y.flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    # The chunks run in fp32 whatever the input (as the full loss on .float() logits does).
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=0)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-8)


def test_chunked_loss_keeps_the_logits_dtype_for_the_gradient():
    logits = torch.randn(2, 8, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 8))
    causal_lm_loss(logits, labels, chunk=4).backward()
    assert logits.grad.dtype == torch.bfloat16
    full = logits.detach().float().requires_grad_()
    causal_lm_loss(full, labels).backward()
    torch.testing.assert_close(logits.grad.float(), full.grad, rtol=1e-2, atol=1e-4)
