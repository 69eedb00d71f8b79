"""Hugging Face models as DeepSpeed pipeline modules.

:func:`model_config` resolves the ``ds_async.model`` section to a transformers config, and
:func:`build_pipeline` turns that into this rank's :class:`StagedPipelineModule`, building (and reading from disk)
only this stage's layers: embedding, decoder layers and head form one flat list that ``ds_async.partition`` cuts
into contiguous stages (DeepSpeed's methods, or explicit boundaries). Every layer names its tensors as
``save_pretrained`` does, so :func:`hf_state_dict` and :func:`export_hf` write checkpoints that ``from_pretrained``
loads. A family (:mod:`.llama`, :mod:`.mixtral`) provides ``layer_specs`` and ``loss_fn``.
"""
from __future__ import annotations

import difflib
import importlib
import os
import threading

import torch
from deepspeed import comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule
from transformers import AutoConfig

from ..config import ConfigError, DsAsyncConfig, check_boundaries, check_recompute, recomputed_layers
from .. import fp8, hub
from ..builder import init_distributed
from ..pipe.graphs import GraphedStage
from . import hf_io, llama, mixtral

FAMILIES = {"llama": llama, "mixtral": mixtral}
"""``ds_async.model.family`` -> the module that builds it: ``layer_specs(config, seed, hf_dir)`` and
``loss_fn(config)``."""


def trainable_counts(specs: list) -> list[int]:
    """Each layer's trainable parameter count, for ``partition.method: parameters``: every layer built on the meta
    device without its weights. DeepSpeed's own count builds each layer for real on every rank (initialised, or read
    from ``model.path``), a whole model's initialisation or read per rank at start only to count it."""
    counts = []
    for spec in specs:
        with torch.device("meta"):
            layer = spec.typename(*spec.module_args, **{**spec.module_kwargs, "hf_dir": None})
        counts.append(sum(p.numel() for p in layer.parameters() if p.requires_grad))
    return counts


class StagedPipelineModule(PipelineModule):
    """``PipelineModule`` that also accepts an explicit list of stage boundaries."""

    def __init__(self, layers, boundaries: list[int] | None = None, recompute: list[int] | None = None, **kwargs):
        self._explicit = boundaries
        super().__init__(layers, **kwargs)
        self._compiled_stage = None
        self._graphed: GraphedStage | None = None
        self._evaluating = False  # inside _forward_as_in_training: graphs are for training's passes only
        self.eval_as_training = False
        """Run forwards without gradients (evaluation) through the training graphs: see
        :meth:`_forward_as_in_training`."""
        self.recompute_layers = 0
        """Decoder layers of this stage recomputed in backward, each alone (``activation_checkpoint_layers``)."""
        if recompute is not None:
            self._set_recompute(recompute)

    @property
    def recomputes(self) -> bool:
        """Whether a backward of this stage reruns part of its forward (which must see the forward's weights)."""
        return bool(self.activation_checkpoint_interval or self.recompute_layers)

    def _set_recompute(self, counts: list[int]) -> None:
        if self.activation_checkpoint_interval or self.seed_layers:
            raise ValueError("activation_checkpoint_layers replaces DeepSpeed's checkpoint interval and seeded layers")
        check_recompute(counts, [sum(1 for spec in self._layer_specs[a:b] if _recomputable(spec))
                                 for a, b in zip(self.parts, self.parts[1:])])
        self.recompute_layers = counts[self.stage_id]

    def _build(self) -> None:
        """DeepSpeed's build of this stage's layers, with the ``LayerSpec``s built first by
        :func:`~ds_async.models.llama.build_all` (seeded layers on threads); DeepSpeed then registers the built
        modules under the same names as the ones it builds."""
        if self.seed_layers:  # DeepSpeed seeds the global generator before each layer: one after the other
            return super()._build()
        specs = self._layer_specs
        todo = [i for i in range(self._local_start, self._local_stop) if type(specs[i]) is LayerSpec]
        built = dict(zip(todo, llama.build_all([specs[i] for i in todo])))
        self._layer_specs = [built.get(i, spec) for i, spec in enumerate(specs)]
        try:
            super()._build()
        finally:
            self._layer_specs = specs

    def _count_layer_params(self) -> list[int]:
        return trainable_counts(self._layer_specs)

    def compile_stage(self, **compile_kwargs) -> None:
        """Run this stage's layers as one compiled region (``performance.compile_scope = "stage"``)."""
        if self.recomputes or self.seed_layers:
            raise ValueError("a stage compiled as one region cannot checkpoint or seed layer by layer")
        self._compiled_stage = compiled_stage(self.forward_funcs, **compile_kwargs)

    def graph_stage(self) -> None:
        """Replay this stage's training passes as CUDA graphs (``performance.cuda_graphs``;
        :mod:`ds_async.pipe.graphs`), over its compiled region if it has one; after :meth:`compile_stage`. An
        evaluation runs ungraphed: it would capture graphs (and gradient buffers) for the master weights that no
        training pass uses."""
        if self.recomputes or self.seed_layers:
            raise ValueError("a graphed stage cannot checkpoint or seed layer by layer")
        layers = [f for f in self.forward_funcs if isinstance(f, torch.nn.Module)]
        self._graphed = GraphedStage(layers, self._compiled_stage or _in_sequence(self.forward_funcs))

    def forward(self, forward_input):
        if self.eval_as_training and not torch.is_grad_enabled():
            return self._forward_as_in_training(forward_input)
        if self._compiled_stage is None and self._graphed is None and not self.recompute_layers:
            return super().forward(forward_input)
        self.micro_offset += 1  # as DeepSpeed's forward; only seeded layers read it, refused above
        if self._graphed is not None and self.training and torch.is_grad_enabled() and not self._evaluating:
            return self._graphed(forward_input)
        if self._compiled_stage is not None:
            return self._compiled_stage(forward_input)
        x, left = forward_input, self.recompute_layers
        for layer in self.forward_funcs:
            if left and _recomputable(layer):
                # DeepSpeed's reentrant checkpoint, as activation_checkpoint_interval runs it: the layer's input is
                # kept, the rest recomputed in backward
                x = self.activation_checkpoint_func(_unpacked(layer), *(x if isinstance(x, tuple) else (x,)))
                left -= 1
            else:
                x = layer(x)
        return x

    def _forward_as_in_training(self, forward_input):
        """An evaluation forward of a compiled, dropout-free stage through the graphs training compiled: in training
        mode, with gradients enabled and float inputs as leaves that require them, outputs detached. Compiled code is
        specialised on the grad mode, the modules' mode and the inputs' ``requires_grad``, so an evaluation in
        ``no_grad`` compiled its own graphs for a computation that without dropout is the same. The autograd graph of one micro-batch lives until its outputs are detached, as in training."""
        modes = [(m, m.training) for m in self.modules()]
        self.train()
        self._evaluating = True
        try:
            with torch.enable_grad():
                out = self.forward(_as_leaves(forward_input))
        finally:
            self._evaluating = False
            for m, mode in modes:
                m.training = mode
        return _detached(out)

    def _partition_layers(self, method="uniform"):
        if self._explicit is None:
            super()._partition_layers(method)
            # DeepSpeed's balanced partition holds numpy integers: the layout is recorded in checkpoint manifests and
            # compared on resume, so it is kept as Python's own.
            self.parts = [int(p) for p in self.parts]
            return
        self.parts = list(self._explicit)
        stage_id = self._topo.get_coord(self.global_rank).pipe
        self._set_bounds(start=self.parts[stage_id], stop=self.parts[stage_id + 1])


def decoder_layers(layers) -> list[torch.nn.Module]:
    """The decoder layers among built pipeline ``layers`` (LLaMA's and Mixtral's)."""
    return [layer for layer in layers if isinstance(layer, llama.DecoderLayerPipe)]


def _recomputable(layer) -> bool:
    """A decoder layer (a built one or its ``LayerSpec``): what ``activation_checkpoint_layers`` counts."""
    kinds = (llama.DecoderLayerPipe, mixtral.MoeDecoderLayerPipe)
    return issubclass(layer.typename, kinds) if hasattr(layer, "typename") else isinstance(layer, kinds)


def _as_leaves(x):
    """Float tensors of ``x`` (a tensor or tuple) as new leaves that require gradients, as training's inputs do."""
    if isinstance(x, tuple):
        return tuple(_as_leaves(t) for t in x)
    return x.detach().requires_grad_() if torch.is_tensor(x) and x.is_floating_point() else x


def _detached(x):
    return tuple(_detached(t) for t in x) if isinstance(x, tuple) else x.detach() if torch.is_tensor(x) else x


def loss_as_in_training(loss_fn):
    """``loss_fn`` that, called without gradients (evaluation), runs as in training (gradients enabled, float
    outputs as leaves that require them) and returns a detached loss: a compiled loss then reuses training's graph
    (see :meth:`StagedPipelineModule._forward_as_in_training`)."""
    def run(outputs, labels):
        if torch.is_grad_enabled():
            return loss_fn(outputs, labels)
        with torch.enable_grad():
            return _detached(loss_fn(_as_leaves(outputs), labels))
    return run


def dropout_free(hf_config) -> bool:
    """Whether training mode computes what evaluation mode does: no dropout and no router jitter configured."""
    values = {k: v for k, v in hf_config.to_dict().items() if "dropout" in k or k == "router_jitter_noise"}
    return all(not v for v in values.values() if isinstance(v, (int, float)))


def _unpacked(layer):
    """``layer`` as DeepSpeed's checkpoint calls it: with the stage tuple's items as separate arguments."""
    def run(*inputs):
        return layer(inputs[0] if len(inputs) == 1 else inputs)
    return run


def compiled_stage(layers, **compile_kwargs):
    """One ``torch.compile`` region over ``layers`` in sequence.

    Per-layer compilation pays the host a compiled call (guards, autograd wrapper) per layer and fuses nothing
    across layer boundaries; a pipeline stage whose host issues passes barely faster than its GPU runs them
    loses that as idle time. Parameters are graph inputs, so swapping in
    another weight version recompiles nothing.
    """
    return torch.compile(_in_sequence(layers), **compile_kwargs)


def _in_sequence(layers):
    layers = list(layers)

    def run(x):
        for layer in layers:
            x = layer(x)
        return x

    return run


def model_config(cfg: DsAsyncConfig, tokenizer=None):
    """The HF config object of the model the ``ds_async.model`` section describes; with the run's ``tokenizer``,
    its BOS/EOS ids are the tokenizer's (:func:`hf_io.match_tokenizer`; the model's computation does not read
    them, checkpoints and exports carry them to ``generate``).

    Raises ConfigError naming the key (``ds_async.model.config.<key>``, or ``ds_async.model.path`` and the key of
    its ``config.json``) for a config the pipeline cannot run: an unknown key, an attention geometry that does not
    fit (hidden size and heads, an odd head dimension, key/value heads that do not divide the heads), tied
    embeddings, a folder that is not there or a hub name that cannot be fetched, and a config with ``auto_map``
    (remote code, never run)."""
    if cfg.model.path is not None:
        where = f"ds_async.model.path: {cfg.model.path}"
        hub.refuse_remote_code(cfg.model.path, where, files=("config.json",))
        try:
            hf = AutoConfig.from_pretrained(cfg.model.path, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - a missing folder, an unreachable hub name, HF's validation
            raise ConfigError(f"{where}: cannot read its config ({hub.one_line(e)})") from None
        prefix = f"{where}: config.json's "
    else:
        _check_config_keys(cfg.model.family, cfg.model.config)
        defaults = AutoConfig.for_model(cfg.model.family).to_dict()
        # Before HF builds it (its validation does not name keys): the given keys over the family's defaults, but
        # for head_dim and num_key_value_heads, which HF derives from the others when they are not given.
        _check_geometry({**{k: defaults[k] for k in ("hidden_size", "num_attention_heads")}, **cfg.model.config},
                        "ds_async.model.config.")
        try:
            hf = AutoConfig.for_model(cfg.model.family, **{"tie_word_embeddings": False, **cfg.model.config})
        except Exception as e:  # noqa: BLE001 - HF's validation of values (types, ranges), its own error classes
            raise ConfigError(f"ds_async.model.config: {hub.one_line(e)}") from None
        prefix = "ds_async.model.config."
    if hf.model_type != cfg.model.family:
        raise ConfigError(f"ds_async.model.family: '{cfg.model.family}' but the config is a '{hf.model_type}'")
    _check_geometry(hf.to_dict(), prefix)
    FAMILIES[cfg.model.family].check_supported(hf, prefix)
    layers = hf.num_hidden_layers + 2  # embedding, decoder layers, head
    if cfg.pipeline_stages > layers:
        raise ConfigError(f"ds_async.pipeline_stages: {cfg.pipeline_stages} stages for {layers} layers (embedding + "
                          f"{layers - 2} decoder layers + head); a stage needs at least one layer")
    if tokenizer is not None:
        hf_io.match_tokenizer(hf, tokenizer)
        if hf.pad_token_id is not None and hf.pad_token_id == tokenizer.eos_token_id:
            # An export's pad is its EOS (for generate and batched prompts). Training pads nothing (rows are
            # packed), and as the embedding's padding_idx it would stop EOS's row from learning.
            hf.pad_token_id = None
    return hf


def check_seq_len(cfg: DsAsyncConfig, hf_config) -> None:
    """Packed rows must fit the model's positions."""
    positions = getattr(hf_config, "max_position_embeddings", None)
    if positions is not None and cfg.data.seq_len > positions:
        raise ConfigError(f"ds_async.data.seq_len: {cfg.data.seq_len} is longer than the model's "
                          f"max_position_embeddings ({positions})")


def check_vocab(tok, hf_config, spec: str) -> None:
    """The tokenizer's ids must all be rows of the model's embedding."""
    if len(tok) > hf_config.vocab_size:
        raise ConfigError(f"ds_async.model: vocab_size {hf_config.vocab_size} is smaller than the tokenizer's "
                          f"vocabulary ({len(tok)} tokens from {spec}); the tokenizer does not match the model")


def _check_geometry(values: dict, prefix: str) -> None:
    """The attention shapes the decoder layers need, named by key: heads and key/value heads at least 1, key/value
    heads dividing the heads, a head dimension (``head_dim``, else hidden_size / heads) that is whole and even
    (rotary embeddings rotate pairs). Keys not in ``values`` are left to the family's defaults."""
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    hidden, head_dim = values.get("hidden_size"), values.get("head_dim")
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv), ("hidden_size", hidden),
                       ("head_dim", head_dim)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{prefix}{key}: must be a positive integer, got {value!r}")
    if heads is not None and kv is not None and heads % kv:
        raise ConfigError(f"{prefix}num_key_value_heads: {kv} does not divide num_attention_heads ({heads}); each "
                          "key/value head serves a whole group of attention heads")
    if head_dim is None and hidden is not None and heads is not None:
        if hidden % heads:
            raise ConfigError(f"{prefix}hidden_size: {hidden} is not a multiple of num_attention_heads ({heads}) "
                              "(or set head_dim)")
        head_dim = hidden // heads
    if head_dim is not None and head_dim % 2:
        raise ConfigError(f"{prefix}head_dim: {head_dim} (hidden_size / num_attention_heads unless set) is odd; "
                          "rotary position embeddings need an even head dimension")


def _check_config_keys(family: str, kwargs: dict) -> None:
    """Hugging Face configs keep unknown kwargs as attributes without a word (``hidden_sise`` would train a model of
    the default width): refuse keys the family's config class does not define, naming the closest one."""
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
    init_distributed()
    hf_dir = cfg.model.path if cfg.model.path and cfg.model.load_weights else None
    family = FAMILIES[cfg.model.family]
    specs = family.layer_specs(hf_config, seed=cfg.seed, hf_dir=hf_dir)
    boundaries = cfg.partition.boundaries
    if boundaries is not None:
        boundaries = check_boundaries(boundaries, cfg.pipeline_stages, len(specs))
    perf = cfg.performance
    compiler = import_compiler_early() if perf.compile else None
    module = StagedPipelineModule(specs, boundaries=boundaries, num_stages=cfg.pipeline_stages,
                                  loss_fn=family.loss_fn(hf_config, perf.loss_chunk),
                                  partition_method="uniform" if cfg.partition.method == "explicit"
                                  else cfg.partition.method,
                                  activation_checkpoint_interval=perf.activation_checkpoint_interval,
                                  recompute=(recomputed_layers(perf, cfg.pipeline_stages)
                                             if perf.activation_checkpoint_layers else None),
                                  # DeepSpeed's (reentrant) checkpoint cannot start at the embedding, whose input
                                  # needs no gradient: recompute decoder layers only (DeepSpeed matches by name).
                                  checkpointable_layers=[llama.DecoderLayerPipe.__name__,
                                                         mixtral.MoeDecoderLayerPipe.__name__], **kwargs)
    if perf.fp8:  # before compiling, which then fuses torchao's casts into the layers
        for layer in decoder_layers(module.forward_funcs):
            fp8.convert(layer, perf.fp8)
    cache_compiled_code(perf)
    if compiler is not None:
        compiler.join()
    if perf.compile:  # the loss too, so it fuses with the softmax
        if perf.compile_scope == "stage":
            module.compile_stage()
        else:  # per layer: DeepSpeed drives the module layer by layer
            compile_layers(module.forward_funcs)
        module.loss_fn = torch.compile(module.loss_fn)
        if dropout_free(hf_config):
            module.eval_as_training = True
            module.loss_fn = loss_as_in_training(module.loss_fn)
    if perf.cuda_graphs:
        if not dropout_free(hf_config):
            raise ConfigError("ds_async.performance.cuda_graphs: the model has dropout (or router jitter), whose "
                              "random masks a replayed graph would repeat: set those to 0 or cuda_graphs to false")
        module.graph_stage()
    return module


def import_compiler_early() -> threading.Thread:
    """Import Inductor's compiler on a thread, started before the layers are built: ``torch.compile`` imports it at
    its first call, a long stretch of pure Python (torch.library's operator definitions, mostly) that would
    otherwise follow the build, and the build leaves the GIL free most of the time (its threads draw the weights,
    DeepSpeed copies them to the device, both without holding it). Join it before the first ``torch.compile``. An
    import error is left for that call to raise."""
    def run():
        try:
            importlib.import_module("torch._inductor.compile_fx")
        except Exception:  # torch.compile raises it again, with its own context
            pass

    thread = threading.Thread(target=run, name="ds_async-import-compiler", daemon=True)
    thread.start()
    return thread


def compile_layers(layers) -> None:
    """Compile each decoder layer and the head on its own (``performance.compile_scope = "layer"``), in place:
    identical decoder layers share one compiled code (Dynamo's cache is keyed by the code, and their weights are the
    graph's inputs)."""
    for layer in layers:
        if isinstance(layer, (llama.DecoderLayerPipe, llama.HeadPipe)):
            layer.compile()


def cache_compiled_code(perf) -> None:
    """:func:`use_compile_cache` with ``performance.compile_cache`` for a run that compiles anything: its layers
    (``compile``) or the fused optimizer step's passes (compiled on GPUs)."""
    if perf.compile or perf.fused_optimizer_step:
        use_compile_cache(perf.compile_cache)


def compile_cache_folder(folder: str | None) -> str | None:
    """``performance.compile_cache`` with ``~`` and environment variables expanded (None: torch's own location)."""
    return None if folder is None else os.path.expandvars(os.path.expanduser(folder))


def compile_line(perf) -> str | None:
    """The console line that says why a run's first step waits: it compiles the layers (``performance.compile``),
    and where the compiled code is kept for the next run. None when nothing compiles them (compile off, or Dynamo
    off by either of ``torch.compile``'s switches: ``TORCHDYNAMO_DISABLE=1``, ``TORCH_COMPILE_DISABLE=1``)."""
    if not perf.compile:
        return None
    import torch._dynamo  # slow, and already imported by a run that compiles

    if torch._dynamo.config.disable or os.environ.get("TORCHDYNAMO_DISABLE") == "1":
        return None
    what = {"layer": "one decoder layer, which the others reuse, and the head",
            "stage": "each stage's layers as one region"}[perf.compile_scope]
    where = compile_cache_folder(perf.compile_cache) or "torch's cache folder (TORCHINDUCTOR_CACHE_DIR)"
    return (f"ds_async: the first step compiles {what} (performance.compile_scope: {perf.compile_scope}); the "
            f"compiled code is kept in {where} for later runs of this model and shapes (performance.compile_cache)")


def use_compile_cache(folder: str | None) -> None:
    """Keep compiled code in ``folder`` (``performance.compile_cache``; None: torch's own location) with Inductor's
    FX graph cache and the AOTAutograd cache on, so that a later process with the same layers, shapes and torch
    loads it instead of compiling. Set before the first compilation. Triton's kernels go in its subfolder
    ``triton``: Inductor's, and ds_async's own (the optimizer's passes and Newton-Schulz, which may compile before
    any Inductor kernel), unless ``TRITON_CACHE_DIR`` is set."""
    import torch._functorch.config
    import torch._inductor.config

    folder = compile_cache_folder(folder)
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(folder, "triton"))
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


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
    stages = engine.num_stages
    if engine.grid.data_parallel_id == 0:
        hf_io.save_shard(hf_state_dict(engine.module), out_dir, hf_io.shard_name(engine.stage_id, stages))
    dist.barrier()
    if dist.get_rank() == 0:
        hf_io.write_index(out_dir, stages, hf_config)
    dist.barrier()
