"""Muon's update for hidden-layer matrices as pure functions (Jordan et al. 2024, "Muon: An optimizer for hidden
layers in neural networks"; the lr rules of Liu et al. 2025, "Muon is Scalable for LLM Training").

Momentum and orthogonalisation follow ``torch.optim.Muon`` op for op (same bf16 Newton-Schulz, same ``addmm``
calls) so that on 2-D parameters the orthogonalised direction is bit-equal to torch's (on CPUs; on GPUs the two
symmetric products take one triangle each, :mod:`ds_async.optim.ns_triton`). Tensors with more than two
dimensions are stacks of independent matrices over the leading dimensions (an MoE expert stack ``[E, rows, cols]``)
and are orthogonalised per matrix in one batched call.

A matrix may also be several matrices stored as one (Mixtral's fused expert ``gate_up_proj``: each expert's gate
rows, then its up rows). With ``row_blocks = k`` such a tensor is orthogonalised as ``k`` equal blocks of rows,
each its own matrix with its own learning-rate adjustment (:func:`split_rows`, :func:`block_shape`): bit-equal to
Muon on the ``k`` blocks as separate tensors, as a model storing them separately (the dense LLaMA MLP's
``gate_proj`` and ``up_proj``) would be updated.
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from .updates import decayed

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7
LR_RULES = ("original", "match_rms_adamw")


def wide_and_normalised(grad: Tensor, eps: float = NS_EPS) -> tuple[Tensor, bool]:
    """Newton-Schulz's start: ``grad`` in bf16 on the wide orientation (transposed when tall: the Gram matrix is
    then the smaller of the two), divided by its Frobenius norm (>= the spectral norm, so every singular value is
    <= 1 and the iteration converges); and whether it was transposed."""
    x = grad.bfloat16()
    tall = grad.size(-2) > grad.size(-1)
    if tall:
        x = x.mT
    return x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps), tall


def zeropower_via_newtonschulz(grad: Tensor, steps: int = NS_STEPS,
                               coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                               eps: float = NS_EPS) -> Tensor:
    """Approximately orthogonalise each matrix of ``grad`` (the last two dimensions) with the quintic Newton-Schulz
    iteration ``X <- a X + (b A + c A^2) X``, ``A = X X^T``; returns bf16 of the same shape.

    Runs in bf16 because the iteration is self-correcting and only needs singular values pushed into roughly
    [0.7, 1.2]; the coefficients maximise the slope at zero at the price of not converging to exactly 1. CUDA
    tensors on cards with bf16 tensor cores take :mod:`ds_async.optim.ns_triton` where Triton imports (the two
    symmetric products computed one triangle each: a third fewer FLOPs), others :func:`zeropower_matmul`.
    """
    if grad.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix or a stack of matrices, got shape {tuple(grad.shape)}")
    symmetric = _zeropower_symmetric(grad.device.index) if grad.is_cuda else None
    return (symmetric or zeropower_matmul)(grad, steps, coefficients, eps)


@functools.cache
def _zeropower_symmetric(device_index: int | None):
    """:func:`ds_async.optim.ns_triton.zeropower_symmetric` for that CUDA device, or None where Triton does not
    import or the card has no bf16 tensor cores (Triton's bf16 ``tl.dot`` needs compute capability 8.0)."""
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return None
    try:
        from .ns_triton import zeropower_symmetric
    except ImportError:
        return None
    return zeropower_symmetric


def zeropower_matmul(grad: Tensor, steps: int = NS_STEPS,
                     coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS) -> Tensor:
    """:func:`zeropower_via_newtonschulz` by torch's matrix products (cuBLAS on GPUs): each product whole."""
    a, b, c = coefficients
    x, tall = wide_and_normalised(grad, eps)
    if x.ndim == 2:
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        lead = x.shape[:-2]
        x = x.reshape(-1, *x.shape[-2:])
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
        x = x.reshape(*lead, *x.shape[-2:])
    return x.mT if tall else x


def adjusted_lr(lr: float, shape: torch.Size, rule: str) -> float:
    """The learning rate for a matrix of ``shape`` (rows, cols = the last two dimensions).

    ``original`` (Keller Jordan): ``lr * sqrt(max(1, rows / cols))``, so that tall matrices are not under-stepped.
    ``match_rms_adamw`` (Moonshot): ``lr * 0.2 * sqrt(max(rows, cols))``, giving the update the RMS of a typical
    AdamW update so that AdamW's lr and weight decay carry over.
    """
    rows, cols = shape[-2], shape[-1]
    if rule == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Muon lr_rule must be one of {list(LR_RULES)}, got {rule!r}")


def momentum_directions(grads: list[Tensor], momentum_buffers: list[Tensor], *, momentum: float,
                        nesterov: bool) -> list[Tensor]:
    """Advance each momentum buffer (an EMA of gradients: ``B <- momentum * B + (1 - momentum) * g``) in place and
    return what Newton-Schulz orthogonalises: ``g + momentum * (B - g)`` (Nesterov) or ``B`` itself.

    torch's Muon ops (``lerp``) as one foreach call each over the whole list, not one kernel per matrix.
    """
    torch._foreach_lerp_(momentum_buffers, grads, 1 - momentum)
    return torch._foreach_lerp(grads, momentum_buffers, momentum) if nesterov else list(momentum_buffers)


def orthogonalise_batched(directions: list[Tensor], steps: int = NS_STEPS,
                          coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS, *,
                          zeropower=zeropower_via_newtonschulz) -> list[Tensor]:
    """:func:`zeropower_via_newtonschulz` (or ``zeropower``, a function with its contract) of each tensor, with
    same-shaped ones stacked into one batched call.

    A stage's hidden matrices come in a few shapes (q/k/v/o, gate/up, down): one call per shape instead of one
    per matrix. The result of each is bit-equal to orthogonalising it alone (tested), since the batched kernels
    run the same per-matrix products; the stack is made in bf16, the precision the iteration starts from.
    """
    out: list[Tensor | None] = [None] * len(directions)
    by_shape: dict[tuple, list[int]] = {}
    for i, d in enumerate(directions):
        by_shape.setdefault((tuple(d.shape), d.device), []).append(i)
    for idx in by_shape.values():
        if len(idx) == 1:
            out[idx[0]] = zeropower(directions[idx[0]], steps, coefficients, eps)
            continue
        stacked = torch.stack([directions[i].bfloat16() for i in idx])
        for i, o in zip(idx, zeropower(stacked, steps, coefficients, eps).unbind(0)):
            out[i] = o
    return out


def split_rows(t: Tensor, row_blocks: int) -> Tensor:
    """``t`` (``[..., rows, cols]``) as a view ``[..., row_blocks, rows / row_blocks, cols]``: each block of rows a
    matrix of its own for Newton-Schulz (leading dimensions are a stack); ``t`` itself for one block."""
    if row_blocks == 1:
        return t
    return t.unflatten(-2, (row_blocks, t.shape[-2] // row_blocks))


def join_rows(t: Tensor, row_blocks: int) -> Tensor:
    """The inverse of :func:`split_rows` (a view where the blocks are contiguous, as Newton-Schulz returns them)."""
    return t if row_blocks == 1 else t.flatten(-3, -2)


def block_shape(shape: torch.Size, row_blocks: int) -> torch.Size:
    """The shape of one matrix Muon orthogonalises in a tensor of ``shape`` split into ``row_blocks`` row blocks:
    what :func:`adjusted_lr` is given."""
    rows = shape[-2]
    if row_blocks < 1 or rows % row_blocks:
        raise ValueError(f"Muon: a matrix of shape {tuple(shape)} has {rows} rows, not {row_blocks} equal blocks")
    return torch.Size((*shape[:-2], rows // row_blocks, shape[-1]))


def orthogonalise_blocks(orthogonalise, directions: list[Tensor], row_blocks: int, steps: int = NS_STEPS,
                         coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS
                         ) -> list[Tensor]:
    """``orthogonalise`` (:func:`orthogonalise_batched` or a function with its contract) of each direction split
    into ``row_blocks`` blocks of rows, joined back to the directions' shapes. The orthogonaliser sees one tensor per
    parameter (``[..., k, rows / k, cols]``), so a split across replicas still moves whole parameters and counts
    the blocks' Newton-Schulz FLOPs."""
    if row_blocks == 1:
        return orthogonalise(directions, steps, coefficients, eps)
    split = [split_rows(d, row_blocks) for d in directions]
    return [join_rows(o, row_blocks) for o in orthogonalise(split, steps, coefficients, eps)]


def muon_apply(param: Tensor, orthogonalised: Tensor, *, lr: float, weight_decay: float, lr_rule: str,
               row_blocks: int = 1) -> Tensor:
    """The new value ``x (1 - lr wd) - adjusted_lr * O`` as a new tensor (torch's op order; the decay uses the
    unadjusted lr, as torch's Muon); the lr is adjusted for one row block's shape (:func:`block_shape`)."""
    shape = block_shape(param.shape, row_blocks)
    return decayed(param, lr, weight_decay).add_(orthogonalised, alpha=-adjusted_lr(lr, shape, lr_rule))

