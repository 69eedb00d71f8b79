"""The run's tokenizer: trained as a byte-level BPE on a text stream (:func:`train_bpe`; the command
`ds-async-train-tokenizer` / `python -m ds_async.tokenizer`), resolved from ``ds_async.tokenizer`` for a job
(:func:`resolve`, with ``train:<vocab>`` trained into the run folder by :func:`train_for_run`), fingerprinted for
checkpoints (:func:`fingerprint`), and read back from a checkpoint only after it is checked against the checkpoint's
manifest (:func:`load_from_checkpoint`). Loading a tokenizer file or name is ``ds_async.data.load_tokenizer``'s;
how a checkpoint and an export save it for Hugging Face users, ``ds_async.models.hf_io.for_generation``'s.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from . import config as cfgmod
from . import data
from .checkpoint import CheckpointError, folder, read_manifest, verify
from .config import ConfigError, DsAsyncConfig
from .data import EMBEDDED_CORPUS, EOS_TOKEN, load_text_stream, load_tokenizer, usable_texts

logger = logging.getLogger(__name__)


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str, min_frequency: int = 2) -> str:
    """Train a byte-level BPE tokenizer with EOS_TOKEN as id 0 and write it as a tokenizer.json to `out_path`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        # All 256 bytes up front, so that any text, including characters unseen in training, stays encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() < vocab_size:
        logger.warning(
            "the text only supports %d tokens (asked for %d): too few pairs occur min_frequency=%d times",
            tokenizer.get_vocab_size(), vocab_size, min_frequency,
        )
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return str(path)


def load_from_checkpoint(folder: str | os.PathLike):
    """The training tokenizer saved in checkpoint ``folder`` (its ``tokenizer.json``, as ``--resume`` of a
    ``train:<vocab>`` run reads it), after checking the file against the checkpoint's manifest: a missing,
    truncated, corrupt or unloadable file is a ``CheckpointError`` naming it."""
    file = Path(folder) / "tokenizer.json"
    verify(folder, [file.name], read_manifest(folder))
    try:
        return load_tokenizer(str(file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own kinds for a bad file
        raise CheckpointError(f"{file}: cannot be loaded as a tokenizer ({type(e).__name__}: {e})") from None


def resolve(cfg: DsAsyncConfig, run_dir: Path, dist, group=None):
    """Load the configured tokenizer (errors name ``ds_async.tokenizer``); ``train:<vocab>`` first has rank 0 train
    one on the training stream (:func:`train_for_run`). ``dist`` gives ``get_rank`` and ``barrier``; with a
    process ``group``, rank 0's outcome (the file, or its error) reaches every rank, so a failure there stops every
    rank with the same message instead of leaving the others waiting."""
    spec = cfg.tokenizer
    if spec.startswith("train:"):
        train_vocab(spec)  # on every rank: a malformed spec fails everywhere alike
        outcome = None
        if dist.get_rank() == 0:
            try:
                outcome = str(train_for_run(cfg, run_dir))
            except (ConfigError, data.DataError, FileNotFoundError) as e:
                outcome = e
            except Exception as e:  # noqa: BLE001 - whatever reading the stream raised, on every rank
                outcome = data.DataError(f"ds_async.tokenizer: {spec}: training it on ds_async.data.train failed "
                                         f"({type(e).__name__}: {e})")
        if group is not None:
            outcome = folder.agree(outcome, group)
        else:
            dist.barrier()
            if isinstance(outcome, Exception):
                raise outcome
        spec = outcome or str(run_dir / "tokenizer.json")
    return data.load_tokenizer(spec, key="ds_async.tokenizer")


def train_vocab(spec: str) -> int:
    """The vocabulary size of a ``train:<vocab>`` spec; ConfigError naming ``ds_async.tokenizer`` if it is malformed
    or below a byte-level BPE's 257 tokens."""
    try:
        vocab = int(spec.split(":", 1)[1])
    except ValueError:
        raise ConfigError(f"ds_async.tokenizer: 'train:<vocab size>' expected, got {spec!r}") from None
    if vocab < 257:
        raise ConfigError(f"ds_async.tokenizer: {spec}: a byte-level BPE has at least 257 tokens (256 bytes and EOS)")
    return vocab


def train_for_run(cfg: DsAsyncConfig, run_dir: Path) -> Path:
    """Rank 0's part of ``tokenizer: "train:<vocab>"``: the run folder's ``tokenizer.json``, trained on
    ``data.train`` now unless the folder's previous run (its ``manifest.json``) trained it with the same vocabulary
    size, training source, text field and min_chars. One trained otherwise, or of unknown origin, is replaced, with a
    line saying so. Prints a line before training (it reads the whole training source)."""
    vocab = train_vocab(cfg.tokenizer)
    path, manifest = run_dir / "tokenizer.json", run_dir / "manifest.json"
    keys = ("tokenizer", "data.train", "data.text_field", "data.min_chars")

    def recipe(section: dict) -> dict:
        return {k: section.get(k) if "." not in k else (section.get("data") or {}).get(k.split(".")[1]) for k in keys}

    now = recipe(cfgmod.resolved(cfg))
    if path.exists():
        try:
            before = json.loads(manifest.read_text())["ds_async"]
        except (OSError, ValueError, KeyError, TypeError):
            before = None
        if isinstance(before, dict) and recipe(before) == now:
            return path
        if not isinstance(before, dict):
            why = f"has no record of how it was trained (no {manifest.name} of a run with it)"
        else:
            old = recipe(before)
            why = "was trained with another " + ", ".join(
                f"ds_async.{k} ({old[k]})" if k == "tokenizer" else f"ds_async.{k}" for k in keys if old[k] != now[k])
        print(f"ds_async: {path} {why}: training a new one for ds_async.tokenizer = {cfg.tokenizer!r}", flush=True)
    print(f"ds_async: training a byte-level BPE tokenizer ({vocab} tokens) on ds_async.data.train "
          f"({data.describe(cfg.data.train)}) -> {path}", flush=True)
    stream = data.load_text_stream(cfg.data.train, "train", cfg.data.text_field, key="ds_async.data.train")
    train_bpe(data.usable_texts(stream, cfg.data.text_field, cfg.data.min_chars), vocab, str(path))
    return path


def fingerprint(tok) -> dict:
    """Size and hash of the vocabulary: a resumed run must tokenize exactly like the saved one."""
    vocab = json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=False).encode()
    return {"size": len(tok), "sha256": hashlib.sha256(vocab).hexdigest()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="ds-async-train-tokenizer",
        description=f"Train a byte-level BPE tokenizer ({EOS_TOKEN} as id 0) on the documents of --data that "
                    "training would read, and write it as a tokenizer.json (a config names it in ds_async.tokenizer).")
    parser.add_argument("--data", default=EMBEDDED_CORPUS,
                        help="embedded corpus, local files / glob (.parquet .json .jsonl .txt .cor) or hub dataset")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--min-chars", type=int, default=1,
                        help="skip documents with fewer non-space characters, as ds_async.data.min_chars does")
    parser.add_argument("--max-docs", type=int, help="train on the first N usable documents only")
    parser.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    stream = load_text_stream(args.data, args.split, args.text_field)
    texts = usable_texts(stream, args.text_field, args.min_chars)
    if args.max_docs is not None:
        texts = itertools.islice(texts, args.max_docs)
    path = train_bpe(texts, args.vocab_size, args.out, args.min_frequency)
    logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
