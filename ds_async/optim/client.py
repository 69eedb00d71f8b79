"""Handing ds_async's optimizers to DeepSpeed, and refusing what they cannot honour.

DeepSpeed builds optimizers from the JSON ``"optimizer"`` block by name; ``Muon`` there would be DeepSpeed's own
(a different optimizer, and at ZeRO stage 0 under a pipeline it sees no whole matrices either), and it knows no
delay correction. When the block names one of ds_async's types or the ``ds_async.correction`` block asks for a
correction, the optimizer is built here and passed to DeepSpeed as a client optimizer; DeepSpeed still wraps it
(bf16, ZeRO) and drives its LR scheduler from the JSON.

What each mode hands the optimizer, and what is done about it:

============================  =====================================  ================================================
mode                          parameters the optimizer sees          Muon                     AdamW/SGD/Lion + corr.
============================  =====================================  ================================================
fp32 or torch_autocast, ZeRO-0 the stage's real parameters           yes                      yes
ZeRO-1, data parallel > 1     DeepSpeed: flat 1-D partitions         ds_async's tensor-granular yes (elementwise)
                                                                     ZeRO-1 (ShardedOptimizer)
DeepSpeed bf16 optimizer      flat fp32 partitions                   refused                  yes (elementwise)
fp16, ZeRO-2/3, offload       (not supported by ds_async)            refused                  refused
============================  =====================================  ================================================
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from . import build_optimizer, needs_client_optimizer
from .sharded import ShardedOptimizer

log = logging.getLogger(__name__)

MATRIX_TYPES = ("muon",)


class OptimizerSetupError(ValueError):
    """A combination of optimizer, precision and ZeRO stage that ds_async cannot run as written."""


def _zero(ds_config: dict) -> dict:
    return dict(ds_config.get("zero_optimization") or {})


def client_optimizer(module: nn.Module, ds_config: dict, correction, dp_group, dp_world: int
                     ) -> tuple[dict, torch.optim.Optimizer | None]:
    """``(config for DeepSpeed, client optimizer or None)`` for this stage.

    ``None`` means DeepSpeed builds the optimizer from the block itself (its own types, no correction), and the
    config is returned unchanged. Otherwise the ``"optimizer"`` block is removed from the returned copy (the
    optimizer is built here) and, where ds_async shards a matrix optimizer itself, ZeRO is set to stage 0.
    """
    block = ds_config.get("optimizer")
    if block is None or not needs_client_optimizer(block, correction):
        return ds_config, None
    kind = block["type"].lower()
    config = {k: v for k, v in ds_config.items() if k != "optimizer"}
    zero = _zero(ds_config)
    stage = int(zero.get("stage", 0))
    what = f"optimizer type {block['type']!r}"
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise OptimizerSetupError(f"{what}: fp16 is not supported by ds_async's optimizers; use bf16 or "
                                  "torch_autocast")
    if stage >= 2 or zero.get("offload_optimizer") or zero.get("offload_param"):
        raise OptimizerSetupError(f"{what}: ZeRO stage {stage} / offload is not supported by ds_async's "
                                  "optimizers (ZeRO-2/3 split gradients across replicas mid-backward); use stage 0 "
                                  "or 1")
    if kind in MATRIX_TYPES:
        if (ds_config.get("bf16") or {}).get("enabled"):
            raise OptimizerSetupError(
                f"{what} needs whole weight matrices, and DeepSpeed's bf16 optimizer hands its optimizer flat fp32 "
                "partitions. Use bf16 compute with fp32 weights instead: remove \"bf16\" and set "
                "\"torch_autocast\": {\"enabled\": true, \"dtype\": \"bfloat16\"}.")
        optimizer = build_optimizer(block, module, correction)
        if stage == 1:
            # DeepSpeed's ZeRO-1 would flatten the matrices; shard whole tensors across the replicas instead.
            config["zero_optimization"] = {**zero, "stage": 0}
            if dp_world > 1:
                log.info("ds_async: ZeRO-1 for %s is ds_async's tensor-granular sharding over %d replicas",
                         block["type"], dp_world)
                optimizer = ShardedOptimizer(optimizer, dp_group)
        return config, optimizer
    if stage == 1:
        config["zero_allow_untested_optimizer"] = True  # elementwise: correct on DeepSpeed's flat partitions
    return config, build_optimizer(block, module, correction)


def base_optimizer(optimizer) -> torch.optim.Optimizer | None:
    """ds_async's optimizer under DeepSpeed's wrappers (bf16, ZeRO, tensor-granular sharding), if it is one."""
    from .optimizers import UpdateOptimizer

    seen = optimizer
    for _ in range(4):
        if isinstance(seen, (UpdateOptimizer, ShardedOptimizer)):
            return seen
        seen = getattr(seen, "optimizer", None)
    return None
