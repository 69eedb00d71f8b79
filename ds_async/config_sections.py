"""The sections of the ``"ds_async"`` JSON section as dataclasses, each field's docstring its key's reference, and
the errors a config raises (:class:`ConfigError`, whose message names the offending key; :func:`did_you_mean` for a
misspelled key) and the one for data it names that cannot be read (:class:`DataError`, raised by ``ds_async.data``).
``ds_async.config`` parses the JSON into them (with the speed levers, ``PerformanceConfig``, and the whole section,
``DsAsyncConfig``, which live there) and checks what spans sections.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Literal

from .corpus import EMBEDDED_CORPUS


class ConfigError(ValueError):
    """A problem in the user's config; the message names the offending key."""


class DataError(ValueError):
    """Training or validation data that cannot be read; the message names the file or source. Defined here, with
    the config's errors, so that the command line catches it without importing the data path (datasets)."""


class OptimizerSetupError(ConfigError):
    """An ``"optimizer"`` block, or a combination of optimizer, precision and ZeRO stage, that ds_async cannot run
    as written; the message names the key."""


def did_you_mean(word: str, known, prefix: str = "", cutoff: float = 0.6, fold_case: bool = False) -> str:
    """`` (did you mean '<prefix><nearest>'?)`` for the nearest of ``known`` to a misspelled ``word``, or ``""``.
    ``fold_case``: a name that differs only in case is the nearest."""
    known = list(known)
    hint = [k for k in known if k.lower() == word.lower()] if fold_case else []
    hint = hint or difflib.get_close_matches(word, known, n=1, cutoff=cutoff)
    return f" (did you mean '{prefix}{hint[0]}'?)" if hint else ""


@dataclass
class ModelConfig:
    family: Literal["llama", "mixtral"] = "llama"
    """Model architecture: ``llama`` (dense) or ``mixtral`` (sparse MoE; the loss adds ``router_aux_loss_coef`` x
    the router load-balancing loss)."""
    config: dict[str, Any] = field(default_factory=dict)
    """Inline Hugging Face config kwargs (e.g. ``LlamaConfig(**config)``). Exclusive with ``path``."""
    path: str | None = None
    """A ``save_pretrained`` directory: its ``config.json`` defines the model and, if ``load_weights``, its
    safetensors give the initial weights (each stage reads only its own tensors)."""
    load_weights: bool = True
    """With ``path``: start from the directory's weights (false: only take its config, initialise fresh)."""


@dataclass
class PartitionConfig:
    method: Literal["uniform", "parameters", "explicit"] = "parameters"
    """How layers (embedding, each decoder layer, head) are split into stages: the same number of layers per stage,
    balanced parameter counts, or the ``boundaries`` given here."""
    boundaries: list[int] | None = None
    """For ``explicit``: ``stages + 1`` increasing layer indices starting at 0 and ending at the layer count
    (``num_hidden_layers + 2``); stage ``s`` owns layers ``[boundaries[s], boundaries[s+1])``."""


@dataclass
class DataSource:
    """A dataset as ``datasets.load_dataset(path, name=..., revision=..., data_dir=..., data_files=..., split=...,
    streaming=True)`` takes it, or (``data.validation`` only) ``from_train``: documents held out of the training
    data. ``ds_async/data/sources.py`` resolves and checks it (``resolve_source``)."""

    path: str | None = None
    """What ``load_dataset`` takes: a hub dataset (``allenai/c4``, ``hf://datasets/HuggingFaceFW/fineweb``), a local
    dataset folder, or a builder (``parquet``, ``json``, ``text``, ``csv``) with ``data_files``; or a file or glob
    ending in .parquet/.json/.jsonl/.txt/.cor, local or a URL (``hf://datasets/owner/name@rev/dir/*.parquet``), or
    an embedded corpus (``python:docs``, ``gensim:lee``). In ``data.validation`` without ``path``: the dataset of
    ``data.train``, another ``split``."""
    name: str | None = None
    """The dataset's config name (``en`` for ``allenai/c4``, ``wikitext-103-raw-v1`` for ``wikitext``)."""
    revision: str | None = None
    """Branch, tag or commit of a hub dataset."""
    split: str | None = None
    """The split to stream (default: ``train`` for ``data.train``, ``validation`` for ``data.validation``)."""
    data_files: str | list[str] | dict[str, Any] | None = None
    """Files or globs within ``path`` (or of a builder ``path``): one pattern, a list, or ``{split: pattern(s)}``."""
    data_dir: str | None = None
    """Subfolder of the dataset to read."""
    text_field: str | None = None
    """The column holding the text in this dataset (default: ``data.text_field``)."""
    from_train: int | None = None
    """``data.validation`` only, alone: the first this many documents of the training data in file order, which
    training then skips (for datasets with no validation split, such as FineWeb)."""


@dataclass
class DataConfig:
    train: str | DataSource = EMBEDDED_CORPUS
    """Training text: a local parquet/json(l)/txt file or glob, a hub dataset name, an ``hf://`` path, an embedded
    corpus (``python:docs``: Python's own documentation, which every Python installation carries, see
    ``ds_async.corpus``; ``gensim:lee``: the Lee news corpus inside gensim's wheel, ``pip install gensim``), or a
    ``DataSource`` object (``{"path": "allenai/c4", "name": "en"}``)."""
    validation: str | DataSource | None = EMBEDDED_CORPUS
    """Held-out text for validation loss (same forms as ``train``; an object may name only another ``split`` of the
    training dataset, or hold documents out of it with ``from_train``); null disables evaluation."""
    text_field: str = "text"
    """Column holding the document text."""
    seq_len: int = 128
    """Tokens per packed row."""
    shuffle_buffer: int = 1000
    """Documents in the streaming shuffle buffer (0: keep file order)."""
    min_chars: int = 1
    """Documents with fewer non-whitespace characters are skipped and counted (1: only empty ones). Text-file lines
    that are not valid UTF-8 are skipped and counted too; the counts are in the run summary."""


@dataclass
class TrainConfig:
    steps: int | None = None
    """Optimizer steps to run. Exactly one of ``steps`` and ``tokens`` must be set."""
    tokens: int | None = None
    """Training tokens to consume (rounded up to whole steps)."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """What a NaN or inf training loss does (see ``ds_async.nonfinite``). ``stop``: training stops at that step
    with an error, saving nothing after it, so the newest checkpoint is the last good one (every schedule; under
    ``2bw``/``pipedream`` ranks learn of it one step later). ``skip``: the update of any step whose gradient is
    non-finite is dropped on all ranks and counted (needs fp32/torch_autocast weights and no DeepSpeed ZeRO or
    bf16 optimizer wrapper; refused at start otherwise)."""
    on_resume_length: Literal["keep_schedule", "restretch"] = "keep_schedule"
    """What ``--resume`` does to a length-dependent LR schedule (``WarmupCosineLR``, ``WarmupDecayLR``) when
    ``steps``/``tokens`` changed since the checkpoint (said in one line at start). ``keep_schedule``: continue the
    checkpoint's schedule, holding its final LR past its end (``WarmupDecayLR``'s is 0). ``restretch``: the
    schedule of the new length, at the LR a run of that length has at the resumed step (the LR may jump there)."""


@dataclass
class CheckpointConfig:
    dir: str | None = None
    """Folder that holds the checkpoint folders ``step_NNNNNNNN`` (default ``<logging.dir>/<run_name>/checkpoints``).
    Shared by all ranks (one filesystem). ``--resume`` takes the newest complete checkpoint in it."""
    every: int = 0
    """Save every this many steps (0: no periodic saves). Under ``2bw``/``pipedream`` the pipeline drains before
    each save (one warm-up per save), which leaves the math unchanged."""
    final: bool = True
    """Save when training ends."""
    keep: int = 3
    """Keep the newest this many checkpoints, deleting older ones after each save (0: keep all)."""
    async_save: bool = False
    """Write checkpoints in the background: the step that saves drains the pipeline as always and copies the
    checkpoint's tensors to host memory (one more copy of this rank's part of a checkpoint in host memory), then
    training goes on while a thread writes, hashes and completes it. One save at a time: the next save, the end of
    training and a preemption wait for the one in flight; a failed write stops the run there. (The command line's
    engine; the emulation writes its small state file as it goes.)"""
    preempt_grace_s: float = 25.0
    """On SIGTERM (what SLURM and Kubernetes send before killing a job, and what torchrun and the deepspeed launcher
    pass on to the ranks): seconds within which every rank finishes its step, the pipeline drains, a checkpoint is
    saved and the job exits with status 75 (EX_TEMPFAIL: preempted, resume with ``--resume``). Past it, or on a
    second SIGTERM, the job exits at once (status 143) without one. Keep it under the time the scheduler waits
    before SIGKILL (Kubernetes' default 30 s, the launchers' 30 s). 0: SIGTERM ends the job at once. Only for runs
    that save checkpoints (``every`` or ``final``). The first foreground save that takes 80% of it or more is said in
    one warning line: a preempted job's save takes about as long."""

    @property
    def saves(self) -> bool:
        """Whether the run saves any checkpoint (periodic or final)."""
        return self.every > 0 or self.final

    def __post_init__(self):
        if self.preempt_grace_s < 0:
            raise ConfigError(f"ds_async.checkpoint.preempt_grace_s: must be >= 0, got {self.preempt_grace_s}")


@dataclass
class EvalConfig:
    every: int = 50
    """Validation loss every this many steps (0: only at the end)."""
    batches: int = 4
    """Micro-batches per data-parallel rank in each validation pass."""


@dataclass
class LoggingConfig:
    dir: str = "runs"
    """Root folder for runs; each run writes ``<dir>/<run_name>/`` (tensorboard events, manifest, PNG)."""
    run_name: str | None = None
    """Run folder name (default: schedule-optimizer-timestamp)."""
    every: int = 1
    """Write train scalars (loss, lr, tokens, gradient norm, step time, tokens/s, MFU) every this many steps, and
    print them then when ``progress`` is off."""
    optimizer_every: int = 50
    """Write the optimizer figures (``optimizer/...``: update RMS, correction buffer norm, staleness) every this
    many steps, 0 for never. Gathering them involves every rank, a barrier across the stages of a flush-free
    pipeline, so keep it sparse."""
    stages_every: int = 50
    """Gather each stage's peak memory and idle fraction (``stage<s>/...``) to the reporting rank every this many
    steps, and at each evaluation and the end (0: only then). An object all-gather over all ranks, a barrier across
    the stages of a flush-free pipeline, so keep it sparse."""
    window: int = 20
    """Step time, tokens/s and MFU are averages over the last this many steps (per-step rates of a flush-free
    pipeline jump with the host's lead over the GPU)."""
    warmup_steps: int = 2
    """The first this many steps of each process (compilation, allocator growth) count in no average: step time,
    tokens/s, MFU and idle fractions are not logged until a later step."""
    peak_tflops: float | None = None
    """One device's peak TFLOP/s for MFU (model FLOPs/s over world size x this). null: the dense bf16 peak of
    H100 (989; PCIe 756, NVL 835), H200 (989) and A100 (312) from the GPU's name; no MFU on CPU or other cards."""
    progress: bool = True
    """Show a tqdm progress bar on the reporting rank."""
    plot: bool = True
    """Write ``loss.png`` with the train/validation curves at the end."""
    deepspeed_log: bool = False
    """Show DeepSpeed's own start-up output (its INFO and WARNING lines, the topology and layer listing) while the
    pipeline and engine are built; off, only its errors (ds_async's lines always show)."""

    def __post_init__(self):
        for key, value, least in (("window", self.window, 1), ("stages_every", self.stages_every, 0),
                                  ("warmup_steps", self.warmup_steps, 0)):
            if value < least:
                raise ConfigError(f"ds_async.logging.{key}: must be >= {least}, got {value}")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ConfigError(f"ds_async.logging.peak_tflops: must be > 0, got {self.peak_tflops}")


@dataclass
class CorrectionConfig:
    """A delay correction applied to every optimizer update (see ``ds_async.optim.corrections``)."""

    type: Literal["none", "ef", "nesterov"] = "none"
    """``none``; ``ef``: error feedback, apply ``u(t) + lambda (u(t) - u(t-1))``; ``nesterov``: weight-space
    look-ahead of ``delay`` steps along an EMA of the updates."""
    lam: float | None = field(default=None, metadata={"key": "lambda"})
    """``ef`` only (JSON key ``lambda``): weight of the update difference; default 1, the one-step delay of 2BW."""
    momentum: float | None = None
    """``nesterov`` only: EMA coefficient of the velocity estimate, in [0, 1); default 0.9."""
    delay: int | None = None
    """``nesterov`` only: how many steps ahead to look, the gradient delay; default 1 (2BW)."""

    def check(self, prefix: str = "ds_async.correction") -> None:
        """Refuse keys that belong to another correction type."""
        owner = {"lambda": "ef", "momentum": "nesterov", "delay": "nesterov"}
        for key, value in (("lambda", self.lam), ("momentum", self.momentum), ("delay", self.delay)):
            if value is not None and owner[key] != self.type:
                raise ConfigError(f"{prefix}.{key}: only for type '{owner[key]}', not '{self.type}'")
        if self.momentum is not None and not 0.0 <= self.momentum < 1.0:
            raise ConfigError(f"{prefix}.momentum: must be in [0, 1), got {self.momentum}")
        if self.delay is not None and self.delay < 0:
            raise ConfigError(f"{prefix}.delay: must be >= 0, got {self.delay}")
