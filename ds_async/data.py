"""Text datasets -> token stream -> packed, resumable micro-batches for causal-LM pretraining."""

from __future__ import annotations

import glob
import importlib.util
import itertools
import os
from collections.abc import Sequence

import datasets
import torch
from datasets.distributed import split_dataset_by_node
from transformers import AutoTokenizer, PreTrainedTokenizerFast

EMBEDDED_CORPUS = "gensim:lee"
EOS_TOKEN = "<|endoftext|>"

# gensim's wheel ships the Lee news corpus (one article per line) as test data. It is ASCII but for one
# Latin-1 pound sign in lee.cor, which UTF-8 decoding rejects.
_LEE_FILES = {"train": "lee_background.cor", "validation": "lee.cor"}
_LEE_ENCODING = "latin-1"
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text", ".cor": "text"}


class DataError(ValueError):
    """Training or validation data that cannot be read; the message names the file or source."""


def _builder_for(path: str) -> str | None:
    return _BUILDERS.get(os.path.splitext(path)[1].lower())


def _embedded_file(split: str) -> str:
    if split not in _LEE_FILES:
        raise ValueError(f"{EMBEDDED_CORPUS} has splits {sorted(_LEE_FILES)}, not {split!r}")
    # find_spec locates the package without importing it: importing gensim pulls in scipy and takes seconds.
    spec = importlib.util.find_spec("gensim")
    if spec is None:
        raise ModuleNotFoundError(
            f"the embedded corpus {EMBEDDED_CORPUS!r} ships with gensim: `pip install ds_async[demo]`"
        )
    return os.path.join(spec.submodule_search_locations[0], "test", "test_data", _LEE_FILES[split])


def resolve_files(source: str | Sequence[str], split: str) -> tuple[str, str | list[str] | None]:
    """Map a data source to (datasets builder name, data_files).

    `source` is the embedded corpus "gensim:lee", a local path or glob (or a list of them) ending in .parquet,
    .json, .jsonl, .txt or .cor, or else a hub dataset name, returned as (name, None).
    """
    if isinstance(source, str):
        if source == EMBEDDED_CORPUS:
            return "text", _embedded_file(split)
        if source.startswith("gensim:"):
            raise ValueError(f"unknown embedded corpus {source!r}; the only one is {EMBEDDED_CORPUS!r}")
        if _builder_for(source) is None:
            return source, None
        patterns = [source]
    else:
        patterns = list(source)

    builders = {_builder_for(p) for p in patterns}
    if None in builders or len(builders) != 1:
        raise ValueError(f"local data files must share one of the extensions {sorted(_BUILDERS)}: {patterns}")
    files = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            raise FileNotFoundError(f"no data files match {pattern!r}")
        files.extend(matches)
    return builders.pop(), files


def _check_readable(file: str, builder: str) -> None:
    """Fail now, naming the file, rather than deep inside a stream: a folder, an unreadable file, or a parquet
    file whose footer (schema) cannot be read."""
    if os.path.isdir(file):
        raise DataError(f"{file}: is a directory, not a data file")
    try:
        with open(file, "rb") as f:
            f.read(1)
        if builder == "parquet":
            import pyarrow.parquet as pq

            pq.read_schema(file)
    except OSError as e:
        raise DataError(f"{file}: cannot read data file ({e.strerror or e})") from None
    except Exception as e:  # noqa: BLE001 - pyarrow's errors for a corrupt file
        raise DataError(f"{file}: not a readable {builder} file ({type(e).__name__}: {e})") from None


def load_text_stream(source: str | Sequence[str], split: str, text_field: str = "text") -> datasets.IterableDataset:
    """Stream `split` of `source` (see `resolve_files`) as rows holding each document under `text_field`."""
    builder, files = resolve_files(source, split)
    if files is None:
        return datasets.load_dataset(builder, split=split, streaming=True)
    for file in [files] if isinstance(files, str) else files:
        _check_readable(file, builder)
    # Bytes of a text line that are not UTF-8 become U+FFFD instead of stopping the stream; PackedBatches skips
    # and counts such lines.
    encoding = {"encoding": _LEE_ENCODING} if source == EMBEDDED_CORPUS else \
        {"encoding_errors": "replace"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files={split: files}, split=split, streaming=True, **encoding)
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors rarely name the file
        raise DataError(f"{source}: cannot open the data files ({type(e).__name__}: {e})") from None
    if builder == "text" and text_field != "text":
        ds = ds.rename_column("text", text_field)
    return ds


def load_tokenizer(spec: str) -> PreTrainedTokenizerFast:
    """Load a tokenizer.json file, or a directory / hub name through AutoTokenizer; it must define an EOS token."""
    if spec.endswith(".json"):
        if not os.path.isfile(spec):
            raise FileNotFoundError(f"no tokenizer file {spec!r}")
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=spec)
        # A bare tokenizer.json has no config naming its EOS; ours (see ds_async.tokenizer) reserve EOS_TOKEN.
        if EOS_TOKEN in tokenizer.get_vocab():
            tokenizer.eos_token = EOS_TOKEN
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec)
    eos_id(tokenizer)
    return tokenizer


def eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to separate documents")
    return tokenizer.eos_token_id


SKIP_REASONS = ("empty", "short", "non_utf8", "not_text")
REPLACEMENT_CHAR = "\ufffd"


def usable_text(value, min_chars: int) -> tuple[str | None, str | None]:
    """``(text, None)`` for a document to train on, else ``(None, reason)`` (one of ``SKIP_REASONS``)."""
    if value is None:
        return None, "empty"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return None, "non_utf8"
    if not isinstance(value, str):
        return None, "not_text"
    if not value or value.isspace():
        return None, "empty"
    if not value.isascii() and REPLACEMENT_CHAR in value:
        return None, "non_utf8"  # a text-file line whose bytes were not UTF-8 (decoded with errors="replace")
    if min_chars > 1 and len("".join(value.split())) < min_chars:
        return None, "short"
    return value, None


class PackedBatches:
    """Iterator of micro-batches (input_ids, labels), each a LongTensor [micro_batch_size, seq_len].

    Documents are tokenized without special tokens, each followed by EOS, and concatenated into one stream that is
    cut into rows: row k has input_ids = stream[k*T : k*T+T] and labels = stream[k*T+1 : k*T+T+1], so every token
    is an input exactly once, in order. The document order is `dataset.shuffle(seed, shuffle_buffer)` (no shuffle
    when shuffle_buffer=0), split across data-parallel ranks by `split_dataset_by_node` so ranks read disjoint
    documents. With `repeat` the stream restarts after each epoch in a new order (`set_epoch`); without it,
    iteration stops at the end and the last partial batch is dropped. Documents that are empty or
    whitespace-only, have fewer than `min_chars` non-whitespace characters, are not valid UTF-8 (text-file lines
    decoded with U+FFFD replacements, or bytes; so a document containing U+FFFD is taken as not UTF-8) or are not
    text at all are skipped and counted by reason (`skipped`).
    A file that fails to read mid-stream raises DataError naming `source`. `state_dict` / `load_state_dict`
    resume exactly where the iterator stood.
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        tokenizer,
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        seed: int = 0,
        shuffle_buffer: int = 1000,
        repeat: bool = True,
        text_field: str = "text",
        tokenize_batch: int = 64,
        min_chars: int = 1,
        source: str | None = None,
    ):
        if seq_len < 1 or micro_batch_size < 1 or tokenize_batch < 1 or min_chars < 1:
            raise ValueError("seq_len, micro_batch_size, tokenize_batch and min_chars must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_world_size {dp_world_size}")
        if shuffle_buffer > 0:
            dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
        self._dataset = split_dataset_by_node(dataset, rank=dp_rank, world_size=dp_world_size)
        self._tokenizer = tokenizer
        self._eos = eos_id(tokenizer)
        self._seq_len = seq_len
        self._micro_batch_size = micro_batch_size
        self._dp_rank = dp_rank
        self._repeat = repeat
        self._text_field = text_field
        self._tokenize_batch = tokenize_batch
        self._min_chars = min_chars
        self._source = source or "the data stream"

        self._tokens = 0
        self._skipped = dict.fromkeys(SKIP_REASONS, 0)
        # Tokens not yet emitted are self._buffer[self._pos:]; consumed ones are dropped in bulk at refill time
        # so that taking a batch never shifts the whole list.
        self._buffer: list[int] = []
        self._pos = 0
        self._open_epoch(0, skip=0)

    def _open_epoch(self, epoch: int, skip: int) -> None:
        self._dataset.set_epoch(epoch)
        # Skipped by reading rather than with IterableDataset.skip(): when documents (not files) are split across
        # ranks, skip() applies before the split and would drop other ranks' documents, and it also freezes the
        # file order that set_epoch() reshuffles, so the resumed order would differ from the uninterrupted one.
        self._rows = itertools.islice(iter(self._dataset), skip, None)
        self._epoch = epoch
        self._docs = skip
        # A resumed epoch may already have produced text before the checkpoint; assume so.
        self._epoch_has_text = skip > 0

    def _refill(self, needed: int) -> bool:
        """Buffer at least `needed` unemitted tokens; False when a non-repeating stream runs out first."""
        del self._buffer[: self._pos]
        self._pos = 0
        while len(self._buffer) < needed:
            try:
                rows = list(itertools.islice(self._rows, self._tokenize_batch))
            except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors mid-stream rarely name the file
                raise DataError(f"{self._source}: reading failed after document {self._docs} of epoch "
                                f"{self._epoch} ({type(e).__name__}: {e})") from None
            if not rows:
                if not self._repeat:
                    return False
                if not self._epoch_has_text:
                    raise ValueError(f"data-parallel rank {self._dp_rank} read no non-empty documents in an epoch")
                self._open_epoch(self._epoch + 1, skip=0)
                continue
            self._docs += len(rows)
            texts = []
            for row in rows:
                text, reason = usable_text(row.get(self._text_field), self._min_chars)
                if reason is None:
                    texts.append(text)
                else:
                    self._skipped[reason] += 1
            if not texts:
                continue
            self._epoch_has_text = True
            # split_special_tokens: a literal "<|endoftext|>" inside a document is text, not a document boundary.
            encoded = self._tokenizer(
                texts, add_special_tokens=False, split_special_tokens=True, return_attention_mask=False
            )["input_ids"]
            for ids in encoded:
                self._buffer.extend(ids)
                self._buffer.append(self._eos)
        return True

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._micro_batch_size * self._seq_len
        # One token beyond the batch is needed as the last label; it stays buffered as the next batch's first input.
        if len(self._buffer) - self._pos < n + 1 and not self._refill(n + 1):
            raise StopIteration
        flat = torch.tensor(self._buffer[self._pos : self._pos + n + 1], dtype=torch.long)
        self._pos += n
        self._tokens += n
        inputs = flat[:-1].view(self._micro_batch_size, self._seq_len)
        # Own storage, so that masking labels in place cannot alter the inputs.
        labels = flat[1:].clone().view(self._micro_batch_size, self._seq_len)
        return inputs, labels

    @property
    def tokens_seen(self) -> int:
        return self._tokens

    @property
    def skipped(self) -> dict[str, int]:
        """Documents skipped so far, by reason (``SKIP_REASONS``)."""
        return dict(self._skipped)

    def state_dict(self) -> dict:
        return {
            "epoch": self._epoch,
            "docs": self._docs,
            "tokens": self._tokens,
            "skipped_docs": sum(self._skipped.values()),
            "skipped": dict(self._skipped),
            "buffer": self._buffer[self._pos :],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` of an iterator built with the same dataset and arguments."""
        self._open_epoch(state["epoch"], skip=state["docs"])
        self._tokens = state["tokens"]
        self._skipped = dict.fromkeys(SKIP_REASONS, 0)
        self._skipped.update(state.get("skipped", {"empty": state["skipped_docs"]}))
        self._buffer = list(state["buffer"])
        self._pos = 0
