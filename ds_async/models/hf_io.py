"""Read one stage's tensors from a Hugging Face ``save_pretrained`` directory and write them back.

Only the safetensors format is read, and only the tensors a stage owns: a sharded checkpoint's index tells which
file holds each tensor, and ``safe_open`` reads single tensors without loading whole files.
"""
from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _weight_map(hf_dir: str | os.PathLike) -> dict[str, str]:
    """HF tensor name -> file (relative to ``hf_dir``) for a single-file or sharded checkpoint."""
    root = Path(hf_dir)
    if (root / INDEX).exists():
        return json.loads((root / INDEX).read_text())["weight_map"]
    if (root / SINGLE).exists():
        with safe_open(root / SINGLE, framework="pt") as f:
            return {k: SINGLE for k in f.keys()}
    raise FileNotFoundError(f"{root}: no {SINGLE} or {INDEX} (ds_async reads safetensors checkpoints only)")


def read_tensors(hf_dir: str | os.PathLike, names: list[str]) -> dict[str, torch.Tensor]:
    """Read exactly ``names`` from the checkpoint in ``hf_dir``."""
    weight_map = _weight_map(hf_dir)
    missing = [n for n in names if n not in weight_map]
    if missing:
        raise KeyError(f"{hf_dir}: checkpoint has no tensor(s) {missing[:5]}")
    by_file = defaultdict(list)
    for n in names:
        by_file[weight_map[n]].append(n)
    out = {}
    for file, file_names in by_file.items():
        with safe_open(Path(hf_dir) / file, framework="pt") as f:
            for n in file_names:
                out[n] = f.get_tensor(n)
    return out


def checkpoint_names(hf_dir: str | os.PathLike) -> set[str]:
    """Names of all tensors in the checkpoint in ``hf_dir``."""
    return set(_weight_map(hf_dir))


def assign(module: torch.nn.Module, local: dict[str, torch.Tensor]) -> None:
    """Load a complete state dict into ``module`` (possibly built on the meta device), in its own dtypes."""
    dtypes = {k: t.dtype for k, t in module.state_dict().items()}
    module.load_state_dict({k: t.to(dtypes[k]) for k, t in local.items()}, strict=True, assign=True)


def load_into(module: torch.nn.Module, hf_dir: str, names: dict[str, str]) -> None:
    """Fill ``module`` (possibly built on the meta device) from ``hf_dir``; ``names`` maps local -> HF keys."""
    tensors = read_tensors(hf_dir, list(names.values()))
    assign(module, {k: tensors[v] for k, v in names.items()})


def shard_name(stage: int, stages: int) -> str:
    return f"model-stage{stage + 1:02d}-of-{stages:02d}.safetensors"


def save_shard(tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike, name: str) -> None:
    """Write one stage's HF-named tensors as one safetensors file."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(Path(out_dir) / name),
              metadata={"format": "pt"})


def write_index(out_dir: str | os.PathLike, stages: int, config) -> None:
    """Index the ``stages`` shards in ``out_dir`` and write ``config.json`` so ``from_pretrained`` loads it."""
    root = Path(out_dir)
    weight_map, total_size = {}, 0
    for stage in range(stages):
        file = shard_name(stage, stages)
        total_size += (root / file).stat().st_size
        with safe_open(root / file, framework="pt") as f:
            weight_map.update({k: file for k in f.keys()})
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX).write_text(json.dumps(index, indent=2))
    config.save_pretrained(root)
