"""Thin ``torch.optim.Optimizer`` classes over the pure update rules: AdamW, SGD, Lion and the hybrid Muon.

Every step computes, per parameter, the new value the base rule gives (torch's op order, so bit-equal to torch
where torch has the optimizer) and applies it in one place, :meth:`UpdateOptimizer._apply`: there the full update
``u = x_before - x_after`` (learning rate and decoupled weight decay included) is formed and a delay correction
(:mod:`ds_async.optim.corrections`) may add to it. The classes keep torch's conventions (``param_groups`` with
``lr`` that LR schedulers may set, lazily created per-parameter ``state``, ``state_dict``), so they can be handed
to DeepSpeed as a client optimizer.

Statistics for the last step (:meth:`UpdateOptimizer.stats`) are accumulated as device tensors during ``step``
(no host synchronisation there) and read once when asked for.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .corrections import Correction
from .muon import (LR_RULES, NS_COEFFICIENTS, NS_EPS, NS_STEPS, block_shape, momentum_directions, muon_apply,
                   orthogonalise_batched, orthogonalise_blocks)
from .updates import adamw_step, lion_step, sgd_step


# Parameters are updated in chunks of about this many elements: the update's temporaries (new values, ``u``, the
# correction's term) exist for one chunk at a time, ~3 GiB at fp32, not for the whole model.
APPLY_CHUNK_NUMEL = 2 ** 28


def _chunks(params: list[Tensor], numel: int):
    chunk, size = [], 0
    for p in params:
        if chunk and size + p.numel() > numel:
            yield chunk
            chunk, size = [], 0
        chunk.append(p)
        size += p.numel()
    if chunk:
        yield chunk


class UpdateOptimizer(torch.optim.Optimizer):
    """Base class: subclasses implement :meth:`_new_value` (one parameter's base step); ``step`` applies it.

    Args:
        params: parameters or param groups (a group may carry a ``name``, used in :meth:`stats`).
        defaults: the hyper-parameters every group falls back to.
        correction: transforms each ``u`` before it is applied; its buffers live in ``self.state``.
    """

    def __init__(self, params, defaults: dict, correction: Correction | None = None):
        super().__init__(params, defaults)
        self.correction = correction
        self._sums: dict[str, Tensor] = {}
        self.last_lrs: dict[str, float] = {}

    def _new_value(self, param: Tensor, grad: Tensor, state: dict, group: dict, prepared) -> Tensor:
        """The value of ``param`` after this step of the base rule, as a new tensor; advances ``state``.
        ``prepared``: what :meth:`_prepare_step` computed for ``param`` (None if nothing)."""
        raise NotImplementedError

    def _prepare_step(self) -> dict:
        """Work done for all parameters at once before the per-parameter pass, by parameter (nothing by default);
        each entry is dropped once its parameter is applied."""
        return {}

    def group_name(self, index: int) -> str:
        """The name of param group ``index`` in :meth:`stats` (its ``name``, else ``group<index>``)."""
        return self.param_groups[index].get("name", f"group{index}")

    def begin_step(self) -> None:
        """Clear the last step's sums and record each group's lr: the start of :meth:`step`, and of a step that
        another function takes on this optimizer's state (:func:`ds_async.optim.muon_pass.hybrid_muon_step_`)."""
        self._sums = {}
        self.last_lrs = {self.group_name(i): float(g["lr"]) for i, g in enumerate(self.param_groups)}

    def record(self, name: str, numel: int, update_sq: Tensor, base_update_sq: Tensor | None = None,
               buffer_sq: Tensor | None = None) -> None:
        """Add a chunk of group ``name``'s step to this step's sums (:meth:`stat_sums`): its element count, the
        squared norm of the update applied and, with a correction, of the update before it and of the correction's
        buffer."""
        sums = {f"update_sq/{name}": update_sq, f"numel/{name}": numel}
        if self.correction is not None:
            sums |= {f"base_update_sq/{name}": base_update_sq, f"{self.correction.name}_buffer_sq": buffer_sq}
        for key, value in sums.items():
            self._sums[key] = self._sums[key] + value if key in self._sums else value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.begin_step()
        prepared = self._prepare_step()
        for index, group in enumerate(self.param_groups):
            name = self.group_name(index)
            params = [p for p in group["params"] if p.grad is not None]
            for param in params:
                if param.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            for chunk in _chunks(params, APPLY_CHUNK_NUMEL):
                states = [self.state[p] for p in chunk]
                news = [self._new_value(p, p.grad, state, group, prepared.pop(p, None))
                        for p, state in zip(chunk, states)]
                self._apply(name, chunk, news, states)
        return loss

    def _apply(self, name: str, params: list[Tensor], news: list[Tensor], states: list[dict]) -> None:
        """The one place parameters change: with ``u = x - new``, ``x <- x - (u + correction(u))``.

        Foreach kernels over the list: the host issues a few kernels per chunk instead of ten per parameter (under
        2BW it is the host that also issues the next batch's forward passes).
        """
        xs = [p.detach() for p in params]
        us = torch._foreach_sub(xs, news)
        base_sq = buffer_sq = None
        if self.correction is not None:
            base_sq = _sum_sq(us)
            extras = self.correction(us, states)
            buffer_sq = _sum_sq([self.correction.buffer(s) for s in states])
            torch._foreach_sub_(news, extras)
            torch._foreach_add_(us, extras)
        self.record(name, sum(u.numel() for u in us), _sum_sq(us), base_sq, buffer_sq)
        torch._foreach_copy_(xs, news)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, once the saved param groups are this optimizer's by name: torch only counts them and their sizes,
        and Muon's groups depend on a config key (``gate_up`` on ``split_gate_up``), which the refusal names."""
        saved = [g.get("name") for g in state_dict["param_groups"]]
        have = [g.get("name") for g in self.param_groups]
        if saved != have:
            hint = ""
            if ("gate_up" in saved) != ("gate_up" in have):
                hint = (f"; it was saved with optimizer.params.split_gate_up = {str('gate_up' in saved).lower()}: "
                        "set that in the config to resume it")
            raise ValueError(f"{type(self).__name__}: the saved param groups are {saved}, this optimizer's are "
                             f"{have}{hint}")
        super().load_state_dict(state_dict)

    def stat_sums(self) -> dict[str, Tensor | int]:
        """The last step's raw sums (squares of updates and buffers, element counts), not yet synchronised, with
        the same keys whichever parameters had gradients, so that a sharded wrapper can add them over ranks."""
        names = [self.group_name(i) for i in range(len(self.param_groups))]
        keys = [f"{kind}/{name}" for name in names for kind in ("update_sq", "numel")]
        if self.correction is not None:
            keys += [f"base_update_sq/{name}" for name in names] + [f"{self.correction.name}_buffer_sq"]
        return {k: self._sums.get(k, 0) for k in keys}

    def stats(self) -> dict[str, float]:
        """The last step, for tensorboard: ``update_rms/<group>`` (of the applied update), ``base_update_rms/<group>``
        (before the correction), ``<correction>_buffer_norm``, ``lr/<group>``. Synchronises with the device."""
        sums = self.stat_sums()
        return finish_stats(list(sums), stack_sums(sums), self.last_lrs)


def _sum_sq(tensors: list[Tensor]) -> Tensor:
    """The tensors' total sum of squares. Norm kernels read each tensor once and allocate nothing parameter-sized;
    at least fp32 (they refuse to narrow)."""
    wide = torch.promote_types(tensors[0].dtype, torch.float32)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=wide)).square().sum()


def stack_sums(sums: dict[str, Tensor | int]) -> Tensor:
    """The values of :meth:`UpdateOptimizer.stat_sums` as one float64 tensor (for a single all-reduce)."""
    device = next((v.device for v in sums.values() if isinstance(v, Tensor)), torch.device("cpu"))
    return torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) if not isinstance(v, Tensor)
                        else v.to(torch.float64) for v in sums.values()])


def finish_stats(keys: list[str], values: Tensor, lrs: dict[str, float]) -> dict[str, float]:
    """RMS and norms from the sums of ``keys`` in ``values`` (:func:`stack_sums`); the one host sync."""
    got = dict(zip(keys, values.tolist()))
    out = {f"lr/{name}": lr for name, lr in lrs.items()}
    for key, value in got.items():
        kind, _, name = key.partition("/")
        if kind.endswith("update_sq"):
            out[f"{kind.removesuffix('_sq')}_rms/{name}"] = (value / max(got[f"numel/{name}"], 1)) ** 0.5
        elif kind.endswith("_buffer_sq"):
            out[kind.removesuffix("_sq") + "_norm"] = value ** 0.5
    return out


class AdamW(UpdateOptimizer):
    """AdamW (decoupled weight decay); without a correction bit-equal to ``torch.optim.AdamW`` (single-tensor path)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, correction: Correction | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), correction)

    def _new_value(self, param, grad, state, group, prepared):
        return _adamw_step(param, grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])


def advance_adamw_state(param: Tensor, state: dict) -> None:
    """AdamW's state of ``param`` one step on: its moments created (zeros) on the first step, its step count raised.
    Every AdamW step of ds_async (this module's, the fused passes') keeps its state so, so that they share states."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1


def _adamw_step(param, grad, state, lr, betas, eps, weight_decay) -> Tensor:
    advance_adamw_state(param, state)
    return adamw_step(param, grad, state["exp_avg"], state["exp_avg_sq"], state["step"], lr=lr, betas=betas,
                        eps=eps, weight_decay=weight_decay)


class SGD(UpdateOptimizer):
    """SGD with momentum (torch's buffer convention) and *decoupled* weight decay ``lr * weight_decay * x``."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, correction: Correction | None = None):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening, nesterov=nesterov,
                                      weight_decay=weight_decay), correction)

    def _new_value(self, param, grad, state, group, prepared):
        new, buf = sgd_step(param, grad, state.get("momentum_buffer"), lr=group["lr"], momentum=group["momentum"],
                            dampening=group["dampening"], nesterov=group["nesterov"],
                            weight_decay=group["weight_decay"])
        if buf is not None:
            state["momentum_buffer"] = buf
        return new


class Lion(UpdateOptimizer):
    """Lion (sign of interpolated momentum). Its updates are ±lr per entry, so lr is typically 3-10x below AdamW's
    and weight decay 3-10x above."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0,
                 correction: Correction | None = None):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay), correction)

    def _new_value(self, param, grad, state, group, prepared):
        if not state:
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        return lion_step(param, grad, state["exp_avg"], lr=group["lr"], betas=group["betas"],
                           weight_decay=group["weight_decay"])


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
                                 "ds_async.optim.optimizers.muon_param_groups(model, ...)")
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
            return _adamw_step(param, grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])
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
    from .roles import fused_gate_up, role_groups

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
