"""Checkpoints of a pipeline job: atomic, verified, resumable exactly, and loadable by ``from_pretrained``.

A checkpoint is one folder ``<dir>/step_00000123`` (after 123 optimizer steps) holding:

- ``model-stageSS-of-PP.safetensors`` + ``model.safetensors.index.json`` + ``config.json`` (+ the tokenizer's
  files): the newest weights ``W(t)`` as Hugging Face names them, one shard per pipeline stage (written by the
  stage's first data-parallel replica). The folder is itself a ``save_pretrained`` directory;
  ``python -m ds_async.export`` copies these files out.
- ``versions-stageSS.pt``: under ``2bw``/``pipedream``, the older weight versions the stage still holds (2BW: the
  one slot with ``W(t-1)``; the slot holding ``W(t)`` is the master's copy and is not stored twice).
- ``state-stageSS-dpDDD.pt``, one per rank: optimizer state (each ZeRO-1 shard its own; delay-correction buffers
  live in it), LR scheduler, engine counters, RNG states (python, numpy, torch, CUDA) and the position of the
  training data stream on the ranks that read data.
- ``checkpoint.json``, written last: the manifest (step, world layout, model config, tokenizer fingerprint, and
  every file with its size and sha256). Its presence in a folder without the ``.tmp`` suffix is what makes a
  checkpoint complete.

Writing: every rank writes into ``step_N.tmp/``; rank 0 gathers the files' sizes and hashes, writes the manifest,
and renames the folder to ``step_N/`` (``os.replace``, atomic on a POSIX filesystem), then prunes all but the
newest ``keep``. A save killed at any point leaves at most a ``.tmp`` folder that nothing reads (the next save
removes it), so the previous checkpoint stays the newest complete one.

The pipeline is drained before a save (the trainer plans it with ``engine.drain_after``): no micro-batch is in
flight, the master parameters are back in the modules, and everything a flush-free schedule carries across the
drain is the held weight versions, which are saved. Loading restores exactly that, so training resumed from a
checkpoint makes the same updates, bit for bit, as training that never stopped (tested with SIGKILL).

Reading: each rank checks the sizes and sha256 of the files it reads against the manifest and loads ``.pt`` files
with ``torch.load(weights_only=True)``; a missing, truncated or corrupt file is refused with its path, on every
rank. Loading requires the same pipeline layout (stages, layer partition, data-parallel degree, micro-batches,
schedule) the checkpoint was written with.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist

FORMAT = 1
MANIFEST = "checkpoint.json"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the message names the path."""


# ------------------------------------------------------------------------------------------------ collectives
def _world(group) -> tuple[int, int]:
    if not tdist.is_available() or not tdist.is_initialized():
        return 0, 1
    return tdist.get_rank(), tdist.get_world_size()


def _gather(obj, group) -> list:
    """Every rank's ``obj``, in global rank order (single process: ``[obj]``)."""
    rank, world = _world(group)
    if world == 1:
        return [obj]
    out = [None] * world
    tdist.all_gather_object(out, obj, group=group)
    return out


def _raise_if_any(error: str | None, group) -> None:
    """Raise the first rank's error on every rank, so that no rank waits in a collective for a failed one."""
    errors = [e for e in _gather(error, group) if e]
    if errors:
        raise CheckpointError(errors[0])


# ------------------------------------------------------------------------------------------------ the folder
def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of the complete checkpoints under ``root``, oldest first (``.tmp`` folders and folders
    without a manifest are partial and left out)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir() and (child / MANIFEST).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def resolve(spec: str | os.PathLike) -> Path | None:
    """A checkpoint folder from ``spec``: a checkpoint folder itself, or a folder of them (its newest complete
    one; None if it has none)."""
    path = Path(spec)
    if (path / MANIFEST).is_file():
        return path
    if path.name.endswith(".tmp") and _STEP_DIR.match(path.name[:-4]):
        raise CheckpointError(f"{path}: an incomplete checkpoint (its save was interrupted); use a complete one")
    if _STEP_DIR.match(path.name) and path.is_dir():
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})")
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path}: not a checkpoint folder")
    return latest(path)


def read_manifest(path: str | os.PathLike) -> dict:
    """The manifest of the checkpoint folder ``path``; CheckpointError naming the file if it is not readable."""
    file = Path(path) / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete checkpoint (no {MANIFEST})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: unreadable checkpoint manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(
            manifest.get("files"), dict):
        raise CheckpointError(f"{file}: not a ds_async checkpoint manifest of format {FORMAT}")
    return manifest


def sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(path: str | os.PathLike, names, manifest: dict | None = None) -> None:
    """Check files of checkpoint ``path`` against its manifest (size, then sha256); CheckpointError naming the
    first bad file."""
    path = Path(path)
    manifest = manifest or read_manifest(path)
    for name in names:
        file = path / name
        want = manifest["files"].get(name)
        if want is None:
            raise CheckpointError(f"{file}: not listed in the checkpoint's manifest")
        try:
            size = file.stat().st_size
        except OSError as e:
            raise CheckpointError(f"{file}: missing from the checkpoint ({e.strerror})") from None
        if size != want["size"]:
            raise CheckpointError(f"{file}: {size} bytes, the manifest says {want['size']} (truncated or "
                                  "overwritten); refusing this checkpoint")
        if sha256(file) != want["sha256"]:
            raise CheckpointError(f"{file}: contents do not match the manifest's sha256 (corrupt); refusing this "
                                  "checkpoint")


def load_file(file: str | os.PathLike, map_location="cpu"):
    """``torch.load(file, weights_only=True)``; any failure becomes a CheckpointError naming the file."""
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a bad file
        raise CheckpointError(f"{file}: cannot be loaded ({type(e).__name__}: {e})") from None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_torch(obj, file: Path) -> None:
    torch.save(obj, file)
    _fsync(file)


def _describe(folder: Path, names) -> dict:
    return {n: {"size": (folder / n).stat().st_size, "sha256": sha256(folder / n)} for n in names}


def write(root: str | os.PathLike, step: int, write_files, manifest: dict, keep: int = 0, group=None,
          write_index=None) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically, collectively over all ranks.

    ``write_files(tmp_dir) -> list[str]`` writes this rank's files into the temporary folder and returns their
    names; ``write_index(tmp_dir) -> list[str]`` runs on rank 0 once every rank's files exist (to index them).
    Rank 0 then writes the manifest (``manifest`` plus step and file list), renames the folder into place and
    prunes to the newest ``keep`` (0: keep all). Returns the final folder.
    """
    root = Path(root)
    rank, world = _world(group)
    final = step_dir(root, step)
    tmp = final.with_name(final.name + ".tmp")
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save of the same step that was killed earlier
            tmp.mkdir()
        except OSError as e:
            error = f"{tmp}: cannot create the checkpoint folder ({e})"
    _raise_if_any(error, group)

    def run(fn):
        try:
            names = fn(tmp)
            return _describe(tmp, names), None
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            return {}, f"{tmp}: rank {rank} failed to write its files ({type(e).__name__}: {e})"

    files, error = run(write_files)
    gathered = _gather((files, error), group)
    errors = [e for _, e in gathered if e]
    if rank == 0 and not errors:
        all_files = {k: v for f, _ in gathered for k, v in f.items()}
        if write_index is not None:
            more, error = run(write_index)
            all_files.update(more)
            errors += [error] if error else []
        if not errors:
            try:
                _finish(root, tmp, final, step, {**manifest, "files": dict(sorted(all_files.items()))}, keep)
            except OSError as e:
                errors.append(f"{final}: cannot complete the checkpoint ({e})")
    _raise_if_any(errors[0] if errors else None, group)
    return final


def _finish(root: Path, tmp: Path, final: Path, step: int, manifest: dict, keep: int) -> None:
    body = json.dumps({"format": FORMAT, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **manifest},
                      indent=1, default=str)
    part = tmp / (MANIFEST + ".part")
    part.write_text(body)
    _fsync(part)
    os.replace(part, tmp / MANIFEST)
    _fsync(tmp)
    # Checkpoints newer than this one belong to a run that was abandoned (this one resumed from an older
    # checkpoint): move them aside, so that a later --resume continues this run and not that one.
    for other_step, other in complete_checkpoints(root):
        if other_step >= step:
            other.rename(other.with_name(f"{other.name}.superseded-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.replace(tmp, final)
    _fsync(root)
    _prune(root, keep)


def _prune(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted saves and prunes."""
    for child in root.iterdir():
        name = child.name
        if child.is_dir() and (name.endswith(".tmp") or name.endswith(".deleting")) and name.startswith("step_"):
            shutil.rmtree(child, ignore_errors=True)
    if keep <= 0:
        return
    for _, folder in complete_checkpoints(root)[:-keep]:
        # Renamed first, so that a prune killed half-way never leaves a half-deleted folder that looks complete.
        doomed = folder.with_name(folder.name + ".deleting")
        folder.rename(doomed)
        shutil.rmtree(doomed, ignore_errors=True)


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
    """A ``PackedBatches.state_dict()`` with its token buffer as a tensor (compact, ``weights_only``-loadable)."""
    if state is None:
        return None
    return {**state, "buffer": torch.tensor(state["buffer"], dtype=torch.long)}


def data_state_from_file(state: dict | None) -> dict | None:
    if state is None:
        return None
    return {**state, "buffer": state["buffer"].tolist()}


# ------------------------------------------------------------------------------------------- optimizer state
def _unwrap(optimizer):
    """The optimizer DeepSpeed steps, under ds_async's non-finite guard if there is one."""
    from .nonfinite import SkipNonFinite

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


def load_optimizer_state(optimizer, saved: dict, file: Path) -> None:
    opt = _unwrap(optimizer)
    kind = saved["kind"]
    if kind == "torch" and isinstance(opt, torch.optim.Optimizer):
        opt.load_state_dict(saved["state"])
        return
    attr = {"zero": "single_partition_of_fp32_groups", "bf16": "fp32_groups_flat_partition"}.get(kind)
    if attr is None or not hasattr(opt, attr):
        raise CheckpointError(f"{file}: optimizer state of kind {kind!r} does not fit this run's "
                              f"{type(opt).__name__} (was the precision or ZeRO stage changed?)")
    opt.optimizer.load_state_dict(saved["state"])
    with torch.no_grad():
        for have, want in zip(getattr(opt, attr), saved["fp32"], strict=True):
            if have.shape != want.shape:
                raise CheckpointError(f"{file}: fp32 partition of shape {tuple(want.shape)} where this run has "
                                      f"{tuple(have.shape)}")
            have.copy_(want)
    if hasattr(opt, "_link_all_hp_params"):
        opt._link_all_hp_params()


# ----------------------------------------------------------------------------------------- engine <-> files
def _state_name(stage: int, dp: int) -> str:
    return f"state-stage{stage:02d}-dp{dp:03d}.pt"


def _versions_name(stage: int) -> str:
    return f"versions-stage{stage:02d}.pt"


def layout(engine) -> dict:
    """What must match between the saving and the loading job."""
    return {"schedule": engine.schedule_name, "pipeline_stages": engine.num_stages,
            "data_parallel": engine.grid.data_parallel_size, "micro_batches": engine.micro_batches,
            "micro_batch_size": engine.train_micro_batch_size_per_gpu(), "parts": list(engine.module.parts)}


def _param_names(module) -> dict:
    return {id(p): n for n, p in module.named_parameters()}


def versions_state(engine) -> dict | None:
    """The weight versions a drained flush-free engine still holds (None under 1f1b)."""
    versions = getattr(engine, "versions", None)
    if versions is None:
        return None
    if versions.in_flight:
        raise CheckpointError("cannot save with micro-batches in flight: drain the pipeline first "
                              "(engine.drain_after / train_batch(flush=True))")
    names = _param_names(engine.module)
    slots = []
    for slot, version in zip(versions.slots, versions.version_of_slot):
        if version is None or version == engine.global_steps:
            slots.append(None)  # empty, or a copy of the master (published right after the last step)
        else:
            slots.append({names[id(master)]: t.detach().cpu().clone()
                          for t, (_, _, master) in zip(slot, versions.entries)})
    return {"version_of_slot": list(versions.version_of_slot), "slots": slots}


def load_versions_state(engine, saved: dict | None, file: Path) -> None:
    versions = getattr(engine, "versions", None)
    if versions is None:
        return
    if saved is None or len(saved["slots"]) != len(versions.slots):
        raise CheckpointError(f"{file}: weight versions do not fit this run's schedule")
    names = _param_names(engine.module)
    with torch.no_grad():
        for slot, tensors in zip(versions.slots, saved["slots"]):
            for t, (_, _, master) in zip(slot, versions.entries):
                t.copy_(master if tensors is None else tensors[names[id(master)]])
    versions.version_of_slot = list(saved["version_of_slot"])
    versions.in_flight.clear()


def _load_stage_weights(engine, folder: Path, file_name: str) -> None:
    """Copy this stage's tensors from its safetensors shard into the live parameters (in place: the optimizer
    and DeepSpeed's flat buffers keep referring to them). ``hf_state_dict`` returns views of the parameters, so
    writing through it writes them; checked afterwards."""
    from safetensors import safe_open

    from .models import hf_state_dict

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
         meta: dict | None = None, extra: dict | None = None, keep: int = 0, group=None) -> Path:
    """Save the (drained) ``engine`` as checkpoint ``engine.global_steps`` under ``root``; collective.

    ``data_state``: this rank's training stream position (``PackedBatches.state_dict()``) or None;
    ``tokenizer``: saved into the folder by rank 0 (``save_pretrained``); ``meta``: more manifest entries;
    ``extra``: per-rank trainer state returned by :func:`load`.
    """
    from . import models
    from .models import hf_io

    if getattr(engine, "_segment", None) is not None:
        raise CheckpointError("cannot save in the middle of a flush-free segment: drain the pipeline first "
                              "(engine.drain_after / train_batch(flush=True))")
    step, stage, dp = engine.global_steps, engine.stage_id, engine.grid.data_parallel_id
    stages = engine.num_stages

    def write_files(tmp: Path) -> list[str]:
        names = [_state_name(stage, dp)]
        state = {"format": FORMAT, "step": step, "stage": stage, "dp_rank": dp,
                 "engine": {k: int(getattr(engine, k, 0)) for k in ("global_steps", "global_samples",
                                                                     "skipped_steps", "micro_steps")},
                 "optimizer": optimizer_state(engine.optimizer),
                 "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
                 "rng": rng_state(), "data": data_state_to_file(data_state), "extra": extra or {}}
        _save_torch(state, tmp / names[0])
        if dp == 0:
            shard = hf_io.shard_name(stage, stages)
            hf_io.save_shard(models.hf_state_dict(engine.module), tmp, shard)
            _fsync(tmp / shard)
            names.append(shard)
            versions = versions_state(engine)
            if versions is not None:
                _save_torch(versions, tmp / _versions_name(stage))
                names.append(_versions_name(stage))
        return names

    def write_index(tmp: Path) -> list[str]:
        hf_io.write_index(tmp, stages, hf_config)
        names = [hf_io.INDEX, "config.json"]
        if tokenizer is not None:
            names += [Path(f).name for f in tokenizer.save_pretrained(str(tmp))
                      if Path(f).parent == tmp and Path(f).is_file()]
        for n in names:
            _fsync(tmp / n)
        return sorted(set(names))

    manifest = {**layout(engine), "family": hf_config.model_type, **(meta or {})}
    return write(root, step, write_files, manifest, keep=keep, group=group, write_index=write_index)


def load(engine, folder: str | os.PathLike, group=None, check: dict | None = None) -> dict:
    """Restore ``engine`` (freshly built, same layout) from checkpoint ``folder``; collective.

    Returns ``{"manifest", "data", "extra"}``: the manifest, this rank's data stream state (for
    ``PackedBatches.load_state_dict``) and the trainer's per-rank extra state. RNG states are restored last.
    ``check``: manifest entries that must equal these values (e.g. the tokenizer's fingerprint).
    """
    from .models import hf_io

    folder = Path(folder)
    stage, dp = engine.stage_id, engine.grid.data_parallel_id
    error, out = None, None
    try:
        manifest = read_manifest(folder)
        want = layout(engine)
        for key, value in {**want, **(check or {})}.items():
            if manifest.get(key) != value:
                raise CheckpointError(f"{folder}: saved with {key} = {manifest.get(key)!r}, this run has {value!r}; "
                                      "resuming needs the same pipeline layout and schedule")
        state_file = _state_name(stage, dp)
        shard = hf_io.shard_name(stage, engine.num_stages)
        versions_file = _versions_name(stage) if getattr(engine, "versions", None) is not None else None
        verify(folder, [state_file, shard] + ([versions_file] if versions_file else []), manifest)
        state = load_file(folder / state_file)
        if state.get("step") != manifest["step"] or state.get("stage") != stage or state.get("dp_rank") != dp:
            raise CheckpointError(f"{folder / state_file}: belongs to another step or rank")
        _load_stage_weights(engine, folder, shard)
        if versions_file is not None:
            load_versions_state(engine, load_file(folder / versions_file), folder / versions_file)
        load_optimizer_state(engine.optimizer, state["optimizer"], folder / state_file)
        if engine.lr_scheduler is not None:
            if state["lr_scheduler"] is None:
                raise CheckpointError(f"{folder / state_file}: saved without an LR scheduler, this run has one")
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for k, v in state["engine"].items():
            setattr(engine, k, v)
        if hasattr(engine, "_next_forward"):
            engine._next_forward = engine.global_steps * engine.micro_batches
        out = {"manifest": manifest, "data": data_state_from_file(state["data"]), "extra": state["extra"],
               "rng": state["rng"]}
    except CheckpointError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - every rank must learn of any rank's failure
        error = f"{folder}: rank {_world(group)[0]} could not restore it ({type(e).__name__}: {e})"
    _raise_if_any(error, group)
    set_rng_state(out.pop("rng"))
    return out
