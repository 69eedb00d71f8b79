"""Hybrid Muon (+ error feedback) as a few passes over whole tensors, for a bf16 fast path: the module holds bf16
weights, the optimizer fp32 master weights, Muon momentum and the EF buffer per whole tensor.

Contract, per Muon matrix (:func:`muon_pass_`), from the bf16 gradient ``G``, a clip factor ``s`` (0-dim tensor)
and the fp32 master ``x``:

1. ``g = round_to(grad_dtype, G * s)`` in fp32, as DeepSpeed's gradient buffers of that dtype (its
   ``grad_accum_dtype``) would hold it (the same rounding as :func:`ds_async.optim.adamw_pass.adamw_pass_`);
2. momentum ``B <- lerp(B, g, 1 - mu)`` and the direction ``lerp(g, B, mu)`` (Nesterov) or ``B``, written once in
   bf16, the precision Newton-Schulz starts from (the head pass);
3. Newton-Schulz, same shapes batched (:func:`ds_async.optim.muon.orthogonalise_batched`, or any function with its
   contract, e.g. :func:`ds_async.optim.ns_split.orthogonalise_split` across data-parallel replicas); with
   ``row_blocks = k`` each direction as ``k`` equal blocks of rows, each a matrix of its own
   (:func:`ds_async.optim.muon.orthogonalise_blocks`: fused ``[gate; up]`` expert stacks under ``split_gate_up``),
   and the lr adjusted for a block's shape;
4. the tail pass: ``new = x (1 - lr wd) - adjusted_lr * O``; with EF ``u = x - new``,
   ``x <- new - lam (u - u_prev)``, ``u_prev <- u``; without, ``x <- new``; every extra output (the module's bf16
   weight, the new weight-version slot) receives ``bf16(x)``.

This is the arithmetic of :class:`ds_async.optim.Muon` with :class:`ds_async.optim.ErrorFeedback` (or without a
correction) op for op and in the same order, on parameters that are the fp32 masters with ``.grad = g``: bit-equal
on CPU (tested: master, momentum and EF buffers). Where the class passes Python floats (lerp weights, the decay,
``alpha`` of ``add``, EF's ``lam``) the passes take fp32 tensors holding the same fp32 values (:func:`muon_hyper`),
which the GPU kernels read on the device: a scheduler's new lr costs no host sync. Each pass runs over the tensors
of one shape at a time (:func:`ds_async.optim.gpu.same_shape_runs`): on GPUs one Triton launch per run
(:mod:`ds_async.optim.passes_triton`, whose rounding may differ from the eager ops in the last bit), on CPUs the
eager ops.

:func:`hybrid_muon_step_` steps a whole :class:`~ds_async.optim.Muon` (its param groups, state and correction) this
way: Muon groups by :func:`muon_pass_`, AdamW groups (embeddings, head, norms) by the one-pass AdamW
:func:`~ds_async.optim.adamw_pass.adamw_pass_` followed, with EF, by :func:`ef_pass_`; bit-equal on CPU to setting
``.grad = g`` and calling ``Muon.step()``. Its state stays the class's (same keys), so ``state_dict`` and
checkpoints are unchanged. It keeps the class's update statistics (``stats()``: the update's and, with EF, the
base update's and the buffer's squares), summed per tensor where the class sums per chunk of norms, so equal up to
the order of the additions. Its speed against the class's step: ``launch/bench/RESULTS.md``, "Newton-Schulz".
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .adamw_pass import adamw_hyper, adamw_pass_
from .gpu import same_shape_runs, triton_passes
from .corrections import ErrorFeedback
from .muon import (NS_COEFFICIENTS, NS_EPS, NS_STEPS, Muon, adjusted_lr, block_shape, orthogonalise_batched,
                   orthogonalise_blocks, require_matrix, row_blocks)
from .optimizers import advance_adamw_state

Orthogonalise = Callable[[list[Tensor], int, tuple[float, float, float], float], list[Tensor]]


def muon_hyper(group: dict, shapes: Sequence[torch.Size], device: torch.device, lam: float = 0.0) -> Tensor:
    """The step's scalars for the Muon matrices of ``shapes`` in one fp32 tensor on ``device``:
    ``[1 - momentum, momentum, 1 - lr * weight_decay, lam, -adjusted_lr(shape_0), -adjusted_lr(shape_1), ...]``,
    computed in double from ``group`` (``lr, momentum, weight_decay, lr_rule``, and ``row_blocks``: each lr is
    adjusted for one block's shape) as the class computes its Python floats, then rounded to fp32 where the class's
    kernels round them."""
    lr, momentum, wd, rule = group["lr"], group["momentum"], group["weight_decay"], group["lr_rule"]
    blocks = row_blocks(group)
    values = [1 - momentum, momentum, 1 - lr * wd, lam] + [-adjusted_lr(lr, block_shape(s, blocks), rule)
                                                           for s in shapes]
    host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def _muon_directions(grads: list[Tensor], momentum_buffers: list[Tensor], directions: list[Tensor], hyper: Tensor,
                     grad_scale: Tensor, grad_dtype: torch.dtype, nesterov: bool) -> None:
    # ds_async.optim.muon.momentum_directions: torch._foreach_lerp_(B, g, 1 - mu); lerp(g, B, mu) or B; then bf16.
    if grads[0].is_cuda:
        return triton_passes().muon_head(grads, momentum_buffers, directions, hyper, grad_scale, grad_dtype, nesterov)
    one_minus_momentum, momentum = hyper[0], hyper[1]
    for g, b, d in zip(grads, momentum_buffers, directions):
        g = (g.to(grad_dtype) * grad_scale).to(b.dtype)
        b.lerp_(g, one_minus_momentum)
        d.copy_(g.lerp(b, momentum) if nesterov else b)


def _square_sum(t: Tensor) -> Tensor:
    return t.square().sum(dtype=torch.float32)


def _muon_tail(params: list[Tensor], orthogonalised: list[Tensor], prev_updates: list[Tensor] | None,
               outs: list[list[Tensor]], hyper: Tensor, lr_index: int) -> Tensor:
    # muon_apply: decayed(x).add_(O, alpha=-adjusted_lr) with the lr hyper[lr_index] (one shape: one lr);
    # UpdateOptimizer._apply with ErrorFeedback: u = x - new, e = (u - u_prev) * lam, u_prev <- u, new -= e, x <- new.
    # Returns [the sum of squares of the applied update, with EF that of the update before the correction (else 0)],
    # the statistics UpdateOptimizer._apply keeps.
    if params[0].is_cuda:
        return triton_passes().muon_tail(params, orthogonalised, prev_updates, outs, hyper, lr_index)
    decay, lam, lr = hyper[2], hyper[3], hyper[lr_index]
    applied_sq = base_sq = torch.zeros((), dtype=torch.float32)
    for k, (p, o) in enumerate(zip(params, orthogonalised)):
        new = torch.add(p * decay, o, alpha=lr)
        u = p - new
        if prev_updates is not None:
            base_sq = base_sq + _square_sum(u)
            extra = (u - prev_updates[k]) * lam
            prev_updates[k].copy_(u)
            new = new - extra
            u = u + extra
        applied_sq = applied_sq + _square_sum(u)
        p.copy_(new)
        for out in outs:
            out[k].copy_(p)
    return torch.stack((applied_sq, base_sq))


def _ef_tail(params: list[Tensor], olds: list[Tensor], prev_updates: list[Tensor], outs: list[list[Tensor]],
             lam: Tensor) -> Tensor:
    # ErrorFeedback on an update already applied: params hold the base optimizer's new values, olds the values before.
    # Returns [the applied update's sum of squares, the base update's], as _muon_tail.
    if params[0].is_cuda:
        return triton_passes().ef_tail(params, olds, prev_updates, outs, lam)
    applied_sq = base_sq = torch.zeros((), dtype=torch.float32)
    for k, (p, old, prev) in enumerate(zip(params, olds, prev_updates)):
        u = old - p
        extra = (u - prev) * lam
        prev.copy_(u)
        p.sub_(extra)
        base_sq = base_sq + _square_sum(u)
        applied_sq = applied_sq + _square_sum(u + extra)
        for out in outs:
            out[k].copy_(p)
    return torch.stack((applied_sq, base_sq))


@torch.no_grad()
def muon_pass_(params: Sequence[Tensor], grads: Sequence[Tensor], momentum_buffers: Sequence[Tensor],
               prev_updates: Sequence[Tensor] | None, outs: Sequence[Sequence[Tensor]], hyper: Tensor,
               grad_scale: Tensor, grad_dtype: torch.dtype = torch.float32, *, nesterov: bool = True,
               ns_steps: int = NS_STEPS, ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
               ns_eps: float = NS_EPS, orthogonalise: Orthogonalise = orthogonalise_batched,
               row_blocks: int = 1) -> tuple[Tensor, Tensor] | None:
    """One Muon step, in place, on the fp32 master matrices ``params`` (whole tensors, >= 2-D; stacks of experts
    ``[E, rows, cols]`` included) and their fp32 ``momentum_buffers`` from the bf16 ``grads`` times ``grad_scale``
    (0-dim), rounded in ``grad_dtype``; ``hyper`` from :func:`muon_hyper` over the params' shapes (and EF's
    ``lam``). With ``prev_updates`` (EF's ``u_prev`` per tensor, fp32, zero before the first step) the update is
    corrected by error feedback and they receive the new ``u``; ``None``: no correction. Each list in ``outs``
    (bf16 module weights, weight-version slots) receives the new params. ``orthogonalise(directions, ns_steps,
    ns_coefficients, ns_eps)`` must return what :func:`orthogonalise_batched` returns (bf16, the same bits).
    ``row_blocks``: each matrix is orthogonalised as that many equal blocks of rows (``hyper`` must then hold the
    lr adjusted for a block's shape, as :func:`muon_hyper` of a group with that ``row_blocks`` does).
    Returns the sums of squares (fp32, 0-dim) of the applied update and of the update before the correction (0
    without one)."""
    if not params:
        return None
    params, grads, momentum_buffers = list(params), list(grads), list(momentum_buffers)
    directions = [torch.empty_like(g, dtype=torch.bfloat16) for g in grads]
    runs = same_shape_runs(params)
    scale = grad_scale.to(grad_dtype)
    for ks in runs:
        _muon_directions([grads[k] for k in ks], [momentum_buffers[k] for k in ks], [directions[k] for k in ks],
                         hyper, scale, grad_dtype, nesterov)
    orthogonalised = orthogonalise_blocks(orthogonalise, directions, row_blocks, ns_steps, ns_coefficients, ns_eps)
    # A tall matrix is orthogonalised as its transpose and comes back as a transposed view; the tail's kernel reads
    # contiguous tensors. Values are unchanged; a contiguous result is not copied.
    orthogonalised = [o.contiguous() for o in orthogonalised]
    sums = None
    for ks in runs:
        run = _muon_tail([params[k] for k in ks], [orthogonalised[k] for k in ks],
                         None if prev_updates is None else [prev_updates[k] for k in ks],
                         [[o[k] for k in ks] for o in outs], hyper, 4 + ks[0])
        sums = run if sums is None else sums + run
    return sums[0], sums[1]


@torch.no_grad()
def ef_pass_(params: Sequence[Tensor], olds: Sequence[Tensor], prev_updates: Sequence[Tensor],
             outs: Sequence[Sequence[Tensor]], lam: Tensor) -> tuple[Tensor, Tensor] | None:
    """Error feedback after a base step that already wrote its new values into ``params`` (``olds``: the values
    before it): ``u = old - x``, ``x <- x - lam (u - u_prev)``, ``u_prev <- u``, and every list in ``outs`` receives
    the corrected params; ``lam`` a 0-dim fp32 tensor. Bit-equal on CPU to the class's ``_apply`` with EF (which
    subtracts the same term from the same new value). Returns the sums of squares of the applied and the base
    update."""
    if not params:
        return None
    sums = None
    for ks in same_shape_runs(params):
        run = _ef_tail([params[k] for k in ks], [olds[k] for k in ks], [prev_updates[k] for k in ks],
                       [[o[k] for k in ks] for o in outs], lam)
        sums = run if sums is None else sums + run
    return sums[0], sums[1]


def _correction_lam(correction) -> float | None:
    if correction is None:
        return None
    if type(correction) is not ErrorFeedback:
        raise NotImplementedError(f"hybrid_muon_step_: the one-pass step implements ErrorFeedback or no correction, "
                                  f"not {type(correction).__name__}; use Muon.step()")
    return float(correction.lam)


@torch.no_grad()
def hybrid_muon_step_(optimizer, grads: Sequence[Tensor | None], grad_scale: Tensor,
                      outs: Sequence[Sequence[Tensor]] = (), grad_dtype: torch.dtype = torch.float32, *,
                      orthogonalise: Orthogonalise = orthogonalise_batched) -> None:
    """One step of the hybrid ``optimizer`` (a :class:`ds_async.optim.Muon` over fp32 master tensors, with
    :class:`~ds_async.optim.ErrorFeedback` or no correction) from bf16 gradients, without ``.grad``.

    ``grads``: the bf16 gradient of every parameter of ``optimizer.param_groups``, group after group in their order
    (``None``: not stepped, as the class skips a parameter without ``.grad``); ``grad_scale``: 0-dim (the clip
    factor); each list in ``outs`` (the module's bf16 weights, the new weight-version slot) holds a bf16 tensor per
    parameter in that same order and receives the new values. Muon groups go through :func:`muon_pass_`
    (Newton-Schulz by ``orthogonalise``), AdamW groups through :func:`adamw_pass_` and, with EF, :func:`ef_pass_`.
    State is created and kept under the class's keys (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``;
    the correction's ``buffer_key``). Bit-equal on CPU to ``Muon.step()`` with ``.grad = round_to(grad_dtype,
    G * grad_scale)`` in fp32."""
    if not isinstance(optimizer, Muon):
        raise TypeError(f"hybrid_muon_step_ steps a ds_async.optim.Muon, got {type(optimizer).__name__} (a "
                        "ShardedOptimizer steps only its owned parameters and broadcasts: use its step())")
    lam = _correction_lam(optimizer.correction)
    total = sum(len(g["params"]) for g in optimizer.param_groups)
    for what, items in [("grads", grads), *((f"outs[{k}]", o) for k, o in enumerate(outs))]:
        if len(items) != total:
            raise ValueError(f"hybrid_muon_step_: {what} has {len(items)} tensors for {total} parameters")
    optimizer.begin_step()
    start = 0
    for i, group in enumerate(optimizer.param_groups):
        chosen = [j for j in range(len(group["params"])) if grads[start + j] is not None]
        if chosen:
            params = [group["params"][j].detach() for j in chosen]
            group_grads = [grads[start + j] for j in chosen]
            group_outs = [[o[start + j] for j in chosen] for o in outs]
            states = [optimizer.state[group["params"][j]] for j in chosen]
            if group["use_muon"]:
                sums = _muon_group(optimizer, group, params, group_grads, states, group_outs, grad_scale, grad_dtype,
                                   lam, orthogonalise)
            else:
                sums = _adamw_group(optimizer, group, params, group_grads, states, group_outs, grad_scale,
                                    grad_dtype, lam)
            applied_sq, base_sq = sums  # with EF the buffer is the new base update: its square is the base's
            optimizer.record(optimizer.group_name(i), sum(p.numel() for p in params), applied_sq, base_sq, base_sq)
        # A parameter without a gradient is not stepped, but every out receives it all the same: a version slot
        # being refilled still holds an older version of it.
        missing = [j for j in range(len(group["params"])) if grads[start + j] is None]
        if missing:
            masters = [group["params"][j].detach() for j in missing]
            for o in outs:
                torch._foreach_copy_([o[start + j] for j in missing], masters)
        start += len(group["params"])


def _prev_updates(optimizer, params: list[Tensor], states: list[dict]) -> list[Tensor]:
    key = optimizer.correction.buffer_key
    for p, state in zip(params, states):
        if key not in state:  # ErrorFeedback: u(-1) = 0, allocated on the first step
            state[key] = torch.zeros_like(p)
    return [state[key] for state in states]


def _muon_group(optimizer, group, params, grads, states, outs, grad_scale, grad_dtype, lam, orthogonalise):
    blocks = row_blocks(group)
    for p, state in zip(params, states):
        require_matrix(p)
        block_shape(p.shape, blocks)
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    hyper = muon_hyper(group, [p.shape for p in params], params[0].device, 0.0 if lam is None else lam)
    return muon_pass_(params, grads, [s["momentum_buffer"] for s in states],
               None if lam is None else _prev_updates(optimizer, params, states), outs, hyper, grad_scale,
               grad_dtype, nesterov=group["nesterov"], ns_steps=group["ns_steps"],
               ns_coefficients=tuple(group["ns_coefficients"]), ns_eps=group["ns_eps"], orthogonalise=orthogonalise,
               row_blocks=blocks)


def _adamw_group(optimizer, group, params, grads, states, outs, grad_scale, grad_dtype, lam):
    for p, state in zip(params, states):
        advance_adamw_state(p, state)
    # One pass per step count (the same for every tensor unless parameters joined the group late).
    by_step: dict[int, list[int]] = {}
    for k, state in enumerate(states):
        by_step.setdefault(state["step"], []).append(k)
    device = params[0].device
    applied_sq = base_sq = torch.zeros((), dtype=torch.float32, device=device)
    for step, ks in by_step.items():
        ps, gs = [params[k] for k in ks], [grads[k] for k in ks]
        os_ = [[o[k] for k in ks] for o in outs]
        ms, vs = [states[k]["exp_avg"] for k in ks], [states[k]["exp_avg_sq"] for k in ks]
        hyper = adamw_hyper(group, step, device)
        if lam is None:
            applied_sq = applied_sq + adamw_pass_(ps, gs, ms, vs, os_, hyper, grad_scale, grad_dtype, update_sq=True)
            continue
        olds = [p.clone() for p in ps]
        adamw_pass_(ps, gs, ms, vs, [], hyper, grad_scale, grad_dtype)
        applied, base = ef_pass_(ps, olds, _prev_updates(optimizer, ps, [states[k] for k in ks]), os_,
                                 torch.tensor(lam, dtype=torch.float32).to(device, non_blocking=True))
        applied_sq, base_sq = applied_sq + applied, base_sq + base
    return applied_sq, base_sq
