"""The ``"ds_async"`` section of a DeepSpeed JSON config, as dataclasses (the sections' own in
:mod:`ds_async.config_sections`; the speed levers, :class:`PerformanceConfig`, and the whole, :class:`DsAsyncConfig`,
here), and what ds_async reads of DeepSpeed's keys (the optimizer block with the correction, batch sizes, clipping,
the LR schedule's length).

The DeepSpeed JSON is the single source of truth: DeepSpeed reads its own keys, ds_async reads this section.
Parsing is strict: an unknown or misspelled key, a value of the wrong type, or batch sizes that do not add up
stop the run at start with one message that names the key.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Literal

from .config_sections import (CheckpointConfig, ConfigError, CorrectionConfig, DataConfig, EvalConfig, LoggingConfig,
                              ModelConfig, OptimizerSetupError, PartitionConfig, TrainConfig, did_you_mean)
from .pipe import version_rule
from .pipe.version_rule import SCHEDULES


@dataclass
class PerformanceConfig:
    """Speed levers; each is off by default and changes no result beyond floating-point rounding (``fp8`` rounds
    the decoder layers' products to FP8)."""

    compile: bool = False
    """``torch.compile`` the model's layers (each decoder layer and the head, or the stage's layers as one region:
    ``compile_scope``) and the loss; never DeepSpeed's pipeline machinery around them. The first steps pay the
    compilation."""
    compile_scope: Literal["layer", "stage"] = "layer"
    """What one compiled region covers when ``compile`` is on: ``layer`` (each decoder layer and the head) or
    ``stage`` (all of a stage's layers in one region: one compiled call per pass instead of one per layer, and
    fusion across layer boundaries; not with activation checkpointing)."""
    compile_cache: str | None = "~/.cache/ds_async/compile"
    """Folder of the persistent compile cache (Inductor's FX graph and AOTAutograd caches, Triton's kernels), shared
    by runs and processes: a run whose layers, shapes and torch match an earlier one's loads their compiled code
    instead of compiling it. ``~`` and environment variables are expanded. null: torch's own location
    (``TORCHINDUCTOR_CACHE_DIR``, else a folder in /tmp)."""
    cuda_graphs: bool = False
    """Replay each stage's forward and backward as CUDA graphs (:mod:`ds_async.pipe.graphs`): one launch per pass
    instead of one per kernel, for stages whose host issues passes slower than the GPU runs them. One captured pair
    per weight slot and micro-batch in flight, each holding its own activations and parameter gradients (more
    memory); bit-equal to the ungraphed run. GPUs only; not with activation checkpointing or dropout."""
    deterministic: bool = False
    """The same bits on every run on the same machine: torch's deterministic algorithms (Inductor's compiled code
    follows them too; an op that has none stops the run with torch's error naming it), cuBLAS's fixed workspace and
    no cuDNN autotuning. Slower: for debugging and for comparing two runs exactly (torchtitan's
    ``debug.deterministic``). Off, GPU runs differ in the last bits from run to run (atomic additions)."""
    data_reader: Literal["auto", "process", "main"] = "auto"
    """Where the training stream is tokenized and packed: ``process`` in a reader process per data-reading rank,
    16 steps of micro-batches at a time, arriving pinned and copied to the GPU without blocking; ``main`` in the
    training process, one micro-batch at a time; ``auto``: ``process`` on GPUs, ``main`` on CPUs. The same
    micro-batches either way, and checkpoints of one resume under the other."""
    loss_chunk: int = 0
    """Rows (tokens) per chunk of the cross-entropy (``ds_async.models.loss``): the vocabulary logits are never
    held in fp32 whole. 0: ``F.cross_entropy`` on fp32 logits."""
    activation_checkpoint_interval: int = 0
    """Recompute the activations of every this many layers in backward instead of storing them (DeepSpeed's
    ``PipelineModule`` checkpointing; under flush-free schedules the recompute runs on the micro-batch's own
    weight version). 0: store all activations."""
    activation_checkpoint_layers: int | list[int] = 0
    """Recompute this many decoder layers of every stage in backward, each alone, the stage's first ones (Megatron's
    "block" recompute); a list gives each stage its own count. A pipeline stage holds ``p - s`` micro-batches at
    once, so the first stages need recompute where the last need none: ``python -m ds_async.plan`` suggests the
    fewest layers per stage that fit the card. Not with ``activation_checkpoint_interval``."""
    fused_optimizer_step: bool = False
    """Take the optimizer step in a few passes per tensor, from the bf16 gradients straight to the fp32 masters, the
    optimizer state, the bf16 weights and (flush-free schedules) the new weight version. Two cases: DeepSpeed's bf16
    optimizer over torch's AdamW under ``2bw``/``pipedream`` with one replica and no ZeRO
    (:mod:`ds_async.optim.adamw_pass`); and ds_async's Muon (with or without EF) under ``"bf16"``, any schedule,
    ZeRO stage 0 (:mod:`ds_async.optim.muon_pass`). Bit-equal to the unfused step on CPU; compiled on GPUs, where its
    rounding may differ in the last bit. Refused where it does not apply."""
    fp8: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] | None = None
    """FP8 matrix products in the decoder layers (attention projections, dense MLP) through torchao's float8
    training with this scaling recipe; embedding, head, norms, Mixtral's router and experts stay in the training
    precision (:mod:`ds_async.fp8` says why). Dynamic scaling: each weight version is scaled from its own values.
    Needs torchao (``pip install -e ".[fp8]"``), a GPU with FP8 tensor cores, ``compile`` and no fp16; this
    changes results (FP8 rounding), unlike the other levers. null: off."""


@dataclass
class DsAsyncConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model to train."""
    tokenizer: str = "train:8192"
    """A ``tokenizer.json`` path, a HF tokenizer name/directory, or ``train:<vocab>`` to train a byte-level BPE on
    the training stream at start (cached in the run folder)."""
    pipeline_stages: int = 2
    """Pipeline depth p; the remaining ranks become data-parallel replicas (world = p x dp)."""
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    """Layer-to-stage split."""
    schedule: str = version_rule.SYNC.name
    """The version rule (:mod:`ds_async.pipe.version_rule`). ``1f1b``: DeepSpeed's synchronous TrainSchedule
    (flush every step). ``2bw``: PipeDream-2BW, flush-free with a constant one-step weight delay. ``pipedream``:
    per-stage variable delay (original PipeDream). ``delay<d>`` (emulation only; the engine refuses it): a constant
    delay of ``d`` steps on every stage, the control for ``pipedream``'s."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and validation text streams."""
    train: TrainConfig = field(default_factory=lambda: TrainConfig(steps=100))
    """How long to train."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Validation cadence."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Where and how often to log."""
    seed: int = 1234
    """Seeds weight init, data order and every RNG."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Delay correction of the optimizer's updates (``{"type": "ef", "lambda": 1.0}``); none by default."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and how often to save checkpoints (see ``ds_async.checkpoint``)."""
    performance: PerformanceConfig = field(default_factory=PerformanceConfig)
    """Speed levers: compiled decoder layers, chunked cross-entropy, activation checkpointing."""


def recomputed_layers(perf: PerformanceConfig, stages: int) -> list[int]:
    """``performance.activation_checkpoint_layers`` as one count per stage."""
    n = perf.activation_checkpoint_layers
    return list(n) if isinstance(n, list) else [n] * stages


def check_boundaries(boundaries, stages: int, layers: int) -> list[int]:
    """``partition.boundaries`` as a list, refused unless it is ``stages + 1`` strictly increasing layer indices from 0
    to ``layers`` (embedding, decoder layers, head)."""
    b = list(boundaries or [])
    if len(b) != stages + 1 or b[0] != 0 or b[-1] != layers or any(x >= y for x, y in zip(b, b[1:])):
        raise ConfigError(f"ds_async.partition.boundaries: need {stages + 1} strictly increasing indices from 0 to "
                          f"{layers} (embedding + {layers - 2} decoder layers + head), got {boundaries}")
    return b


def check_recompute(counts: list[int], decoders: list[int]) -> None:
    """Refuse ``activation_checkpoint_layers`` asking a stage for more decoder layers than it has."""
    for stage, (n, have) in enumerate(zip(counts, decoders)):
        if n > have:
            raise ConfigError(f"ds_async.performance.activation_checkpoint_layers: stage {stage} has {have} decoder "
                              f"layers, asked to recompute {n}")


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check(value, tp, key: str):
    """Return ``value`` converted to type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        arms, errors = [a for a in args if a is not type(None)], []
        for arg in arms:
            try:
                return _check(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        # An object where one of the types is a dataclass: that dataclass's error names the nested key.
        nested = [e for e, arm in zip(errors, arms) if dataclasses.is_dataclass(arm)]
        if isinstance(value, dict) and len(nested) == 1:
            raise nested[0]
        raise errors[0] if len(errors) == 1 else ConfigError(
            f"{key}: expected {' or '.join(_type_name(a) for a in args)}, got {type(value).__name__} {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item,) = typing.get_args(tp)
        return [_check(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected an object, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def from_dict(cls, raw: dict, prefix: str):
    """``raw`` (a JSON object) as the dataclass ``cls``, strictly: an unknown key or a value of the wrong type
    raises ConfigError naming ``prefix.<key>``."""
    hints = typing.get_type_hints(cls)
    # A field's JSON key is its name unless metadata says otherwise (``lambda`` is not a Python identifier).
    fields = {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown key{did_you_mean(unknown[0], fields, prefix + '.')}; "
                          f"known keys: {sorted(fields)}")
    return cls(**{fields[k]: _check(v, hints[fields[k]], f"{prefix}.{k}") for k, v in raw.items()})


def parse(section: dict) -> DsAsyncConfig:
    """Parse and validate the ``"ds_async"`` section on its own (no DeepSpeed keys involved)."""
    cfg = from_dict(DsAsyncConfig, section, "ds_async")
    try:
        version_rule.get(cfg.schedule)
    except ValueError:
        families = ", or ".join(doc for _, doc in version_rule.FAMILIES.values())
        raise ConfigError(f"ds_async.schedule: must be one of {list(SCHEDULES)}, got {cfg.schedule!r} (or {families})"
                          ) from None
    if (cfg.train.steps is None) == (cfg.train.tokens is None):
        raise ConfigError("ds_async.train: set exactly one of 'steps' and 'tokens'")
    for key, value in (("ds_async.pipeline_stages", cfg.pipeline_stages), ("ds_async.data.seq_len", cfg.data.seq_len),
                       ("ds_async.data.min_chars", cfg.data.min_chars), ("ds_async.train.steps", cfg.train.steps),
                       ("ds_async.train.tokens", cfg.train.tokens), ("ds_async.eval.batches", cfg.eval.batches),
                       ("ds_async.logging.every", cfg.logging.every)):
        if value is not None and value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    for key, value in (("ds_async.checkpoint.every", cfg.checkpoint.every), ("ds_async.eval.every", cfg.eval.every),
                       ("ds_async.data.shuffle_buffer", cfg.data.shuffle_buffer),
                       ("ds_async.logging.optimizer_every", cfg.logging.optimizer_every),
                       ("ds_async.checkpoint.keep", cfg.checkpoint.keep),
                       ("ds_async.performance.loss_chunk", cfg.performance.loss_chunk),
                       ("ds_async.performance.activation_checkpoint_interval",
                        cfg.performance.activation_checkpoint_interval)):
        if value < 0:
            raise ConfigError(f"{key}: must be >= 0, got {value}")
    perf = cfg.performance
    if perf.compile_scope != "layer" and not perf.compile:
        raise ConfigError(f"ds_async.performance.compile_scope: '{perf.compile_scope}' needs compile: true")
    layers, recompute = perf.activation_checkpoint_layers, recomputed_layers(perf, cfg.pipeline_stages)
    key = "ds_async.performance.activation_checkpoint_layers"
    if len(recompute) != cfg.pipeline_stages:
        raise ConfigError(f"{key}: one count per stage ({cfg.pipeline_stages}), got {layers}")
    if any(n < 0 for n in recompute):
        raise ConfigError(f"{key}: counts must be >= 0, got {layers}")
    if perf.activation_checkpoint_interval and any(recompute):
        raise ConfigError(f"{key}: not with activation_checkpoint_interval "
                          f"({perf.activation_checkpoint_interval}); choose one")
    if perf.compile_scope == "stage" and any(recompute):
        raise ConfigError("ds_async.performance.compile_scope: 'stage' needs activation_checkpoint_layers 0 "
                          "(checkpointing runs layer by layer)")
    if perf.compile_scope == "stage" and perf.activation_checkpoint_interval:
        raise ConfigError("ds_async.performance.compile_scope: 'stage' needs activation_checkpoint_interval 0 "
                          "(checkpointing runs layer by layer)")
    if perf.cuda_graphs and (any(recompute) or perf.activation_checkpoint_interval):
        raise ConfigError("ds_async.performance.cuda_graphs: needs activation_checkpoint_layers 0 and "
                          "activation_checkpoint_interval 0 (a recomputed forward would run outside the replayed "
                          "backward)")
    if (cfg.model.path is None) == (not cfg.model.config):
        raise ConfigError("ds_async.model: set exactly one of 'config' (inline HF config) and 'path' (a directory)")
    if (cfg.partition.method == "explicit") != (cfg.partition.boundaries is not None):
        raise ConfigError("ds_async.partition.boundaries: required with method 'explicit' and only then")
    cfg.correction.check()
    return cfg


def check_engine(cfg: DsAsyncConfig) -> None:
    """Raise ConfigError when the pipeline engine does not run ``cfg``'s schedule (an emulation-only rule)."""
    try:
        version_rule.get(cfg.schedule).check_engine()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_correction(raw: dict, prefix: str = "ds_async.correction") -> CorrectionConfig:
    """Parse and validate a correction block on its own, e.g. ``{"type": "ef", "lambda": 1.0}``."""
    cfg = _check(raw, CorrectionConfig, prefix)
    cfg.check(prefix)
    return cfg


def correction_config(spec: CorrectionConfig | dict | None) -> CorrectionConfig:
    """A correction as the library takes it (``None``, its JSON dict or a :class:`CorrectionConfig`), checked."""
    if spec is None:
        return CorrectionConfig()
    cfg = spec if isinstance(spec, CorrectionConfig) else parse_correction(spec)
    cfg.check()
    return cfg


OWN_OPTIMIZER_TYPES = ("muon", "lion")
"""Optimizer types only ds_async implements (by lowercase name); DeepSpeed must be handed them as client
optimizers."""


@dataclass(frozen=True)
class OptimizerSpec:
    """DeepSpeed's ``"optimizer"`` block with ds_async's delay correction, read once (:func:`parse_optimizer`): what
    the engine's client optimizer, the emulation's optimizer and the planner's byte model are built from."""

    type: str
    """``optimizer.type`` as written (DeepSpeed's, a ``torch.optim`` class, or ds_async's Muon/Lion)."""
    params: dict
    """``optimizer.params``, the optimizer's keyword arguments."""
    correction: CorrectionConfig
    """``ds_async.correction``."""

    @property
    def kind(self) -> str:
        """The type by lowercase name, as DeepSpeed compares it."""
        return self.type.lower()

    @property
    def ds_async_builds(self) -> bool:
        """Whether ds_async builds this optimizer (a Muon/Lion type, or any correction), which the engine must pass
        to DeepSpeed as a client optimizer instead of letting DeepSpeed build one from the block."""
        return self.kind in OWN_OPTIMIZER_TYPES or self.correction.type != "none"


def parse_optimizer(block, correction: CorrectionConfig | dict | None = None) -> OptimizerSpec | None:
    """The :class:`OptimizerSpec` of DeepSpeed's ``"optimizer"`` block (``None`` without one) and a correction
    (:func:`correction_config`); a block of the wrong shape is an :class:`OptimizerSetupError` naming the key.
    Whether its type and params build is checked where they are built (``ds_async.optim``)."""
    if block is None:
        return None
    if not isinstance(block, dict):
        raise OptimizerSetupError(f"optimizer: expected an object with \"type\" and \"params\", got {block!r}")
    kind, params = block.get("type"), block.get("params", {})
    if not isinstance(kind, str):
        raise OptimizerSetupError(f"optimizer.type: required, the optimizer's name (e.g. \"AdamW\"), got {kind!r}")
    if not isinstance(params, dict):
        raise OptimizerSetupError(f"optimizer.params: expected an object of the optimizer's arguments, got {params!r}")
    return OptimizerSpec(kind, dict(params), correction_config(correction))


GRADIENT_CLIPPING_DEFAULT = 1.0
"""DeepSpeed's ``gradient_clipping`` when the JSON has none (``deepspeed.runtime.constants``)."""


def gradient_clipping(ds_config: dict) -> float:
    """The gradient-norm clip the DeepSpeed engine applies for ``ds_config`` (0: none), for the code that must agree
    with it without an engine (the emulation, the memory planner)."""
    value = ds_config.get("gradient_clipping")
    return GRADIENT_CLIPPING_DEFAULT if value is None else float(value)


def check_batch(ds_config: dict, cfg: DsAsyncConfig, world_size: int) -> tuple[int, int, int]:
    """Resolve (train_batch_size, micro_batch, grad_accum) the way DeepSpeed would, or say which key is wrong.

    Returns the three sizes; the data-parallel degree is ``world_size / pipeline_stages``.
    """
    p = cfg.pipeline_stages
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    for key in ds_config:
        hint = did_you_mean(key, batch_keys, cutoff=0.85) if key not in batch_keys else ""
        if hint:
            raise ConfigError(f"{key}: not a DeepSpeed key{hint}")
    if world_size % p:
        raise ConfigError(f"ds_async.pipeline_stages: {p} does not divide the world size {world_size}")
    dp = world_size // p
    tbs = ds_config.get("train_batch_size")
    mbs = ds_config.get("train_micro_batch_size_per_gpu")
    gas = ds_config.get("gradient_accumulation_steps")
    for key, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                   ("gradient_accumulation_steps", gas)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ConfigError(f"{key}: expected a positive integer, got {v!r}")
    if mbs is None:
        raise ConfigError("train_micro_batch_size_per_gpu: required for pipeline training")
    if gas is None:
        if tbs is None or tbs % (mbs * dp):
            raise ConfigError(f"train_batch_size: {tbs} is not a multiple of train_micro_batch_size_per_gpu ({mbs}) "
                              f"x data-parallel degree ({dp})")
        gas = tbs // (mbs * dp)
    if tbs is None:
        tbs = mbs * gas * dp
    if tbs != mbs * gas * dp:
        raise ConfigError(f"train_batch_size: {tbs} != train_micro_batch_size_per_gpu ({mbs}) x "
                          f"gradient_accumulation_steps ({gas}) x data-parallel degree ({dp}) = {mbs * gas * dp}")
    try:
        version_rule.get(cfg.schedule).check(p, gas)
    except ValueError as e:
        raise ConfigError(f"gradient_accumulation_steps: {e}") from None
    return tbs, mbs, gas


# DeepSpeed's LR schedulers whose shape depends on the run's length.
_LENGTH_SCHEDULERS = ("WarmupDecayLR", "WarmupCosineLR")


def length_scheduler(ds_config: dict) -> str | None:
    """The type of ``ds_config``'s LR scheduler if its shape depends on the run's length, else None."""
    block = ds_config.get("scheduler")
    return block.get("type") if isinstance(block, dict) and block.get("type") in _LENGTH_SCHEDULERS else None


def with_schedule_length(ds_config: dict, total_steps: int, schedule_steps: int | None = None) -> dict:
    """``ds_config`` with its scheduler's ``total_num_steps`` set to the run's length (``train.steps``, or
    ``train.tokens`` in whole steps), so the two cannot drift apart; a different value written there is refused
    naming both keys. ``schedule_steps``: the length to build the schedule for instead (a resumed run that keeps
    its checkpoint's schedule, ``train.on_resume_length``)."""
    if length_scheduler(ds_config) is None:
        return ds_config
    block = ds_config["scheduler"]
    params = dict(block.get("params") or {})
    given = params.get("total_num_steps")
    if given is not None and given != total_steps:
        raise ConfigError(f"scheduler.params.total_num_steps: {given}, but ds_async.train makes the run {total_steps} "
                          "steps long; remove it (ds_async fills it in) or make the two agree")
    params["total_num_steps"] = total_steps if schedule_steps is None else schedule_steps
    return {**ds_config, "scheduler": {**block, "params": params}}


def load(path: str, overrides: dict | None = None) -> tuple[dict, DsAsyncConfig]:
    """Read a DeepSpeed JSON file, set ``overrides`` in it (dotted key -> value: the command line's ``--set``, see
    :func:`parse_set`); return (DeepSpeed's part, parsed ds_async section)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the config file ({e})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top, got {type(raw).__name__}")
    try:
        raw = override(raw, overrides or {})
    except ValueError as e:
        raise ConfigError(f"--set {e}") from None
    section = raw.pop("ds_async", None)
    if section is None:
        raise ConfigError(f"{path}: no \"ds_async\" section")
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: ds_async: expected an object, got {type(section).__name__} {section!r}")
    return raw, parse(section)


def resolved(cfg) -> dict:
    """The config with every default filled in, as the JSON section that :func:`parse` reads back (the run
    manifest's ``ds_async``)."""
    if not dataclasses.is_dataclass(cfg):
        return cfg
    return {f.metadata.get("key", f.name): resolved(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}


def data_parallel_degree(ds_config: dict) -> int:
    """The replicas a launch of this config would have, from its batch keys alone: ``train_batch_size / (micro-batch
    x accumulation)`` when all three are given, else 1 (the emulation and the planner, which have no world size)."""
    tbs, mbs, gas = (ds_config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                 "gradient_accumulation_steps"))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (tbs, mbs, gas)):
        return 1
    if tbs % (mbs * gas):
        raise ConfigError(f"train_batch_size: {tbs} is not a multiple of train_micro_batch_size_per_gpu ({mbs}) x "
                          f"gradient_accumulation_steps ({gas})")
    return tbs // (mbs * gas)


def parse_set(text: str) -> tuple[str, object]:
    """A ``--set KEY=VALUE`` argument (the jobs', the study driver's, the benchmarks'): the dotted key and the value
    as JSON, else as the string it is."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--set {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    """The jobs' ``--set KEY=VALUE`` (``args.sets``: (key, value) pairs, in order; :func:`load` takes them as a
    dict, the last of a key winning)."""
    parser.add_argument("--set", dest="sets", type=parse_set, action="append", default=[], metavar="KEY=VALUE",
                        help="set a dotted key of the JSON for this run (a JSON value, else a string), e.g. "
                             "optimizer.params.lr=3e-4 or ds_async.train.steps=100 (repeatable)")


def override(config: dict, overrides: dict) -> dict:
    """A copy of ``config`` with each dotted key set to its value (missing objects on the way are created)."""
    out = copy.deepcopy(config)
    for key, value in overrides.items():
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"{key}: {part!r} is not an object in the config")
        node[last] = copy.deepcopy(value)
    return out
