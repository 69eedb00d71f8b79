"""What ``--resume`` does with each config key that changed since the checkpoint: one table, :data:`POLICY`.

A checkpoint's manifest records the config it was saved under (``ds_async``: the resolved section; ``deepspeed``:
the DeepSpeed keys as the engine got them) and the run length its LR schedule was built for (``run_steps``); its
``config.json`` is the model's. :func:`plan` compares them with the resuming job's and says, per key:

- ``refused``: the saved state cannot be continued under the new value (the model's architecture, the optimizer
  type, the correction type, the precision and ZeRO stage): ConfigError naming the key, old and new value;
- ``applied``: the new value takes effect from the first resumed step (optimizer hyperparameters, the LR schedule's
  parameters, gradient clipping, the correction's coefficients, the data recipe), with one warning line naming old
  -> new;
- ``length``: the run's length (``ds_async.train.steps``/``tokens``) decides only how far the run goes; what it does
  to a length-dependent LR schedule is ``ds_async.train.on_resume_length`` (:func:`schedule_length`), said in one
  line at start;
- ``layout``: the pipeline layout (stages, partition, schedule, batch sizes): refused on load when the layout it
  gives differs (:func:`ds_async.checkpoint.load`);
- ``carried``: the checkpoint's value is kept whatever the config says (the weights, the trained tokenizer);
- ``free``: applied silently, as it changes nothing the checkpoint holds (logging, evaluation, checkpoint cadence,
  speed levers).

A key no pattern names is ``applied``. Keys missing from an older checkpoint's manifest count as unchanged; keys
this config lacks (a block removed) have the new value None.

Also which checkpoint ``--resume`` names (:func:`checkpoint_to_resume`), a job's config as the keys compared
(:func:`config_keys`), the optimizer type a resumed run must keep (:func:`check_optimizer_type`) and what a saved
position in the training stream refers to (:func:`stream_recipe`).
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

from . import checkpoint
from .config import ConfigError, DsAsyncConfig
from .job import optimizer_type

REFUSED, APPLIED, LENGTH, LAYOUT, CARRIED, FREE = "refused", "applied", "length", "layout", "carried", "free"

POLICY: tuple[tuple[str, str], ...] = (
    # (key pattern, what a resume does); the first matching pattern decides. "model.*" keys are the model's
    # Hugging Face config as the checkpoint's config.json and this run's model build it.
    ("model.attention_dropout", APPLIED), ("model.*_dropout", APPLIED), ("model.router_aux_loss_coef", APPLIED),
    ("model.router_jitter_noise", APPLIED),
    ("model.initializer_range", FREE),  # initialises weights the checkpoint replaces
    ("model.*", REFUSED),
    ("ds_async.model.*", CARRIED),  # the checkpoint's weights; the architecture is compared as model.*
    ("ds_async.tokenizer", CARRIED),  # train:<vocab>: the checkpoint's; a file: its vocabulary must match (checked)
    ("ds_async.pipeline_stages", LAYOUT), ("ds_async.partition.*", LAYOUT), ("ds_async.schedule", LAYOUT),
    ("ds_async.correction.type", REFUSED),
    ("ds_async.correction.*", APPLIED),
    ("ds_async.data.*", APPLIED), ("ds_async.seed", APPLIED),
    ("ds_async.train.steps", LENGTH), ("ds_async.train.tokens", LENGTH),
    ("ds_async.train.*", FREE), ("ds_async.eval.*", FREE), ("ds_async.logging.*", FREE),
    ("ds_async.checkpoint.*", FREE), ("ds_async.performance.*", FREE),
    ("deepspeed.optimizer.type", REFUSED),
    ("deepspeed.optimizer.params.*", APPLIED),
    ("deepspeed.scheduler.params.total_num_steps", LENGTH),
    ("deepspeed.scheduler.*", APPLIED),
    ("deepspeed.gradient_clipping", APPLIED),
    ("deepspeed.train_batch_size", LAYOUT), ("deepspeed.train_micro_batch_size_per_gpu", LAYOUT),
    ("deepspeed.gradient_accumulation_steps", LAYOUT),
    ("deepspeed.bf16.*", REFUSED), ("deepspeed.fp16.*", REFUSED), ("deepspeed.torch_autocast.*", REFUSED),
    ("deepspeed.zero_optimization.stage", REFUSED),
    ("deepspeed.*", FREE),
)

# Hugging Face config entries that describe no weight: ids the tokenizer sets, bookkeeping of transformers.
_MODEL_BOOKKEEPING = frozenset({"transformers_version", "architectures", "bos_token_id", "eos_token_id",
                                "pad_token_id", "torch_dtype", "dtype", "_name_or_path", "use_cache",
                                "_attn_implementation_autoset", "_commit_hash", "output_router_logits"})

WHY_REFUSED = {
    "model": "the checkpoint's weights were trained with the old value",
    "ds_async.correction.type": "its buffers live in the optimizer state, which does not carry over to another type",
    "deepspeed.optimizer.type": "its state does not carry over to another optimizer",
}


def action(key: str) -> str:
    """What a resume does when ``key`` (``model.<hf key>``, ``ds_async.<key>``, ``deepspeed.<key>``) changed."""
    for pattern, what in POLICY:
        if fnmatch.fnmatchcase(key, pattern):
            return what
    return APPLIED


def flatten(value, prefix: str) -> dict:
    """A JSON object as ``{dotted key: leaf value}`` (lists are leaves)."""
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for k, v in value.items():
        out.update(flatten(v, f"{prefix}.{k}"))
    return out


def changes(saved: dict, now: dict) -> dict[str, tuple]:
    """``{key: (old, new)}`` of the keys whose value differs between flattened documents ``saved`` and ``now``; a
    key the checkpoint has and this config lacks is new value None (a block removed); a key an older checkpoint
    did not record is not a change."""
    out = {k: (saved[k], v) for k, v in now.items() if k in saved and saved[k] != v}
    out.update({k: (v, None) for k, v in saved.items() if k not in now})
    return out


def model_keys(hf_dict: dict) -> dict:
    """A model's Hugging Face config (``to_dict()``) as ``model.<key>`` entries, bookkeeping left out."""
    return flatten({k: v for k, v in hf_dict.items() if k not in _MODEL_BOOKKEEPING}, "model")


def plan(saved: dict, now: dict, folder) -> dict[str, dict[str, tuple]]:
    """The changed keys of flattened documents ``saved`` (the checkpoint's) and ``now`` by action; ConfigError
    naming the first refused key with its old and new value."""
    by_action: dict[str, dict[str, tuple]] = {}
    for key, (old, new) in changes(saved, now).items():
        by_action.setdefault(action(key), {})[key] = (old, new)
    refused = by_action.get(REFUSED)
    if refused:
        key, (old, new) = next(iter(refused.items()))
        why = next((w for prefix, w in WHY_REFUSED.items() if key == prefix or key.startswith(prefix + ".")),
                   "the saved state does not carry over to another value")
        shown = key.removeprefix("deepspeed.")
        more = f" (and {len(refused) - 1} more: {', '.join(list(refused)[1:4])})" if len(refused) > 1 else ""
        raise ConfigError(f"{shown}: {new!r}, but the checkpoint {folder} was saved with {old!r}{more}; a resume "
                          f"cannot change it ({why}): resume with the old value, or start a new run from its weights "
                          "(ds_async.model.path after python -m ds_async.export)")
    return by_action


def describe_applied(applied: dict[str, tuple], step: int, lr_before: float | None, lr_after: float | None) -> str:
    """The warning line of the changes a resume at ``step`` applies, with the LR the checkpoint left and the one
    the next step takes if they differ."""
    shown = "; ".join(f"{k.removeprefix('deepspeed.')} {old!r} -> {new!r}" for k, (old, new) in applied.items())
    lrs = "" if lr_before is None or lr_after is None or lr_before == lr_after else \
        f" (the LR goes from {lr_before:.4g} at step {step} to {lr_after:.4g})"
    return f"ds_async: warning: changed since the checkpoint and applied from this config from the first resumed " \
           f"step: {shown}{lrs}"


def schedule_length(policy: str, saved_length: int | None, length: int) -> int:
    """The run length a resumed run's LR schedule is built for: ``keep_schedule`` keeps the checkpoint's
    (``saved_length``; None when an older checkpoint did not record it: the new one), ``restretch`` takes the new
    ``length``."""
    if policy == "keep_schedule" and saved_length is not None:
        return saved_length
    return length


def length_line(policy: str, step: int, saved_length: int, length: int, schedule: int, scheduler: str | None,
                lr_before: float | None, lr_after: float | None) -> str:
    """The line at start of a resume whose run length (or schedule length) changed since the checkpoint:
    ``saved_length`` -> ``length`` steps, the LR schedule (type ``scheduler``, None if none depends on the length)
    built for ``schedule`` steps, and the LR the checkpoint left and the one the next step takes."""
    head = (f"ds_async: resuming at step {step} a run now {length} steps long (the checkpoint's: {saved_length}); "
            f"ds_async.train.on_resume_length = '{policy}': ")
    if scheduler is None:
        return head + "no LR schedule depends on the run's length"
    lrs = "" if lr_before is None or lr_after is None else \
        f"; the LR goes from {lr_before:.4g} (step {step}) to {lr_after:.4g}"
    if schedule != length:
        return head + f"{scheduler} stays the {schedule}-step schedule, holding its final LR past step {schedule}{lrs}"
    return head + f"{scheduler} is recomputed for {length} steps, as a run of that length has it{lrs}"


def checkpoint_to_resume(resume: str, cfg: DsAsyncConfig, ckpt_root: Path) -> Path | None:
    """The checkpoint ``--resume`` means: ``latest`` is the newest complete one in the run's checkpoint folder
    (None if it has none: the run starts at step 0); anything else is a checkpoint folder, a folder of them, or a
    run folder (its ``checkpoints/``), which must hold a complete checkpoint (CheckpointError naming it if not)."""
    if resume == "latest":
        if cfg.checkpoint.dir is None and cfg.logging.run_name is None:
            raise ConfigError("--resume: this run's checkpoint folder is not fixed (its run name is a timestamp): "
                              "set ds_async.checkpoint.dir or ds_async.logging.run_name (--run-name), or pass "
                              "--resume PATH")
        return checkpoint.resolve(ckpt_root)
    path = Path(resume)
    if not path.exists():
        raise checkpoint.CheckpointError(f"--resume {resume}: no such checkpoint or folder")
    found = checkpoint.resolve(path)
    if found is None and (path / "checkpoints").is_dir():  # a run folder
        found = checkpoint.resolve(path / "checkpoints")
    if found is None:
        raise checkpoint.CheckpointError(
            f"--resume {resume}: no complete checkpoint there (a checkpoint folder step_N with {checkpoint.MANIFEST}, "
            "a folder of them, or a run folder with them in checkpoints/); nothing to resume from")
    return found


def config_keys(section: dict, ds_config: dict) -> dict:
    """A job's config as the flat keys :mod:`ds_async.resume` compares: ``ds_async.<key>`` and
    ``deepspeed.<key>``."""
    return {**flatten(section, "ds_async"), **flatten(ds_config, "deepspeed")}


def check_optimizer_type(manifest: dict, ds_config: dict, folder) -> None:
    """A resumed run must step with the optimizer type its checkpoint was saved with: another type's state would load
    without a word and drop what it cannot use (AdamW's moments as SGD's absent momentum). Compared without case;
    a manifest that records no optimizer is not checked."""
    saved = (manifest.get("optimizer") or {}).get("type")
    now = optimizer_type(ds_config)
    if "optimizer" in manifest and str(saved).lower() != str(now).lower():
        raise ConfigError(f"optimizer.type: {now!r}, but the checkpoint {folder} was saved with {saved!r}, whose "
                          "state does not carry over to another optimizer; resume with the same type, or start a "
                          "new run from its weights (ds_async.model.path after python -m ds_async.export)")


def stream_recipe(section: dict) -> dict:
    """What decides the training stream's documents and their order, from a resolved ``ds_async`` section: a saved
    position in the stream refers to these."""
    stream = section.get("data") or {}
    validation = stream.get("validation")
    return {**{f"data.{k}": stream.get(k) for k in ("train", "text_field", "seq_len", "shuffle_buffer", "min_chars")},
            "data.validation.from_train": validation.get("from_train") if isinstance(validation, dict) else None,
            "seed": section.get("seed")}
