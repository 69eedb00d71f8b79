"""Thin ``torch.optim.Optimizer`` classes over the pure update rules: AdamW, SGD, Lion (the hybrid Muon, built on
:class:`UpdateOptimizer` too, lives with its rule in :mod:`ds_async.optim.muon`).

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
        return adamw_new_value(param, grad, state, group["lr"], group["betas"], group["eps"], group["weight_decay"])


def advance_adamw_state(param: Tensor, state: dict) -> None:
    """AdamW's state of ``param`` one step on: its moments created (zeros) on the first step, its step count raised.
    Every AdamW step of ds_async (this module's, the fused passes') keeps its state so, so that they share states."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    state["step"] += 1


def adamw_new_value(param, grad, state, lr, betas, eps, weight_decay) -> Tensor:
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
