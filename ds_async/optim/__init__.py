"""Optimizers from the DeepSpeed JSON ``"optimizer"`` block, ds_async's own optimizers and delay corrections."""
from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
from torch import nn

from ..config import OptimizerSpec, did_you_mean, parse_optimizer
from .corrections import Correction, ErrorFeedback, NesterovLookahead, build_correction
from .muon import Muon, muon_param_groups
from .optimizers import SGD, AdamW, Lion, UpdateOptimizer
from .roles import ROLES, param_roles, role_groups

__all__ = ["build_optimizer", "UpdateOptimizer", "AdamW", "SGD", "Lion", "Muon", "muon_param_groups", "Correction",
           "ErrorFeedback", "NesterovLookahead", "build_correction", "ROLES", "param_roles", "role_groups"]


def build_optimizer(block: dict | OptimizerSpec, model_or_params: nn.Module | Iterable, correction=None, *,
                    orthogonalise=None) -> torch.optim.Optimizer:
    """The optimizer for a DeepSpeed ``{"type": ..., "params": {...}}`` block, or its parsed
    :class:`~ds_async.config.OptimizerSpec` (which carries the correction).

    Without a correction, ``Adam``/``AdamW`` (with ``"torch_adam": true``) and any other ``torch.optim`` type
    (``SGD``) build exactly what DeepSpeed builds from the same block, so that the emulation steps bit-for-bit like
    the engine's optimizer. ``Muon`` (hybrid, parameters routed by role: give the model, not its parameters) and
    ``Lion`` are ds_async's. With a ``correction`` (``None``, a dict such as ``{"type": "ef", "lambda": 1.0}``, a
    ``CorrectionConfig`` or a :class:`Correction`), ``AdamW`` and ``SGD`` are ds_async's hookable classes:
    ``AdamW`` equals torch's up to fp32 rounding; ``SGD``'s weight decay is decoupled (``lr * wd * x``), unlike
    torch's L2 term, so a nonzero ``weight_decay`` must be confirmed with ``"decoupled_weight_decay": true``.

    ``Muon`` params: ``lr, momentum, nesterov, ns_steps, weight_decay, lr_rule`` for the hidden matrices and
    ``adam_lr, adam_betas, adam_eps, adam_weight_decay`` for embeddings, LM head, norms and biases.
    ``orthogonalise``: Muon's Newton-Schulz over a list of directions (default
    :func:`~ds_async.optim.muon.orthogonalise_batched`; e.g. :func:`~ds_async.optim.ns_split.orthogonalise_split`
    across replicas).
    """
    if isinstance(block, OptimizerSpec):
        spec, corr = block, build_correction(block.correction)
    elif isinstance(correction, Correction):  # a correction built by the caller
        spec, corr = parse_optimizer(block), correction
    else:
        spec = parse_optimizer(block, correction)
        corr = build_correction(spec.correction)
    kind, kwargs, lk = spec.type, dict(spec.params), spec.kind
    if lk == "muon":
        if not isinstance(model_or_params, nn.Module):
            raise ValueError("optimizer type Muon routes parameters by their role in the model: pass the model "
                             "(an nn.Module, e.g. the pipeline stage's module), not its parameters")
        _check_keys(kind, kwargs, muon_param_groups, exclude=("model",))
        return Muon(muon_param_groups(model_or_params, **kwargs), correction=corr,
                    **({"orthogonalise": orthogonalise} if orthogonalise else {}))
    if orthogonalise is not None:
        raise ValueError(f"orthogonalise: only Muon orthogonalises, not {kind}")
    params = model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params
    if lk == "lion":
        _check_keys(kind, kwargs, Lion.__init__, exclude=("self", "params", "correction"))
        return Lion(params, **kwargs, correction=corr)
    if lk in ("adam", "adamw"):
        return _adam(kind, lk, kwargs, params, corr)
    if lk == "sgd" and corr is not None:
        return _corrected_sgd(kind, kwargs, params, corr)
    if corr is not None:
        raise ValueError(f"optimizer type {kind!r} has no ds_async implementation to apply a delay correction "
                         "to; corrections work with AdamW, SGD, Lion and Muon")
    return getattr(torch.optim, kind)(params, **kwargs)


def _adam(kind: str, lk: str, kwargs: dict, params, corr) -> torch.optim.Optimizer:
    """Adam or AdamW: torch's, as DeepSpeed builds it from ``"torch_adam": true``; ds_async's AdamW with a
    correction."""
    torch_adam = kwargs.pop("torch_adam", False)
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    w_mode = lk == "adamw" or adam_w_mode
    if corr is not None:
        if not w_mode:
            raise ValueError("a delay correction needs ds_async's AdamW; Adam with L2 weight decay "
                             "(adam_w_mode: false) has no ds_async implementation")
        _check_keys(kind, kwargs, AdamW.__init__, exclude=("self", "params", "correction"))
        return AdamW(params, **kwargs, correction=corr)
    if not torch_adam:
        raise ValueError("the emulation mirrors DeepSpeed's torch Adam path: set \"torch_adam\": true")
    cls = torch.optim.AdamW if w_mode else torch.optim.Adam
    return cls(params, **kwargs)


def _corrected_sgd(kind: str, kwargs: dict, params, corr) -> SGD:
    """ds_async's SGD (decoupled weight decay, which the params must confirm) under a correction."""
    decoupled = kwargs.pop("decoupled_weight_decay", False)
    if kwargs.get("weight_decay", 0) and not decoupled:
        raise ValueError("SGD with a delay correction is ds_async's SGD, whose weight_decay is decoupled "
                         "(lr * weight_decay * x) rather than torch.optim.SGD's L2 term; set "
                         "\"decoupled_weight_decay\": true in the optimizer params to confirm")
    _check_keys(kind, kwargs, SGD.__init__, exclude=("self", "params", "correction"))
    return SGD(params, **kwargs, correction=corr)


def _check_keys(kind: str, kwargs: dict, fn, exclude: tuple[str, ...]) -> None:
    known = [n for n in inspect.signature(fn).parameters if n not in exclude]
    for key in kwargs:
        if key not in known:
            raise ValueError(f"optimizer.params.{key}: unknown key for type {kind!r}{did_you_mean(key, known)}; "
                             f"known keys: {known}")
