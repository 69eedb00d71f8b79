"""FP8 matrix products in the decoder layers (``performance.fp8``), through torchao's float8 training.

:func:`convert` swaps, in place, every ``nn.Linear`` inside a decoder layer whose two dimensions are multiples of 16
(what FP8 matrix products need) for torchao's ``Float8Linear``: attention's q/k/v/o projections and the dense MLP's
gate/up/down. The parameters stay the same tensors, in the training precision (bf16 weights, fp32 masters in the
optimizer), and so do their names: checkpoints, export, weight stashing and the optimizer's parameter roles see the
model they saw before. Left in the training precision, and why:

- the embedding (a lookup, no product) and the head (its vocabulary-wide logits feed the loss directly, where FP8's
  three mantissa bits cost most; torchtitan leaves it out too);
- norms and rotary embeddings (no products), and Mixtral's router (``E`` outputs: too small to gain, and its logits
  pick the experts);
- Mixtral's experts: 3-D parameter stacks that transformers runs expert by expert, not ``nn.Linear``; torchao's
  grouped FP8 products are a prototype, not used here.

Scaling is dynamic (each product scales what it is given at that call), so each weight version a 2BW stage stashes
is scaled from its own values, and a recomputed forward scales as the original did. :func:`check` refuses, with one
line naming ``ds_async.performance.fp8``, a run that cannot use it: no torchao, no GPU or one without FP8 tensor
cores, fp16, or ``performance.compile`` off (torchao's casts are fast only compiled).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .config import ConfigError

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
KEY = "ds_async.performance.fp8"
_FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first with FP8 tensor cores


def check(recipe: str | None, ds_config: dict, compile_on: bool, device: torch.device) -> None:
    """Raise ConfigError if ``recipe`` (the config's value; None: off) cannot run here."""
    if recipe is None:
        return
    if recipe not in RECIPES:
        raise ConfigError(f"{KEY}: {recipe!r} is not a recipe; one of {list(RECIPES)} or null")
    try:
        import torchao.float8  # noqa: F401 - only whether it is there
    except ImportError:
        raise ConfigError(f"{KEY}: needs torchao's float8 training: pip install -e \".[fp8]\" (or set it to null)") \
            from None
    if (ds_config.get("fp16") or {}).get("enabled"):
        raise ConfigError(f"{KEY}: not with fp16; FP8 training keeps bf16 weights: use \"bf16\": {{\"enabled\": "
                          "true}")
    if not compile_on:
        raise ConfigError(f"{KEY}: needs ds_async.performance.compile: true (torchao's scaling and casts run fused "
                          "only when compiled; eagerly FP8 is slower than bf16)")
    if device.type != "cuda":
        raise ConfigError(f"{KEY}: FP8 matrix products need an NVIDIA GPU with FP8 tensor cores (compute capability "
                          f"8.9 or later: L4, L40, H100, H200); this run is on {device.type}: set it to null")
    capability = torch.cuda.get_device_capability(device)
    if capability < _FP8_CAPABILITY:
        raise ConfigError(f"{KEY}: {torch.cuda.get_device_name(device)} (compute capability "
                          f"{capability[0]}.{capability[1]}) has no FP8 tensor cores (8.9 or later: L4, L40, H100, "
                          "H200): set it to null and train in bf16")


def eligible(module: nn.Module) -> bool:
    """A product FP8 may run: an ``nn.Linear`` both of whose dimensions are multiples of 16."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(layer: nn.Module, recipe: str, emulate: bool = False) -> list[str]:
    """Swap the eligible linears of decoder layer ``layer`` for torchao's ``Float8Linear`` (``recipe``: one of
    :data:`RECIPES`); returns the converted modules' names within ``layer``. ``emulate``: torchao's CPU emulation of
    the FP8 products, for tests only."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    names = [name for name, module in layer.named_modules() if eligible(module) and not _is_router(name)]
    chosen = set(names)
    convert_to_float8_training(layer, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    return names


def _is_router(name: str) -> bool:
    """Mixtral's router, ``mlp.gate`` (a dense MLP's ``mlp.gate_proj`` is not)."""
    return name.split(".")[-1] == "gate"
