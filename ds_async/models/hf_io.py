"""Read one stage's tensors from a Hugging Face ``save_pretrained`` directory and write them back.

Only the safetensors format is read, and only the tensors a stage owns: a sharded checkpoint's index tells which
file holds each tensor, and ``safe_open`` reads single tensors without loading whole files.

What is written next to the shards (:func:`write_model_files`) is what Hugging Face users need to run the model as
is: ``config.json`` with the tokenizer's BOS/EOS/pad ids, ``generation_config.json`` (EOS, pad, BOS; no length, so
``generate(max_new_tokens=...)`` runs without a warning) and the tokenizer with that pad token, left padding and a
real ``model_max_length``.
"""
from __future__ import annotations

import copy
import json
import os
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ConfigError

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
        raise ConfigError(f"ds_async.model.path: {hf_dir}: the checkpoint has no tensor(s) {missing[:5]}"
                          + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                          + " (a checkpoint of another model family or layout?)")
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
    state = module.state_dict()
    wrong = [f"{k} {tuple(t.shape)} (config.json: {tuple(state[k].shape)})" for k, t in local.items()
             if k in state and t.shape != state[k].shape]
    if wrong:
        raise ConfigError(f"ds_async.model.path: tensor shapes do not match the model its config describes: "
                          f"{', '.join(wrong[:3])}")
    module.load_state_dict({k: t.to(state[k].dtype) for k, t in local.items()}, strict=True, assign=True)


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


def config_dict(config) -> dict:
    """``config`` as its ``config.json`` holds it (plain JSON: HF's own serialization, which writes the integer keys
    of ``id2label`` as strings and dtypes by name), for manifests."""
    return json.loads(config.to_json_string(use_diff=False))


def match_tokenizer(config, tokenizer):
    """Point ``config``'s ``bos_token_id``/``eos_token_id`` at ``tokenizer``'s (in place; returns ``config``).

    The tokenizer is the truth: the training data ends every document with its EOS, and HF's LLaMA/Mixtral config
    defaults (BOS 1, EOS 2) are ids of other tokens in ds_async's BPE (EOS ``<|endoftext|>`` is id 0, no BOS).
    An EOS list that already holds the tokenizer's EOS (LLaMA 3 style) is kept; a tokenizer without BOS gives
    ``bos_token_id = None``. ``pad_token_id`` is left as it is: LLaMA and Mixtral make it the embedding's
    ``padding_idx``, whose row is zero at init and gets no gradient, so pad = EOS there would freeze EOS's embedding
    in training and in any fine-tuning of the export. The pad id lives in the tokenizer and the generation config.
    """
    eos = tokenizer.eos_token_id
    if eos is not None and not (isinstance(config.eos_token_id, (list, tuple)) and eos in config.eos_token_id):
        config.eos_token_id = eos
    config.bos_token_id = tokenizer.bos_token_id
    return config


def generation_config(config, tokenizer=None):
    """The ``GenerationConfig`` of the model: BOS/EOS from ``config``, pad from ``tokenizer`` (else the config's
    pad, else EOS). No length: ``generate`` callers give ``max_new_tokens``, and a stored ``max_length`` beside it
    makes every such call warn."""
    from transformers import GenerationConfig

    eos = config.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer is not None else None
    if pad is None:
        pad = config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) else eos
    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=pad)


def for_generation(tokenizer, max_length: int | None):
    """A copy of ``tokenizer`` set up as Hugging Face users of a causal LM expect it: a pad token (its EOS if it has
    none, as is usual for causal LMs: padded positions are masked out anyway), padding on the left (batched
    ``generate`` appends to the right end of every row) and ``model_max_length = max_length`` (the model's
    ``max_position_embeddings``; a bare ``tokenizer.json`` loads with ~1e30). The copy is what gets saved; the
    training run's tokenizer is not changed (with a ``model_max_length`` it would warn about long documents)."""
    tok = copy.deepcopy(tokenizer)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.init_kwargs["padding_side"] = "left"  # save_pretrained writes init kwargs, not the attribute
    if max_length:
        tok.model_max_length = int(max_length)
    return tok


def write_model_files(out_dir: str | os.PathLike, config, tokenizer=None) -> list[str]:
    """Write ``config.json``, ``generation_config.json`` and (if given) the tokenizer into ``out_dir``, consistent
    with each other (see the module docstring); returns the names written. ``config`` and ``tokenizer`` are not
    changed: copies are."""
    root = Path(out_dir)
    config = copy.deepcopy(config)
    if tokenizer is not None:
        tokenizer = for_generation(tokenizer, getattr(config, "max_position_embeddings", None))
        match_tokenizer(config, tokenizer)
        # config.json, generation_config.json and the tokenizer name one pad. HF's LLaMA/Mixtral make it the input
        # embedding's padding_idx, whose row then gets no gradient when the export is fine-tuned with HF: with pad =
        # EOS that row keeps its trained value (the output head, untied, still learns EOS). ds_async's own training
        # from the export does not take it as padding (models.model_config).
        config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(root)
    generation_config(config, tokenizer).save_pretrained(root)
    names = ["config.json", "generation_config.json"]
    if tokenizer is not None:
        names += [Path(f).name for f in tokenizer.save_pretrained(str(root))
                  if Path(f).parent == root and Path(f).is_file()]
    return sorted(set(names))


def write_index(out_dir: str | os.PathLike, stages: int, config, tokenizer=None) -> list[str]:
    """Index the ``stages`` shards in ``out_dir`` and write the files of :func:`write_model_files`, so that
    ``from_pretrained`` loads the folder and ``generate`` runs as is; returns the names written."""
    root = Path(out_dir)
    weight_map, total_size = {}, 0
    for stage in range(stages):
        file = shard_name(stage, stages)
        total_size += (root / file).stat().st_size
        with safe_open(root / file, framework="pt") as f:
            weight_map.update({k: file for k in f.keys()})
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (root / INDEX).write_text(json.dumps(index, indent=2))
    return [INDEX] + write_model_files(root, config, tokenizer)
