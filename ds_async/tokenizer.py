"""Train a byte-level BPE tokenizer on a text stream: `ds-async-train-tokenizer` / `python -m ds_async.tokenizer`."""

from __future__ import annotations

import argparse
import itertools
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds_async.data import EMBEDDED_CORPUS, EOS_TOKEN, load_text_stream

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ds-async-train-tokenizer", description=__doc__)
    parser.add_argument("--data", default=EMBEDDED_CORPUS,
                        help="embedded corpus, local files / glob (.parquet .json .jsonl .txt .cor) or hub dataset")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--min-frequency", type=int, default=2)
    parser.add_argument("--max-docs", type=int, help="train on the first N documents only")
    parser.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    stream = load_text_stream(args.data, args.split, args.text_field)
    texts = (row[args.text_field] for row in stream)
    if args.max_docs is not None:
        texts = itertools.islice(texts, args.max_docs)
    path = train_bpe(texts, args.vocab_size, args.out, args.min_frequency)
    logger.info("wrote %s", path)


if __name__ == "__main__":
    main()
