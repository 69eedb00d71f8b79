"""Gradient clipping by the norm of the whole model's gradient, across pipeline stages.

DeepSpeed's pipeline engine clips every stage by the average of the per-stage norms over all ranks, which is not
the model's norm; ds_async's engine sums squared norms over the pipeline instead, and the emulation uses the same
two functions so that both round alike.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .gpu import same_shape_runs, triton_passes


def squared_norm(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of ``grads`` (fp32), this rank's share of the model's squared gradient norm."""
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    # One foreach kernel reads every gradient once (no fp32 copies, no per-tensor launches): at the batch
    # boundary this shares the GPU with the next batch's passes (on the engine's side stream).
    norms = torch._foreach_norm([g.detach() for g in grads], 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()


def sum_in_stage_order(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """``((s0 + s1) + s2) + ...``: the model's squared norm from the stages' shares, added in one fixed order on
    every rank and in the emulation (an all-reduce adds in its backend's order: gloo, 4 ranks, s0 + (s1 + (s2 + s3))),
    so the clip factor is bit-equal between them."""
    total = partials[0]
    for s in partials[1:]:
        total = total + s
    return total


def clip_coefficient(total_squared_norm: torch.Tensor, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(the model's gradient norm, the factor that scales it to at most ``max_norm``), on the device."""
    norm = total_squared_norm.sqrt()
    return norm, torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_(grads: Sequence[torch.Tensor], total_squared_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale ``grads`` in place so the model's gradient norm is at most ``max_norm``; returns the norm."""
    norm, coef = clip_coefficient(total_squared_norm, max_norm)
    if grads:
        torch._foreach_mul_(list(grads), coef.to(grads[0].dtype))
    return norm


def copy_scaled_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], scale: torch.Tensor) -> None:
    """``dst = src * scale`` in ``dst``'s dtype: bit-equal to copying ``src`` into ``dst`` and then scaling ``dst``
    in place (one rounding either way), but on GPUs one pass (a Triton launch per run of same-shaped tensors) that
    reads ``src`` (bf16) once and writes ``dst`` once, instead of a copy and a read-modify-write of ``dst`` (fp32
    ``dst``: 6 bytes a parameter, not 14)."""
    for ks in same_shape_runs(dst):
        _copy_scaled([dst[k] for k in ks], [src[k] for k in ks], scale)


def _copy_scaled(dst: list[torch.Tensor], src: list[torch.Tensor], scale: torch.Tensor) -> None:
    scale = scale.to(dst[0].dtype)
    if dst[0].is_cuda:
        return triton_passes().copy_scaled(dst, src, scale)
    torch._foreach_copy_(dst, torch._foreach_mul([s.to(d.dtype) for d, s in zip(dst, src)], scale))
