"""Muon: its update for hidden-layer matrices as pure functions, and the hybrid optimizer :class:`Muon` (Muon for
the matrices, AdamW for the rest) over them (Jordan et al. 2024, "Muon: An optimizer for hidden
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

from .corrections import Correction
from .optimizers import UpdateOptimizer, adamw_new_value
from .roles import fused_gate_up, role_groups
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
    """:func:`zeropower_symmetric` for that CUDA device, or None where Triton does not import or the card has no
    bf16 tensor cores (Triton's bf16 ``tl.dot`` needs compute capability 8.0)."""
    if torch.cuda.get_device_capability(device_index) < (8, 0):
        return None
    try:
        from . import ns_triton  # noqa: F401 - Triton, a slow and optional import: only where it may be used
    except ImportError:
        return None
    return zeropower_symmetric


def zeropower_symmetric(grad: Tensor, steps: int = NS_STEPS,
                        coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS,
                        blocks: tuple[int, int] | None = None, upcast: bool = False) -> Tensor:
    """:func:`zeropower_matmul`'s iteration with the two symmetric products computed one triangle each by Triton
    (:func:`ds_async.optim.ns_triton.iterate`; ``blocks``, ``upcast``: as there, for Triton's interpreter)."""
    from . import ns_triton

    x, tall = wide_and_normalised(grad, eps)
    lead = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:]).contiguous()  # a tall matrix's transpose: rows made contiguous along k
    x = ns_triton.iterate(x, steps, coefficients, blocks=blocks, upcast=upcast)
    x = x.reshape(*lead, *x.shape[-2:])
    return x.mT if tall else x


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


# ------------------------------------------------------------------------------------------------ the optimizer

class Muon(UpdateOptimizer):
    """Hybrid Muon: groups with ``use_muon=True`` (hidden matrices and expert stacks) get Muon, the others AdamW.

    Build the groups with :func:`muon_param_groups` from the model (roles, not names, decide). A Muon group's
    hyper-parameters: ``lr, momentum, nesterov, ns_steps, weight_decay, lr_rule`` (``original`` or
    ``match_rms_adamw``) and, optionally, ``row_blocks`` (default 1): each of the group's matrices is
    orthogonalised as that many equal blocks of rows, each block a matrix of its own with its own lr adjustment
    (bit-equal to Muon on the blocks as separate tensors; ``muon_param_groups(split_gate_up=True)`` puts fused
    ``[gate; up]`` expert stacks in such a group, 2 blocks, by default; why is said there). An
    AdamW group's: ``lr, betas, eps, weight_decay``. Muon refuses parameters that are not at least 2-D (a flat ZeRO
    partition) with an explanation, and matrices whose rows do not split into ``row_blocks`` equal blocks.
    """

    def __init__(self, param_groups: list[dict], lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = NS_STEPS, weight_decay: float = 0.0, lr_rule: str = "original",
                 betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS, ns_eps: float = NS_EPS,
                 correction: Correction | None = None, orthogonalise=orthogonalise_batched):
        if lr_rule not in LR_RULES:
            raise ValueError(f"Muon: lr_rule must be one of {list(LR_RULES)}, got {lr_rule!r}")
        param_groups = list(param_groups)
        for group in param_groups:
            if not isinstance(group, dict) or "use_muon" not in group:
                raise ValueError("Muon takes param groups that each say use_muon=True/False; build them with "
                                 "ds_async.optim.muon.muon_param_groups(model, ...)")
        super().__init__(param_groups, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                            weight_decay=weight_decay, lr_rule=lr_rule, betas=tuple(betas), eps=eps,
                                            ns_coefficients=tuple(ns_coefficients), ns_eps=ns_eps), correction)
        for group in self.param_groups:
            if group["use_muon"]:
                blocks = row_blocks(group)
                for p in group["params"]:
                    require_matrix(p)
                    block_shape(p.shape, blocks)
        # Newton-Schulz over a list of directions (orthogonalise_batched's contract); replicas that each hold every
        # matrix (ZeRO-0) share the work with ds_async.optim.ns_split.orthogonalise_split (the client's choice).
        self.orthogonalise = orthogonalise

    def _prepare_step(self) -> dict:
        # Orthogonalise every matrix first, same shapes batched (one Newton-Schulz per shape, not per matrix);
        # the per-parameter pass then applies them through the update hook.
        orthogonalised = {}
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            params = [p for p in group["params"] if p.grad is not None]
            if not params:  # e.g. a ZeRO-1 shard owning none of this group's matrices
                continue
            for p in params:
                require_matrix(p)
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            directions = momentum_directions([p.grad for p in params],
                                             [self.state[p]["momentum_buffer"] for p in params],
                                             momentum=group["momentum"], nesterov=group["nesterov"])
            ortho = orthogonalise_blocks(self.orthogonalise, directions, row_blocks(group), group["ns_steps"],
                                         group["ns_coefficients"], group["ns_eps"])
            orthogonalised.update(zip(params, ortho))
        return orthogonalised

    def _new_value(self, param, grad, state, group, prepared):
        if not group["use_muon"]:
            return adamw_new_value(param, grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])
        return muon_apply(param, prepared, lr=group["lr"],
                          weight_decay=group["weight_decay"], lr_rule=group["lr_rule"], row_blocks=row_blocks(group))


def row_blocks(group: dict) -> int:
    """A Muon group's ``row_blocks`` (1 when absent: a group whose matrices are not split into row blocks)."""
    blocks = group.get("row_blocks", 1)
    if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(f"Muon: row_blocks must be a positive integer, got {blocks!r}")
    return blocks


def require_matrix(p: Tensor) -> None:
    if p.ndim < 2:
        raise ValueError(
            f"Muon: a parameter in a Muon ('matrix') group has shape {tuple(p.shape)}. Muon orthogonalises whole "
            "matrices; a 1-D tensor here is usually a flat partition that DeepSpeed's ZeRO or bf16 optimizer "
            "substituted for the model's parameters. Use zero_optimization stage 0 without DeepSpeed's bf16 "
            "optimizer, and ds_async.optim.sharded.ShardedOptimizer for tensor-granular ZeRO-1.")


# muon_param_groups' default for fused [gate; up] expert stacks, which the memory planner (ds_async.plan) follows.
SPLIT_GATE_UP = True


def check_split_gate_up(value) -> None:
    """Refuse an ``optimizer.params.split_gate_up`` that is not a JSON boolean (a ValueError naming the key)."""
    if not isinstance(value, bool):
        raise ValueError(f"optimizer.params.split_gate_up: must be true or false, got {value!r}")


def muon_param_groups(model: torch.nn.Module, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                      ns_steps: int = NS_STEPS, weight_decay: float = 0.0, lr_rule: str = "original",
                      adam_lr: float = 3e-4, adam_betas: tuple[float, float] = (0.9, 0.95), adam_eps: float = 1e-8,
                      adam_weight_decay: float = 0.0, split_gate_up: bool = SPLIT_GATE_UP) -> list[dict]:
    """Param groups for :class:`Muon`, one per role present in ``model`` (named after it): ``matrix`` with Muon's
    hyper-parameters, ``embedding``, ``head`` and ``vector`` with AdamW's (``adam_*``).

    ``split_gate_up``: how a fused ``[gate; up]`` matrix (:func:`ds_async.optim.roles.fused_gate_up`: Mixtral's
    expert ``gate_up_proj``, ``[E, 2I, H]``) is orthogonalised. ``True`` (default): its gate and up halves as two
    ``I x H`` matrices each, with the lr adjusted for ``I x H``, exactly as the dense LLaMA path orthogonalises its
    separate ``gate_proj`` and ``up_proj``; these stacks then form a Muon group of their own, ``gate_up`` (right
    after ``matrix``, ``row_blocks=2``, the same hyper-parameters). The halves are two linear maps (the gate's goes
    through SiLU, the up's multiplies it), so splitting makes the update independent of how transformers stores
    them. ``False``: as one ``2I x H`` matrix per expert, in the ``matrix`` group (no ``gate_up`` group: the layout
    a checkpoint without one holds). docs/DESIGN.md ("Muon on fused expert matrices") says why
    split is the default. Models without fused matrices get the same groups either way."""
    check_split_gate_up(split_gate_up)
    muon = dict(use_muon=True, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                weight_decay=weight_decay, lr_rule=lr_rule)
    adam = dict(use_muon=False, lr=adam_lr, betas=tuple(adam_betas), eps=adam_eps, weight_decay=adam_weight_decay)
    groups = []
    for role, params in role_groups(model).items():
        if role == "matrix" and split_gate_up:
            fused = {id(p) for p in fused_gate_up(model)}
            plain = [p for p in params if id(p) not in fused]
            if plain:
                groups.append(dict(params=plain, name="matrix", **muon))
            if len(plain) < len(params):
                groups.append(dict(params=[p for p in params if id(p) in fused], name="gate_up", row_blocks=2,
                                   **muon))
        elif params:
            groups.append(dict(params=params, name=role, **(muon if role == "matrix" else adam)))
    return groups
