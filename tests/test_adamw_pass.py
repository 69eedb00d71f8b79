"""The one-pass AdamW step equals torch's AdamW, bit for bit on CPU, and writes every output."""
import pytest
import torch

from ds_async.optim.adamw_pass import adamw_hyper, adamw_pass_

SHAPES = [(37, 5), (128,), (3, 7, 11), (1000,)]


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_adamw_pass_equals_torch_adamw(grad_dtype):
    """Five steps from bf16 gradients times a clip factor, with weight decay, tails of odd length, and gradients
    from large to tiny (where eps matters): master and both moments bit-equal to torch.optim.AdamW given the
    gradient that DeepSpeed's buffers of ``grad_dtype`` would hold, and every bf16 output the rounded master."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) * 0.02 for s in SHAPES]
    ref = [p.clone().requires_grad_() for p in params]
    opt = torch.optim.AdamW(ref, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    outs = [[torch.empty(s, dtype=torch.bfloat16) for s in SHAPES] for _ in range(2)]
    for step, magnitude in enumerate([1.0, 1e-2, 10.0, 1e-5, 1.0], start=1):
        grads = [(torch.randn(s, generator=gen) * magnitude).to(torch.bfloat16) for s in SHAPES]
        scale = torch.tensor(0.00075977)  # not a power of two: the product rounds
        for r, g in zip(ref, grads):
            r.grad = (g.to(grad_dtype) * scale.to(grad_dtype)).float()
        opt.step()
        adamw_pass_(params, grads, *moments, outs, adamw_hyper(opt.param_groups[0], step, torch.device("cpu")),
                    scale, grad_dtype)
        for k, r in enumerate(ref):
            state = opt.state[r]
            torch.testing.assert_close(params[k], r.detach(), rtol=0, atol=0)
            torch.testing.assert_close(moments[0][k], state["exp_avg"], rtol=0, atol=0)
            torch.testing.assert_close(moments[1][k], state["exp_avg_sq"], rtol=0, atol=0)
            for out in outs:
                assert torch.equal(out[k], params[k].to(torch.bfloat16))
