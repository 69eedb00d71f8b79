"""The clipping helpers the flush-free engine uses at the batch boundary, against the plain torch ops they replace."""
import torch

from ds_async.optim import clip


def test_fused_scaled_copy_equals_copying_then_scaling():
    """The pass that hands bf16 gradients to fp32 buffers already clipped writes exactly what a copy followed by an
    in-place scale writes, into the same buffers (its GPU kernel: tests/test_passes_triton.py)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 48), (48,), (300, 7), (5,)]
    src = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in shapes]
    scale = torch.tensor(0.0123)
    want = [torch.empty(s) for s in shapes]
    torch._foreach_copy_(want, src)
    torch._foreach_mul_(want, scale)
    got = [torch.full(s, float("nan")) for s in shapes]
    ptrs = [t.data_ptr() for t in got]
    clip.copy_scaled_(got, src, scale)
    assert [t.data_ptr() for t in got] == ptrs
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_norm_of_bf16_gradients_equals_norm_of_their_fp32_copies():
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(s, generator=gen).to(torch.bfloat16) for s in [(128, 33), (1000,), (3,)]]
    torch.testing.assert_close(clip.squared_norm(grads), clip.squared_norm([g.float() for g in grads]), rtol=0,
                               atol=0)
