"""Gradient clipping by the norm of the whole model's gradient, across pipeline stages.

DeepSpeed's pipeline engine clips every stage by the average of the per-stage norms over all ranks, which is not
the model's norm; ds_async's engine sums squared norms over the pipeline instead, and the emulation uses the same
two functions so that both round alike.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` (fp32), this rank's share of the model's squared gradient norm."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # One foreach kernel reads every gradient once (no fp32 copies, no per-tensor launches): at the batch
    # boundary this shares the GPU with the next batch's passes (on the engine's side stream).
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def clip_(grads: Sequence[torch.Tensor], total_squared_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place so the model's gradient norm is at most ``max_norm``; returns the norm."""
    norm = total_squared_norm.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(list(grads), coef.to(grads[0].dtype))
    return norm
