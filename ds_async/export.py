"""Turn a ds_async checkpoint into a Hugging Face model directory: ``python -m ds_async.export CKPT OUT``.

``CKPT`` is a checkpoint folder (``.../checkpoints/step_00000123``) or a folder of them (its newest complete one is
taken). A checkpoint already stores the newest weights as Hugging Face names them, one safetensors shard per
pipeline stage, with their index; these are checked against the checkpoint's manifest (size and sha256) and copied.
``config.json`` and the tokenizer's files are checked the same way, read, and written out as Hugging Face users need
them (:func:`ds_async.models.hf_io.write_model_files`): the tokenizer has a pad token (its EOS if it has none),
pads on the left and has ``model_max_length`` = the model's ``max_position_embeddings``; BOS/EOS/pad ids in
``config.json`` and ``generation_config.json`` are the tokenizer's, and the generation config holds no length,
whatever the checkpoint's own files say. Nothing is read from ``CKPT`` before it is checked: a
missing, truncated, corrupt or unreadable file is refused with its path. ``OUT`` then loads with
``AutoModelForCausalLM.from_pretrained(OUT)`` and ``AutoTokenizer``, and ``generate`` stops at the end of text and
pads batches. One process, no GPU, no launcher. The optimizer, the older weight version of a 2BW run and the
trainer state are not exported.

Where ``OUT`` may be (the rule, checked before anything is written or removed):

1. ``OUT`` must not be the checkpoint source, lie inside it or contain it, with ``--overwrite`` or not; the source
   is ``CKPT`` as given and the checkpoint folder it resolves to (symbolic links followed). So
   ``runs/R/checkpoints runs/R`` is refused: replacing ``runs/R`` would delete the checkpoints.
2. An ``OUT`` that exists and is not a folder (a file), or is a symbolic link, or whose nearest existing parent is
   a file, is refused.
3. A missing or empty ``OUT`` is written.
4. A non-empty ``OUT`` needs ``--overwrite``, and is replaced only if it looks like a previous export: every entry
   in it is a plain file named as an export names its files (``config.json``, ``generation_config.json``,
   ``model.safetensors.index.json``, ``model-stageSS-of-PP.safetensors`` and the tokenizer's ``tokenizer.json``,
   ``tokenizer_config.json``, ``special_tokens_map.json``, ``added_tokens.json``, ``chat_template.jinja``,
   ``chat_template.json``, ``tokenizer.model``, ``vocab.json``, ``merges.txt``). Any other entry (a checkpoint's
   ``checkpoint.json`` or ``state-*.pt``, a sub-folder, a file of yours) makes it refused, naming that entry;
   nothing is deleted.

The export is written into a hidden folder beside ``OUT`` and renamed into place, so ``OUT`` never holds half an
export, and a previous export is only removed once the new one is complete.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

from .checkpoint import CheckpointError, read_manifest, resolve, verify

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt")
"""The tokenizer files an export carries over (those of them the checkpoint has) and writes."""
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
_SHARD = re.compile(r"^model-stage\d{2,}-of-\d{2,}\.safetensors$")


class ExportError(Exception):
    """``OUT`` cannot be written as asked (see the module docstring's rule); the message names the path."""


def is_export_file(name: str) -> bool:
    """Whether ``name`` is the name of a file an export writes (rule 4 of the module docstring)."""
    return name in MODEL_FILES or name in TOKENIZER_FILES or bool(_SHARD.match(name))


def _within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def check_target(out: str | os.PathLike, sources, overwrite: bool) -> None:
    """Apply the module docstring's rule to ``out``; ``sources``: the checkpoint paths it must stay clear of.
    Raises :class:`ExportError` with one line naming the path."""
    out = Path(out)
    where = out.resolve()
    for source in sources:
        src = Path(source).resolve()
        if where == src:
            raise ExportError(f"{out}: is the checkpoint itself; export to a folder of its own")
        if _within(where, src):
            raise ExportError(f"{out}: lies inside the checkpoint {source}; export to a folder outside it")
        if _within(src, where):
            raise ExportError(f"{out}: holds the checkpoint {source} (replacing it would delete the checkpoint); "
                              "export to a folder of its own")
    if out.is_symlink():
        raise ExportError(f"{out}: is a symbolic link; give the folder itself")
    if not out.exists():
        parent = next((p for p in out.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ExportError(f"{parent}: is a file, not a folder (to write {out} in)")
        return
    if not out.is_dir():
        raise ExportError(f"{out}: is a file, not a folder")
    entries = sorted(out.iterdir())
    if not entries:
        return
    if not overwrite:
        raise ExportError(f"{out}: exists and is not empty (pass --overwrite to replace a previous export)")
    for entry in entries:
        if entry.is_symlink() or not entry.is_file() or not is_export_file(entry.name):
            raise ExportError(f"{out}: does not look like a previous export ({entry.name} is not a file an export "
                              "writes), so --overwrite will not replace it; remove it yourself or export elsewhere")


def _read_model_files(folder: Path, names: list[str]):
    """The HF config and tokenizer (None if the checkpoint has none) of checkpoint ``folder``, read from copies of
    its verified ``names`` only (``AutoTokenizer`` would otherwise read whatever else lies in the folder)."""
    from transformers import AutoConfig, AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="ds_async-export-") as scratch:
        scratch = Path(scratch)
        for name in names:
            shutil.copyfile(folder / name, scratch / name)
            if name.endswith(".json"):
                try:
                    json.loads((scratch / name).read_bytes())
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise CheckpointError(f"{folder / name}: not valid JSON ({e})") from None
        try:
            config = AutoConfig.from_pretrained(scratch, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad config
            raise CheckpointError(f"{folder / 'config.json'}: cannot be read as a model config "
                                  f"({type(e).__name__}: {e})") from None
        tokenizer_files = [n for n in names if n in TOKENIZER_FILES]
        if not tokenizer_files:
            return config, None
        try:
            tokenizer = AutoTokenizer.from_pretrained(scratch, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - tokenizers/transformers raise many kinds for bad files
            raise CheckpointError(f"{folder}: its tokenizer ({', '.join(tokenizer_files)}) cannot be loaded "
                                  f"({type(e).__name__}: {e})") from None
    return config, tokenizer


def _move_into_place(tmp: Path, out: Path) -> None:
    """Rename the finished export ``tmp`` to ``out``; an existing ``out`` (empty, or a previous export that
    :func:`check_target` let through) is moved aside first and removed only once ``tmp`` is in its place."""
    if not out.exists():
        os.replace(tmp, out)
        return
    aside = out.with_name(f".{out.name}.replaced-{secrets.token_hex(4)}")
    os.replace(out, aside)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(aside, out)
        raise
    shutil.rmtree(aside)


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the model of ``checkpoint`` to ``out_dir`` (see the module docstring); returns ``out_dir``.

    Raises :class:`~ds_async.checkpoint.CheckpointError` for a bad checkpoint, :class:`ExportError` for an
    ``out_dir`` the rule refuses, ``OSError`` if writing fails."""
    from .models import hf_io  # imports DeepSpeed, which the export's argument checks do not need

    folder = resolve(checkpoint)
    if folder is None:
        raise CheckpointError(f"{checkpoint}: no complete checkpoint here")
    out = Path(os.path.abspath(out_dir))  # "." and ".." too have a parent to write beside
    check_target(out_dir, [checkpoint, folder], overwrite)
    manifest = read_manifest(folder)
    stages = manifest.get("pipeline_stages")
    if not isinstance(stages, int) or stages < 1:
        raise CheckpointError(f"{folder}: manifest without a pipeline layout")
    weights = [hf_io.INDEX] + [hf_io.shard_name(s, stages) for s in range(stages)]
    described = ["config.json"] + [n for n in TOKENIZER_FILES if n in manifest["files"]]
    verify(folder, weights + described, manifest)
    config, tokenizer = _read_model_files(folder, described)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{secrets.token_hex(4)}")
    tmp.mkdir()  # a fresh name: nothing that exists is ever removed here
    try:
        for name in weights:
            shutil.copyfile(folder / name, tmp / name)
        hf_io.write_model_files(tmp, config, tokenizer)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Path(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_async.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder (step_NNNNNNNN) or a folder of them (newest)")
    parser.add_argument("out", help="the Hugging Face model directory to write")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it holds a previous export (and nothing else)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, overwrite=args.overwrite)
    except (CheckpointError, ExportError, OSError) as e:
        print(f"ds_async.export: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out} (from {resolve(args.checkpoint)}); load it with AutoModelForCausalLM.from_pretrained")


if __name__ == "__main__":
    main()
