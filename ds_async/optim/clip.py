"""Gradient clipping by the norm of the whole model's gradient, across pipeline stages."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def clip_by_global_norm(grads: Sequence[torch.Tensor], max_norm: float,
                        all_reduce: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Scale ``grads`` in place so their joint L2 norm is at most ``max_norm``; returns the norm before clipping.

    ``all_reduce`` sums the squared norm over the ranks that hold the rest of the model (the pipeline stages);
    DeepSpeed's own pipeline clipping instead averages per-stage norms over all ranks, which is not the model's
    norm, so the engine uses this everywhere it clips fp32 gradients and the emulation does too.
    """
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        sq += g.detach().float().pow(2).sum()
    if all_reduce is not None:
        all_reduce(sq)
    norm = sq.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(list(grads), coef.to(grads[0].dtype))
    return norm
