"""The whole model as one layer list, and how the pipeline splits it into stages, for code that runs every stage in
one process (the emulation, the planner, the tests) and must split it exactly as ``build_pipeline``'s
``PipelineModule`` does.

:func:`build_layers` builds ``[embedding, decoder x L, head]`` of a ``ds_async.model`` section, each layer seeded as
on its stage; :func:`stage_bounds` is DeepSpeed's partition of them (``uniform``, ``parameters``) or the explicit
boundaries, as Python integers; :func:`stage_of_layers` and :func:`uniform_stages` read it per layer.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from deepspeed.runtime.utils import partition_balanced, partition_uniform
from torch import nn

from .. import config as cfgmod
from ..config import ConfigError, check_boundaries
from . import FAMILIES, llama, model_config


def build_layers(model, seed: int = 0, loss_chunk: int = 0):
    """The whole model of a ``ds_async.model`` section (a dict such as ``{"family": ..., "config": {...}}`` or
    ``{"path": ...}``, or a parsed :class:`~ds_async.config_sections.ModelConfig`) as the pipeline's layer list
    ``[embedding, decoder x L, head]``, each layer seeded as on its stage.

    Returns ``(layers, loss_fn, hf_config)``: an ``nn.ModuleList``, the family's ``loss_fn(logits, labels)`` (chunked
    cross-entropy with ``loss_chunk`` > 0) and the Hugging Face config object.
    """
    section = model if isinstance(model, dict) else dataclasses.asdict(model)
    cfg = cfgmod.parse({"model": section, "train": {"steps": 1}})
    hf_config, family = model_config(cfg), FAMILIES[cfg.model.family]
    hf_dir = cfg.model.path if cfg.model.path and cfg.model.load_weights else None
    layers = nn.ModuleList(llama.build_all(family.layer_specs(hf_config, seed=seed, hf_dir=hf_dir)))
    return layers, family.loss_fn(hf_config, loss_chunk), hf_config


def stage_bounds(method: str, layers: Sequence[nn.Module], stages: int,
                 boundaries: Sequence[int] | None = None) -> list[int]:
    """``stages + 1`` layer indices, stage ``s`` owning layers ``[b[s], b[s+1])``, as the pipeline module splits
    them: DeepSpeed's ``partition_uniform`` (``uniform``) or ``partition_balanced`` over each layer's trainable
    parameter count (``parameters``), or the given ``boundaries`` (``explicit``)."""
    n = len(layers)
    if not 1 <= stages <= n:
        raise ConfigError(f"ds_async.pipeline_stages: cannot split {n} layers into {stages} stages")
    # DeepSpeed's partitions may hold numpy integers; the bounds are recorded in manifests, so as Python's own.
    if method == "uniform":
        return [int(b) for b in partition_uniform(n, stages)]
    if method == "parameters":
        counts = [sum(q.numel() for q in layer.parameters() if q.requires_grad) for layer in layers]
        return [int(b) for b in partition_balanced(weights=counts, num_parts=stages)]
    if method == "explicit":
        return check_boundaries(boundaries, stages, n)
    raise ConfigError(f"ds_async.partition.method: unknown method {method!r}")


def stage_of_layers(bounds: Sequence[int]) -> list[int]:
    """The stage of each layer, from :func:`stage_bounds`."""
    return [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


def uniform_stages(num_layers: int, stages: int) -> list[int]:
    """The stage of each layer when ``num_layers`` layers are split into ``stages`` by count, as DeepSpeed's
    ``partition_method="uniform"`` splits them."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} pipeline stages")
    return stage_of_layers(partition_uniform(num_layers, stages))
