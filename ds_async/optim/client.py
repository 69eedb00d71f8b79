"""Handing ds_async's optimizers to DeepSpeed, and refusing what they cannot honour.

DeepSpeed builds optimizers from the JSON ``"optimizer"`` block by name; ``Muon`` there would be DeepSpeed's own
(a different optimizer, and at ZeRO stage 0 under a pipeline it sees no whole matrices either), and it knows no
delay correction. When the block names one of ds_async's types or the ``ds_async.correction`` block asks for a
correction, the optimizer is built here and passed to DeepSpeed as a client optimizer; DeepSpeed still wraps it
(bf16, ZeRO) and drives its LR scheduler from the JSON.

What each mode hands the optimizer, and what is done about it:

==============================  ===================================================================================
mode                            what ds_async's optimizer (Muon, Lion, or any type with a correction) steps
==============================  ===================================================================================
fp32 or torch_autocast, ZeRO-0  the stage's real parameters
bf16 (``"bf16": {"enabled"}``)  fp32 masters per whole tensor that it keeps itself (:class:`~.master.MasterWeights`);
                                the module trains in bf16; DeepSpeed sees fp32 with a client optimizer
ZeRO-1, data parallel > 1       Muon, and everything under bf16: its owned whole tensors (ds_async's tensor-granular
                                ZeRO-1, :class:`~.sharded.ShardedOptimizer`, DeepSpeed at stage 0 underneath);
                                elementwise rules in fp32: DeepSpeed's flat ZeRO-1 partitions
fp16, ZeRO-2/3, offload         refused
==============================  ===================================================================================
"""
from __future__ import annotations

import importlib
import inspect
import logging
from functools import partial

import torch
from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
from torch import nn

from ..config import OWN_OPTIMIZER_TYPES, OptimizerSetupError, OptimizerSpec, did_you_mean, parse_optimizer
from . import build_optimizer
from .corrections import ErrorFeedback
from .master import MasterWeights
from .ns_split import orthogonalise_split
from .optimizers import UpdateOptimizer
from .sharded import ShardedOptimizer

log = logging.getLogger(__name__)

MATRIX_TYPES = ("muon",)


# What DeepSpeed builds for its own types (``DeepSpeedEngine._configure_basic_optimizer``), by lowercase name: the
# class whose keyword arguments ``optimizer.params`` must be, as "module:Class", and the keys DeepSpeed takes out
# first. Adam/AdamW: torch's with ``torch_adam``, else DeepSpeed's fused kernel.
_DEEPSPEED_TYPES = {
    "adam": ("deepspeed.ops.adam:FusedAdam", ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach")),
    "adamw": ("deepspeed.ops.adam:FusedAdam", ("torch_adam", "adam_w_mode", "fp32_optimizer_states", "foreach")),
    "adagrad": ("torch.optim:Adagrad", ()),
    "lamb": ("deepspeed.ops.lamb:FusedLamb", ()),
    "muadam": (None, ()), "muadamw": (None, ()), "musgd": (None, ()),  # the mup package's; not checked here
}


def check_optimizer_block(ds_config: dict, correction=None) -> OptimizerSpec | None:
    """The ``"optimizer"`` block's :class:`~ds_async.config.OptimizerSpec` (``None`` without one); refuse, before
    anything is built, a block that cannot be built, naming ``optimizer.type`` or ``optimizer.params``: a type that
    is neither DeepSpeed's, a ``torch.optim`` class nor ds_async's (Muon, Lion; AdamW and SGD with a correction), or
    params the optimizer's class does not take or rejects (torch's classes are built once on a stand-in tensor to
    check the values). ds_async's own types are checked as they are built (:func:`client_optimizer`)."""
    spec = parse_optimizer(ds_config.get("optimizer"), correction)
    if spec is not None and not spec.ds_async_builds:
        _check_deepspeed_block(spec)
    return spec


def _deepspeed_class(spec: OptimizerSpec):
    """``(class, keys DeepSpeed takes out of the params first)`` of a type DeepSpeed or torch builds; the class is
    ``None`` for DeepSpeed's types not checked here; an unknown type is refused with the nearest names."""
    kind, lk, params = spec.type, spec.kind, spec.params
    if lk in _DEEPSPEED_TYPES or lk in DEEPSPEED_OPTIMIZERS:
        target, extra = _DEEPSPEED_TYPES.get(lk, (None, ()))
        if lk in ("adam", "adamw") and params.get("torch_adam"):
            target = "torch.optim:AdamW" if lk == "adamw" or params.get("adam_w_mode", True) else "torch.optim:Adam"
        if target is None:
            return None, extra
        module, name = target.split(":")
        return getattr(importlib.import_module(module), name), extra
    cls = getattr(torch.optim, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        known = sorted({*DEEPSPEED_OPTIMIZERS, *OWN_OPTIMIZER_TYPES}) + sorted(
            n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer)
            and c is not torch.optim.Optimizer)
        raise OptimizerSetupError(f"optimizer.type: {kind!r} is not an optimizer DeepSpeed or ds_async knows"
                                  f"{did_you_mean(kind, known, fold_case=True)}: DeepSpeed's "
                                  f"{', '.join(DEEPSPEED_OPTIMIZERS)}, ds_async's Muon and Lion, or a torch.optim "
                                  "class by its exact name")
    return cls, ()


def _check_deepspeed_block(spec: OptimizerSpec) -> None:
    """The params of a type DeepSpeed builds, against its class's signature and (torch's) values."""
    kind, params = spec.type, spec.params
    cls, extra = _deepspeed_class(spec)
    if "max_grad_norm" in params and spec.kind != "lamb":
        raise OptimizerSetupError("optimizer.params.max_grad_norm: not an optimizer parameter under DeepSpeed; use "
                                  "the top-level \"gradient_clipping\"")
    if cls is None:
        return
    kwargs = {k: v for k, v in params.items() if k not in extra}
    signature = inspect.signature(cls.__init__).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in signature.values()):
        known = [n for n in signature if n not in ("self", "params", "model_params")]
        known += [k for k in extra if k not in known]
        for key in kwargs:
            if key not in known:
                raise OptimizerSetupError(f"optimizer.params.{key}: not a parameter of {kind!r} ({cls.__name__})"
                                          f"{did_you_mean(key, known)}; it takes {', '.join(known)}")
    if cls.__module__.startswith("torch.optim"):
        try:  # torch checks the values as it builds (a negative lr, betas that are not a pair, a string)
            cls([torch.zeros(1, requires_grad=True)], **kwargs)
        except (TypeError, ValueError) as e:
            raise OptimizerSetupError(f"optimizer.params: {kind!r} ({cls.__name__}) rejects them: "
                                      f"{type(e).__name__}: {e}") from None


def _build(spec: OptimizerSpec, module: nn.Module, orthogonalise=None):
    """ds_async's optimizer for ``spec``; a block it cannot build is an OptimizerSetupError naming the key."""
    try:
        return build_optimizer(spec, module, orthogonalise=orthogonalise)
    except (TypeError, ValueError) as e:
        text = str(e)
        raise OptimizerSetupError(text if text.startswith("optimizer.") else
                                  f"optimizer.params: {spec.type!r} rejects them: {type(e).__name__}: {text}") \
            from None


def _zero(ds_config: dict) -> dict:
    return dict(ds_config.get("zero_optimization") or {})


def client_optimizer(module: nn.Module, ds_config: dict, correction, dp_group, dp_world: int,
                     fused: bool = False, device=None) -> tuple[dict, torch.optim.Optimizer | None]:
    """``(config for DeepSpeed, client optimizer or None)`` for this stage.

    ``None`` means DeepSpeed builds the optimizer from the block itself (its own types, no correction), and the
    config is returned unchanged. Otherwise the ``"optimizer"`` block is removed from the returned copy (the
    optimizer is built here); where ds_async shards the optimizer itself, ZeRO is set to stage 0; under bf16 the
    ``"bf16"`` block is removed too and the module's weights become bf16 with fp32 masters kept by the optimizer
    (``fused``: its step in a few passes per tensor, ``performance.fused_optimizer_step``; ``device``: where the
    masters live).
    """
    spec = check_optimizer_block(ds_config, correction)
    if spec is None or not spec.ds_async_builds:
        return ds_config, None
    kind = spec.kind
    config = {k: v for k, v in ds_config.items() if k != "optimizer"}
    zero = _zero(ds_config)
    stage = int(zero.get("stage", 0))
    what = f"optimizer type {spec.type!r}"
    _check_precision_and_zero(ds_config, zero, stage, what)
    if (ds_config.get("bf16") or {}).get("enabled"):
        return _with_masters(spec, module, ds_config, config, zero, stage, what, dp_group, dp_world, fused, device)
    if fused:
        raise OptimizerSetupError(f"ds_async.performance.fused_optimizer_step: with {what} it needs bf16 weights "
                                  "(\"bf16\": {\"enabled\": true})")
    if kind in MATRIX_TYPES:
        optimizer = _build(spec, module, _newton_schulz(kind, stage, dp_group, dp_world))
        if stage == 1:
            # DeepSpeed's ZeRO-1 would flatten the matrices; shard whole tensors across the replicas instead.
            config["zero_optimization"] = {**zero, "stage": 0}
            if dp_world > 1:
                log.info("ds_async: ZeRO-1 for %s is ds_async's tensor-granular sharding over %d replicas",
                         spec.type, dp_world)
                optimizer = ShardedOptimizer(optimizer, dp_group)
        return config, optimizer
    if stage == 1:
        config["zero_allow_untested_optimizer"] = True  # elementwise: correct on DeepSpeed's flat partitions
    return config, _build(spec, module)


def _check_precision_and_zero(ds_config: dict, zero: dict, stage: int, what: str) -> None:
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise OptimizerSetupError(f"{what}: fp16 is not supported by ds_async's optimizers; use bf16 or "
                                  "torch_autocast")
    if stage >= 2 or zero.get("offload_optimizer") or zero.get("offload_param"):
        raise OptimizerSetupError(f"{what}: ZeRO stage {stage} / offload is not supported by ds_async's "
                                  "optimizers (ZeRO-2/3 split gradients across replicas mid-backward); use stage 0 "
                                  "or 1")


def _with_masters(spec, module: nn.Module, ds_config: dict, config: dict, zero: dict, stage: int, what: str,
                  dp_group, dp_world: int, fused: bool, device) -> tuple[dict, MasterWeights]:
    """Under bf16: the optimizer over fp32 masters (:class:`MasterWeights`), DeepSpeed's ``"bf16"`` block removed
    from ``config`` and its gradient all-reduce kept in bf16."""
    kind = spec.kind
    if (ds_config.get("torch_autocast") or {}).get("enabled"):
        raise OptimizerSetupError(f"{what}: bf16 and torch_autocast are both enabled; choose one")
    if fused and kind not in MATRIX_TYPES:
        raise OptimizerSetupError(f"ds_async.performance.fused_optimizer_step: with {what} and bf16 it is "
                                  "implemented for Muon only (and for torch's AdamW without a correction under "
                                  "DeepSpeed's bf16 optimizer)")
    config = {k: v for k, v in config.items() if k != "bf16"}
    # DeepSpeed all-reduces gradients in bf16 under its bf16 mode; keep that (it sees fp32 from here on).
    config.setdefault("communication_data_type", "bf16")
    optimizer = _build(spec, module, _newton_schulz(kind, stage, dp_group, dp_world))
    if fused and optimizer.correction is not None and not isinstance(optimizer.correction, ErrorFeedback):
        raise OptimizerSetupError(f"ds_async.performance.fused_optimizer_step: implemented for the 'ef' "
                                  f"correction or none, not {type(optimizer.correction).__name__}; set it to "
                                  "false to use this correction")
    if stage == 1:
        config["zero_optimization"] = {**zero, "stage": 0}
        if dp_world > 1:
            if fused:
                raise OptimizerSetupError("ds_async.performance.fused_optimizer_step: not with ZeRO-1 across "
                                          "replicas (each owner steps its own tensors); use ZeRO stage 0")
            optimizer = ShardedOptimizer(optimizer, dp_group)
    return config, MasterWeights(optimizer, module, fused=fused, device=device)


def _newton_schulz(kind: str, zero_stage: int, dp_group, dp_world: int):
    """With replicas that each hold every matrix (ZeRO-0), Muon orthogonalises ~1/dp of them per replica and
    all-gathers the rest (bit-equal to doing all; with ZeRO-1 each owner does only its own anyway); ``None``: the
    optimizer's own."""
    if kind == "muon" and zero_stage == 0 and dp_world > 1:
        return partial(orthogonalise_split, group=dp_group)
    return None


def base_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """ds_async's optimizer under DeepSpeed's wrappers (bf16, ZeRO, tensor-granular sharding), if it is one."""
    seen = optimizer
    for _ in range(4):
        if isinstance(seen, (UpdateOptimizer, ShardedOptimizer)):
            return seen
        seen = getattr(seen, "optimizer", None)
    return None
