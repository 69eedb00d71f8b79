"""Train a byte-level BPE tokenizer on a text stream: `ds-async-train-tokenizer` / `python -m ds_async.tokenizer`.

Also: the tokenizer as a checkpoint and an export save it (:func:`for_generation`), and a checkpoint's tokenizer
read only after it is checked against the checkpoint's manifest (:func:`load_from_checkpoint`).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds_async.data import EMBEDDED_CORPUS, EOS_TOKEN, load_text_stream, usable_texts

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


def load_from_checkpoint(folder: str | os.PathLike):
    """The training tokenizer saved in checkpoint ``folder`` (its ``tokenizer.json``, as ``--resume`` of a
    ``train:<vocab>`` run reads it), after checking the file against the checkpoint's manifest: a missing,
    truncated, corrupt or unloadable file is a ``CheckpointError`` naming it."""
    from ds_async.checkpoint import CheckpointError, read_manifest, verify
    from ds_async.data import load_tokenizer

    file = Path(folder) / "tokenizer.json"
    verify(folder, [file.name], read_manifest(folder))
    try:
        return load_tokenizer(str(file))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own kinds for a bad file
        raise CheckpointError(f"{file}: cannot be loaded as a tokenizer ({type(e).__name__}: {e})") from None


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
