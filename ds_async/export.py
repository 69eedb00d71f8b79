"""Turn a ds_async checkpoint into a Hugging Face model directory: ``python -m ds_async.export CKPT OUT``.

``CKPT`` is a checkpoint folder (``.../checkpoints/step_00000123``) or a folder of them (its newest complete one is
taken). A checkpoint already stores the newest weights as Hugging Face names and lays them out, one safetensors
shard per pipeline stage, with their index and ``config.json``; this checks every one of those files against the
manifest (size and sha256) and copies them, with the tokenizer's files, into ``OUT``, which
``AutoModelForCausalLM.from_pretrained(OUT)`` (and ``AutoTokenizer``) load. One process, no GPU, no launcher.
The optimizer, the older weight version of a 2BW run and the trainer state are not exported.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from .checkpoint import CheckpointError, read_manifest, resolve, verify

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export(checkpoint: str | os.PathLike, out_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write the model of ``checkpoint`` to ``out_dir`` (see the module docstring); returns ``out_dir``."""
    from .models import hf_io

    folder = resolve(checkpoint)
    if folder is None:
        raise CheckpointError(f"{checkpoint}: no complete checkpoint here")
    manifest = read_manifest(folder)
    stages = manifest.get("pipeline_stages")
    if not isinstance(stages, int) or stages < 1:
        raise CheckpointError(f"{folder}: manifest without a pipeline layout")
    model_files = ["config.json", hf_io.INDEX] + [hf_io.shard_name(s, stages) for s in range(stages)]
    verify(folder, model_files, manifest)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: exists and is not empty (pass --overwrite to replace it)")
    # Copied into a sibling folder first, so that OUT never holds half an export.
    tmp = out.with_name(out.name + ".export-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in model_files + [n for n in TOKENIZER_FILES if n in manifest["files"]]:
        if name not in model_files:
            verify(folder, [name], manifest)
        shutil.copyfile(folder / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ds_async.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder (step_NNNNNNNN) or a folder of them (newest)")
    parser.add_argument("out", help="the Hugging Face model directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as e:
        print(f"ds_async.export: error: {e}", file=sys.stderr)
        sys.exit(1)
    print(f"wrote {out} (from {resolve(args.checkpoint)}); load it with AutoModelForCausalLM.from_pretrained")


if __name__ == "__main__":
    main()
