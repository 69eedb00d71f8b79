"""Engine state <-> checkpoint files: what a pipeline job saves and how it is restored exactly.

A checkpoint folder (:mod:`ds_async.checkpoint.folder`) of a pipeline job holds:

- ``model-stageSS-of-PP.safetensors`` + ``model.safetensors.index.json`` + ``config.json`` (+ the tokenizer's
  files): the newest weights ``W(t)`` as Hugging Face names them, one shard per pipeline stage (written by the
  stage's first data-parallel replica). The folder is itself a ``save_pretrained`` directory;
  ``python -m ds_async.export`` copies these files out.
- ``versions-stageSS.pt``: under a flush-free schedule, the older weight versions the stage still holds (2BW: the
  one slot with ``W(t-1)``; the newest is the master's copy and is not stored twice).
- ``state-stageSS-dpDDD.pt``, one per rank: the engine's counters, optimizer state (each ZeRO-1 shard its own;
  delay-correction buffers live in it), LR scheduler, RNG states (python, numpy, torch, CUDA) and the position of
  the training data stream on the ranks that read data.
- ``checkpoint.json``: the manifest (step, pipeline layout, model family, tokenizer fingerprint, files).

The pipeline is drained before a save (the trainer plans it with ``engine.drain_after``): no micro-batch is in
flight, the master parameters are back in the modules, and everything a flush-free schedule carries across the
drain is the held weight versions, which are saved. Loading restores exactly that (the optimizer's
hyperparameters and LR excepted, which come from the resuming run's config), so training resumed from a
checkpoint makes the same updates, bit for bit, as training that never stopped (tested with SIGKILL). Loading
requires the same pipeline layout (``engine.layout()``) the checkpoint was written with.
"""
from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import numpy as np
import torch

from ..nonfinite import SkipNonFinite
from .folder import (FORMAT, BackgroundWriter, CheckpointError, fsync, load_file, raise_if_any, read_manifest,
                     save_torch, step_dir, verifying, world_rank_size, write)


# ------------------------------------------------------------------------------------- RNG and data states
def rng_state() -> dict:
    np_state = np.random.get_state(legacy=False)
    state = {"python": _to_safe(random.getstate()), "torch": torch.get_rng_state(),
             "numpy": {"bit_generator": np_state["bit_generator"],
                       "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
                       "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                       "gauss": float(np_state["gauss"])}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state({"bit_generator": n["bit_generator"], "has_gauss": n["has_gauss"], "gauss": n["gauss"],
                         "state": {"key": n["key"].numpy().astype(np.uint32), "pos": n["pos"]}})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _to_safe(python_state):
    version, internal, gauss = python_state
    return [version, list(internal), gauss]


def data_state_to_file(state: dict | None) -> dict | None:
    """A ``PackedBatches.state_dict()`` with its token buffer as a tensor (compact, ``weights_only``-loadable) and
    only the untokenized rest of a long document it is reading."""
    if state is None:
        return None
    out = {**state, "buffer": torch.tensor(state["buffer"], dtype=torch.long)}
    if state.get("long"):
        out["long"], out["long_at"] = state["long"][state["long_at"]:], 0
    return out


def data_state_from_file(state: dict | None) -> dict | None:
    if state is None:
        return None
    return {**state, "buffer": state["buffer"].tolist()}


# ------------------------------------------------------------------------------------------- optimizer state
def _unwrap(optimizer):
    """The optimizer DeepSpeed steps, under ds_async's non-finite guard if there is one."""
    return optimizer.optimizer if isinstance(optimizer, SkipNonFinite) else optimizer


def optimizer_state(optimizer) -> dict:
    """What restores ``optimizer`` exactly: a torch optimizer's ``state_dict`` (ds_async's optimizers, their
    tensor-granular ZeRO-1 shard and correction buffers included), or for DeepSpeed's ZeRO-1/2 and bf16 wrappers
    their base optimizer's ``state_dict`` plus this rank's fp32 master partitions."""
    opt = _unwrap(optimizer)
    if isinstance(opt, torch.optim.Optimizer):
        return {"kind": "torch", "state": opt.state_dict()}
    for kind, attr in (("zero", "single_partition_of_fp32_groups"), ("bf16", "fp32_groups_flat_partition")):
        if hasattr(opt, attr) and isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
            return {"kind": kind, "state": opt.optimizer.state_dict(),
                    "fp32": [t.detach().cpu().clone() for t in getattr(opt, attr)]}
    raise CheckpointError(f"checkpointing does not know how to save optimizer {type(opt).__name__}")


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict]:
    return [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]


def _load_keeping_hyperparameters(opt: torch.optim.Optimizer, state: dict) -> None:
    """``opt.load_state_dict(state)`` with the param groups' hyperparameters (lr, betas, weight decay, ...) kept as
    this run's config set them: torch would take the saved ones, so a changed value would be ignored without a word
    (:mod:`ds_async.resume` applies them). Unchanged values are the same numbers either way."""
    fresh = _hyperparameters(opt)
    opt.load_state_dict(state)
    for group, values in zip(opt.param_groups, fresh, strict=True):
        group.update(values)


def load_optimizer_state(optimizer, saved: dict, file: Path) -> None:
    opt = _unwrap(optimizer)
    kind = saved["kind"]
    if kind == "torch" and isinstance(opt, torch.optim.Optimizer):
        _load_keeping_hyperparameters(opt, saved["state"])
        return
    attr = {"zero": "single_partition_of_fp32_groups", "bf16": "fp32_groups_flat_partition"}.get(kind)
    if attr is None or not hasattr(opt, attr):
        raise CheckpointError(f"{file}: optimizer state of kind {kind!r} does not fit this run's "
                              f"{type(opt).__name__} (was the precision or ZeRO stage changed?)")
    _load_keeping_hyperparameters(opt.optimizer, saved["state"])
    with torch.no_grad():
        for have, want in zip(getattr(opt, attr), saved["fp32"], strict=True):
            if have.shape != want.shape:
                raise CheckpointError(f"{file}: fp32 partition of shape {tuple(want.shape)} where this run has "
                                      f"{tuple(have.shape)}")
            have.copy_(want)
    if hasattr(opt, "_link_all_hp_params"):
        opt._link_all_hp_params()


def _saved_lr(saved: dict) -> float | None:
    """The first param group's LR in a saved optimizer state (the LR its last step left for the next)."""
    groups = saved.get("state", {}).get("param_groups") or [{}]
    lr = groups[0].get("lr")
    return float(lr) if lr is not None else None


def _apply_schedule(scheduler) -> None:
    """Set the optimizer's LR to what ``scheduler`` (a DeepSpeed schedule, just restored to its step) gives there:
    built from this run's config, so a changed peak, warm-up, minimum or length applies from the first resumed step
    (the optimizer's saved LR is the old schedule's)."""
    step = getattr(scheduler, "last_batch_iteration", None)
    if step is None or step < 0 or not hasattr(scheduler, "get_lr"):
        return
    for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_lr(), strict=True):
        group["lr"] = lr


# ----------------------------------------------------------------------------------------- engine <-> files
def _state_name(stage: int, dp: int) -> str:
    return f"state-stage{stage:02d}-dp{dp:03d}.pt"


def _versions_name(stage: int) -> str:
    return f"versions-stage{stage:02d}.pt"


def _load_stage_weights(engine, folder: Path, file_name: str) -> None:
    """Copy this stage's tensors from its safetensors shard into the live parameters (in place: the optimizer
    and DeepSpeed's flat buffers keep referring to them). ``hf_state_dict`` returns views of the parameters, so
    writing through it writes them; checked afterwards."""
    from safetensors import safe_open

    from ..models import hf_state_dict  # imports DeepSpeed: only when weights are read

    file = folder / file_name
    views = hf_state_dict(engine.module)
    try:
        with safe_open(file, framework="pt") as f:
            missing = sorted(set(views) - set(f.keys()))
            if missing:
                raise CheckpointError(f"{file}: lacks this stage's tensors {missing[:3]} (a different model or "
                                      "partition?)")
            with torch.no_grad():
                for name, view in views.items():
                    src = f.get_tensor(name)
                    if src.shape != view.shape:
                        raise CheckpointError(f"{file}: {name} has shape {tuple(src.shape)}, the model "
                                              f"{tuple(view.shape)}")
                    view.copy_(src)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors' errors for bad files
        raise CheckpointError(f"{file}: cannot be read ({type(e).__name__}: {e})") from None
    for name, view in hf_state_dict(engine.module).items():
        if not torch.equal(view, views[name]):
            raise CheckpointError(f"{file}: {name} did not load in place")


def save(engine, root: str | os.PathLike, *, hf_config, data_state: dict | None = None, tokenizer=None,
         meta: dict | None = None, extra: dict | None = None, keep: int = 0, group=None,
         writer: BackgroundWriter | None = None) -> Path:
    """Save the (drained) ``engine`` as checkpoint ``engine.global_steps`` under ``root``; collective. Returns its
    folder.

    ``data_state``: this rank's training stream position (``PackedBatches.state_dict()``) or None;
    ``tokenizer``: saved into the folder by rank 0 as :func:`ds_async.tokenizer.for_generation` sets it up, its
    BOS/EOS ids written into ``config.json`` (:func:`~ds_async.models.hf_io.write_model_files`); ``meta``: more
    manifest entries;
    ``extra``: per-rank trainer state returned by :func:`load`.
    ``writer``: write in the background (``group`` is then unused: the writer has its own). What the files hold is
    copied to host memory first, so training may change the engine as soon as this returns; ``writer.wait()``
    returns the folder once it is complete, or raises the write's error.
    """
    from .. import models  # imports DeepSpeed: only when a checkpoint is written
    from ..models import hf_io

    try:
        engine_state = engine.state_dict()
    except RuntimeError as e:  # not drained
        raise CheckpointError(str(e)) from None
    step, stage, dp = engine.global_steps, engine.stage_id, engine.grid.data_parallel_id
    stages = engine.num_stages
    state = {"format": FORMAT, "step": step, "stage": stage, "dp_rank": dp, "engine": engine_state["counters"],
             "optimizer": optimizer_state(engine.optimizer),
             "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
             "rng": rng_state(), "data": data_state_to_file(data_state), "extra": extra or {}}
    weights = models.hf_state_dict(engine.module) if dp == 0 else None  # the first replica writes the stage's
    versions = engine_state["versions"] if dp == 0 else None
    need = tensor_bytes([state, weights, versions])
    if writer is not None:
        state, weights, versions = host_copy((state, weights, versions))

    def write_files(tmp: Path) -> list[str]:
        names = [_state_name(stage, dp)]
        save_torch(state, tmp / names[0])
        if weights is not None:
            shard = hf_io.shard_name(stage, stages)
            hf_io.save_shard(weights, tmp, shard)
            fsync(tmp / shard)
            names.append(shard)
        if versions is not None:
            save_torch(versions, tmp / _versions_name(stage))
            names.append(_versions_name(stage))
        return names

    def write_index(tmp: Path) -> list[str]:
        # config.json with the tokenizer's BOS/EOS, generation_config.json, the tokenizer ready for generate
        names = hf_io.write_index(tmp, stages, hf_config, tokenizer)
        for n in names:
            fsync(tmp / n)
        return sorted(set(names))

    manifest = {**engine.layout(), "family": hf_config.model_type, **(meta or {})}

    def write_with(group) -> Path:
        return write(root, step, write_files, manifest, keep=keep, group=group, write_index=write_index, need=need)

    if writer is None:
        return write_with(group)
    writer.submit(write_with)
    return step_dir(root, step)


def host_copy(obj):
    """A deep copy of ``obj`` (nested dicts, lists and tuples) with every tensor copied to host memory: what a
    background write reads while training changes the originals."""
    if torch.is_tensor(obj):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return copy.deepcopy(obj)


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in ``obj`` (nested dicts, lists and tuples): what saving it writes, about."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def data_position(folder: str | os.PathLike, stage: int, dp: int) -> dict | None:
    """The training stream's position that the rank at ``stage`` and data-parallel rank ``dp`` saved in checkpoint
    ``folder``, read before anything is built (the state file's tensors are mapped, not read): a resumed run hands it
    to its reader process while the model builds. Not verified here: :func:`load` verifies the file and returns the
    same position, which the caller compares."""
    state = torch.load(Path(folder) / _state_name(stage, dp), map_location="cpu", weights_only=True, mmap=True)
    return data_state_from_file(state["data"])


def load(engine, folder: str | os.PathLike, group=None, check: dict | None = None) -> dict:
    """Restore ``engine`` (freshly built, same layout) from checkpoint ``folder``; collective.

    Returns ``{"manifest", "data", "extra", "lr"}``: the manifest, this rank's data stream state (for
    ``PackedBatches.load_state_dict``), the trainer's per-rank extra state, and the LR the checkpoint's last step
    left with the one the next step takes (they differ when the config changed the schedule or the peak LR). The
    optimizer's hyperparameters are this run's config's, and a DeepSpeed LR schedule sets its LR at the restored
    step (see :mod:`ds_async.resume`). RNG states are restored last.
    ``check``: manifest entries that must equal these values (e.g. the tokenizer's fingerprint).
    """
    from ..models import hf_io  # imports DeepSpeed: only when a checkpoint is read

    folder = Path(folder)
    stage, dp = engine.stage_id, engine.grid.data_parallel_id
    error, out = None, None
    try:
        manifest = read_manifest(folder)
        want = engine.layout()
        for key, value in {**want, **(check or {})}.items():
            if manifest.get(key) != value:
                raise CheckpointError(f"{folder}: saved with {key} = {manifest.get(key)!r}, this run has {value!r}; "
                                      "resuming needs the same pipeline layout and schedule")
        state_file = _state_name(stage, dp)
        shard = hf_io.shard_name(stage, engine.num_stages)
        versions_file = _versions_name(stage) if engine.versions is not None else None
        with verifying(folder, [state_file, shard] + ([versions_file] if versions_file else []), manifest):
            state = load_file(folder / state_file)
            versions = None if versions_file is None else load_file(folder / versions_file)
        if state.get("step") != manifest["step"] or state.get("stage") != stage or state.get("dp_rank") != dp:
            raise CheckpointError(f"{folder / state_file}: belongs to another step or rank")
        _load_stage_weights(engine, folder, shard)
        try:
            engine.load_state_dict({"counters": state["engine"], "versions": versions})
        except (KeyError, ValueError) as e:
            raise CheckpointError(f"{folder / (versions_file or state_file)}: does not fit this run's schedule "
                                  f"({type(e).__name__}: {e})") from None
        saved_lr = _saved_lr(state["optimizer"])
        load_optimizer_state(engine.optimizer, state["optimizer"], folder / state_file)
        if engine.lr_scheduler is not None:
            if state["lr_scheduler"] is None:
                raise CheckpointError(f"{folder / state_file}: saved without an LR scheduler, this run has one")
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
            _apply_schedule(engine.lr_scheduler)
        out = {"manifest": manifest, "data": data_state_from_file(state["data"]), "extra": state["extra"],
               "rng": state["rng"], "lr": (saved_lr, engine.get_lr()[0] if hasattr(engine, "get_lr") else None)}
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        error = f"{folder}: rank {world_rank_size(group)[0]} could not restore it ({type(e).__name__}: {e})"
    raise_if_any(error, group)
    set_rng_state(out.pop("rng"))
    return out
