"""AdamW as one pass over each tensor, for DeepSpeed's bf16 optimizer at a flush-free batch boundary.

DeepSpeed's bf16 step, as the 2BW engine runs it on one replica, moves about 50 bytes a parameter: the clipped copy
of the bf16 gradient into DeepSpeed's gradient buffer (bf16 by default: 4), its fp32 cast for the optimizer (6),
torch's AdamW over fp32 master, gradient and both moments (28), the master cast into the module's bf16 weights (6),
those copied into the new weight version's slot (4), and the norm (2). The pass here reads the bf16 gradient, the
master and the moments once and writes the master, the moments, the bf16 weights and the slot: 30. Under 2BW that
traffic shares the GPU with the next batch's passes, so it costs step time.

The arithmetic is torch.optim.AdamW's single-tensor path, op for op and in the same order (bit-equal on CPU,
tested against torch). On GPUs it is a Triton kernel, one launch per run of same-shaped tensors
(:mod:`ds_async.optim.passes_triton`); its rounding may differ from torch's fused CUDA AdamW in the last bit, as
torch's own AdamW implementations differ from each other.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .gpu import same_shape_runs, triton_passes


def adamw_hyper(group: dict, step: int, device: torch.device) -> torch.Tensor:
    """The step's scalars in fp32 on ``device``, computed as torch's AdamW computes them (in double, from the step
    count after its increment) and rounded to fp32 where its tensor ops would round them."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    values = [1 - lr * wd, 1 - beta1, beta2, 1 - beta2, -(lr / bias_correction1), bias_correction2 ** 0.5, eps]
    host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _adamw_pass(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                exp_avg_sqs: list[torch.Tensor], outs: list[list[torch.Tensor]], hyper: torch.Tensor,
                grad_scale: torch.Tensor, grad_dtype: torch.dtype, update_sq: bool = False) -> torch.Tensor | None:
    if params[0].is_cuda:
        total = triton_passes().adamw(params, grads, exp_avgs, exp_avg_sqs, outs, hyper, grad_scale, grad_dtype)
        return total if update_sq else None
    decay, one_minus_beta1, beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps = hyper.unbind()
    total = None
    for k, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        g = (g.to(grad_dtype) * grad_scale).to(p.dtype)
        old = p.clone() if update_sq else None
        p.mul_(decay)
        m.lerp_(g, one_minus_beta1)
        # torch: addcmul_(g, g, value=1 - beta2), i.e. v + ((1 - beta2) * g) * g; the factor is pre-multiplied here
        # because a tensor cannot be ``value``, which rounds identically. Likewise addcdiv_'s value below.
        v.mul_(beta2).addcmul_(g * one_minus_beta2, g)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m * neg_step_size, denom)
        for out in outs:
            out[k].copy_(p)
        if old is not None:
            sq = (old - p).square().sum(dtype=torch.float32)
            total = sq if total is None else total + sq
    return total


@torch.no_grad()
def adamw_pass_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                exp_avg_sqs: Sequence[torch.Tensor], outs: Sequence[Sequence[torch.Tensor]], hyper: torch.Tensor,
                grad_scale: torch.Tensor, grad_dtype: torch.dtype = torch.float32, *, update_sq: bool = False
                ) -> torch.Tensor | None:
    """One AdamW step, in place, on fp32 ``params`` and moments from ``grads`` times ``grad_scale`` (a 0-dim
    tensor, e.g. the clip factor), with ``hyper`` from :func:`adamw_hyper`; each list in ``outs`` (e.g. bf16
    weights) receives the new params, tensor by tensor. The scaled gradient is computed and rounded in
    ``grad_dtype``, as DeepSpeed's gradient buffers of that dtype (its ``grad_accum_dtype``) would hold it.
    ``update_sq``: also return the update's sum of squares over all tensors (fp32, 0-dim; for the optimizer's
    statistics), else ``None``."""
    total = None
    scale = grad_scale.to(grad_dtype)
    for ks in same_shape_runs(params):
        run = _adamw_pass([params[k] for k in ks], [grads[k] for k in ks], [exp_avgs[k] for k in ks],
                          [exp_avg_sqs[k] for k in ks], [[o[k] for k in ks] for o in outs], hyper, scale, grad_dtype,
                          update_sq)
        total = run if total is None else total + run
    return total
