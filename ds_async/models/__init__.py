"""Hugging Face models as DeepSpeed pipeline modules."""
from __future__ import annotations

import torch
from deepspeed.pipe import PipelineModule

from ..config import ConfigError, DsAsyncConfig
from . import hf_io, llama, mixtral

FAMILIES = {"llama": llama, "mixtral": mixtral}
"""``ds_async.model.family`` -> the module that builds it: ``layer_specs(config, seed, hf_dir)`` and
``loss_fn(config)``."""


class StagedPipelineModule(PipelineModule):
    """``PipelineModule`` that also accepts an explicit list of stage boundaries."""

    def __init__(self, layers, boundaries: list[int] | None = None, **kwargs):
        self._explicit = boundaries
        super().__init__(layers, **kwargs)
        self._compiled_stage = None

    def compile_stage(self, **compile_kwargs) -> None:
        """Run this stage's layers as one compiled region (``performance.compile_scope = "stage"``)."""
        if self.activation_checkpoint_interval or self.seed_layers:
            raise ValueError("a stage compiled as one region cannot checkpoint or seed layer by layer")
        self._compiled_stage = compiled_stage(self.forward_funcs, **compile_kwargs)

    def forward(self, forward_input):
        if self._compiled_stage is None:
            return super().forward(forward_input)
        self.micro_offset += 1  # as DeepSpeed's forward; only seeded layers read it, refused above
        return self._compiled_stage(forward_input)

    def _partition_layers(self, method="uniform"):
        if self._explicit is None:
            return super()._partition_layers(method)
        self.parts = list(self._explicit)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def compiled_stage(layers, **compile_kwargs):
    """One ``torch.compile`` region over ``layers`` in sequence.

    Per-layer compilation pays the host a compiled call (guards, autograd wrapper) per layer and fuses nothing
    across layer boundaries; a pipeline stage whose host issues passes barely faster than its GPU runs them
    loses that as idle time. Parameters are graph inputs, so swapping in
    another weight version recompiles nothing.
    """
    layers = list(layers)

    def run(x):
        for layer in layers:
            x = layer(x)
        return x

    return torch.compile(run, **compile_kwargs)


def model_config(cfg: DsAsyncConfig, tokenizer=None):
    """The HF config object of the model the ``ds_async.model`` section describes; with the run's ``tokenizer``,
    its BOS/EOS ids are the tokenizer's (:func:`hf_io.match_tokenizer`; the model's computation does not read
    them, checkpoints and exports carry them to ``generate``)."""
    from transformers import AutoConfig

    if cfg.model.path is not None:
        hf = AutoConfig.from_pretrained(cfg.model.path)
    else:
        _check_config_keys(cfg.model.family, cfg.model.config)
        hf = AutoConfig.for_model(cfg.model.family, **{"tie_word_embeddings": False, **cfg.model.config})
    if hf.model_type != cfg.model.family:
        raise ConfigError(f"ds_async.model.family: '{cfg.model.family}' but the config is a '{hf.model_type}'")
    layers = hf.num_hidden_layers + 2  # embedding, decoder layers, head
    if cfg.pipeline_stages > layers:
        raise ConfigError(f"ds_async.pipeline_stages: {cfg.pipeline_stages} stages for {layers} layers (embedding + "
                          f"{layers - 2} decoder layers + head); a stage needs at least one layer")
    if tokenizer is not None:
        hf_io.match_tokenizer(hf, tokenizer)
    return hf


def _check_config_keys(family: str, kwargs: dict) -> None:
    """Hugging Face configs keep unknown kwargs as attributes without a word (``hidden_sise`` would train a model of
    the default width): refuse keys the family's config class does not define, naming the closest one."""
    import difflib

    from transformers import AutoConfig

    base = AutoConfig.for_model(family).to_dict()
    for key, value in kwargs.items():
        if key in base:
            continue
        # A key the class takes but does not keep under its name (``rope_theta`` becomes ``rope_parameters``)
        # changes another entry; an unknown one is only stored verbatim.
        alone = AutoConfig.for_model(family, **{key: value}).to_dict()
        if key not in alone or any(alone.get(k) != v for k, v in base.items()):
            continue
        hint = difflib.get_close_matches(key, sorted(base), n=1)
        suggestion = f" (did you mean 'ds_async.model.config.{hint[0]}'?)" if hint else ""
        raise ConfigError(f"ds_async.model.config.{key}: not a {family} config key{suggestion}")


def build_pipeline(cfg: DsAsyncConfig, hf_config, **kwargs) -> StagedPipelineModule:
    """The pipeline module for this rank: only this stage's layers are built (and read from disk)."""
    from ..builder import init_distributed

    init_distributed()
    hf_dir = cfg.model.path if cfg.model.path and cfg.model.load_weights else None
    family = FAMILIES[cfg.model.family]
    specs = family.layer_specs(hf_config, seed=cfg.seed, hf_dir=hf_dir)
    boundaries = cfg.partition.boundaries
    if boundaries is not None:
        p, n = cfg.pipeline_stages, len(specs)
        if (len(boundaries) != p + 1 or boundaries[0] != 0 or boundaries[-1] != n
                or any(a >= b for a, b in zip(boundaries, boundaries[1:]))):
            raise ConfigError(f"ds_async.partition.boundaries: need {p + 1} strictly increasing indices from 0 to "
                              f"{n} (embedding + {n - 2} decoder layers + head), got {boundaries}")
    perf = cfg.performance
    module = StagedPipelineModule(specs, boundaries=boundaries, num_stages=cfg.pipeline_stages,
                                  loss_fn=family.loss_fn(hf_config, perf.loss_chunk),
                                  partition_method="uniform" if cfg.partition.method == "explicit"
                                  else cfg.partition.method,
                                  activation_checkpoint_interval=perf.activation_checkpoint_interval,
                                  # DeepSpeed's (reentrant) checkpoint cannot start at the embedding, whose input
                                  # needs no gradient: recompute decoder layers only (DeepSpeed matches by name).
                                  checkpointable_layers=[llama.DecoderLayerPipe.__name__,
                                                         mixtral.MoeDecoderLayerPipe.__name__], **kwargs)
    if perf.compile:  # the loss too, so it fuses with the softmax
        if perf.compile_scope == "stage":
            module.compile_stage()
        else:  # per layer: DeepSpeed drives the module layer by layer
            for layer in module.forward_funcs:
                if isinstance(layer, (llama.DecoderLayerPipe, llama.HeadPipe)):
                    layer.compile()
        module.loss_fn = torch.compile(module.loss_fn)
    return module


def hf_state_dict(module: PipelineModule) -> dict:
    """This stage's tensors as a Hugging Face ``save_pretrained`` checkpoint names and lays them out."""
    out = {}
    for layer in module.forward_funcs:
        out.update(layer.hf_state_dict())
    return out


def export_hf(engine, out_dir: str, hf_config) -> None:
    """Write the model as a sharded HF checkpoint (one file per stage) that ``from_pretrained`` loads.

    Collective over all ranks: the first data-parallel replica of each stage writes its shard, rank 0 the index.
    """
    from deepspeed import comm as dist

    stages = engine.num_stages
    if engine.grid.data_parallel_id == 0:
        hf_io.save_shard(hf_state_dict(engine.module), out_dir, hf_io.shard_name(engine.stage_id, stages))
    dist.barrier()
    if dist.get_rank() == 0:
        hf_io.write_index(out_dir, stages, hf_config)
    dist.barrier()
