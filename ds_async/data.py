"""Text datasets -> token stream -> packed, resumable micro-batches for causal-LM pretraining.

:func:`open_batches` is the entry: for ``ds_async.data`` and a role (``train`` or ``validation``) it resolves the
source (an embedded corpus, local files, an ``hf://`` path or a hub dataset, read as a ``datasets`` stream) and
returns a :class:`PackedBatches`, one data-parallel rank's iterator of ``(input_ids, labels)`` micro-batches:
documents tokenized, each ended by EOS, packed back to back into rows of ``seq_len`` (every token an input exactly
once), ranks reading disjoint documents. Unusable documents are skipped and counted by reason
(:func:`usable_text`). ``state_dict`` / ``load_state_dict`` resume a stream exactly where it stood. Errors name
the config key: ConfigError for the config, DataError or FileNotFoundError for the data.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import re
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import datasets
import numpy as np
import torch
from datasets.distributed import split_dataset_by_node
from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from . import corpus, hub
from .config import ConfigError, DataConfig, DataSource, from_dict
from .corpus import EMBEDDED_CORPUS  # ships with Python itself: the default, nothing to install
from .hub import one_line, refuse_remote_code

LEE_CORPUS = "gensim:lee"  # the Lee news corpus inside gensim's wheel (pip install gensim)
EMBEDDED_PREFIXES = ("gensim:", "python:")  # a source so named is an embedded corpus, known or not
EOS_TOKEN = "<|endoftext|>"

# gensim's wheel ships the Lee news corpus (one article per line) as test data. It is ASCII but for one
# Latin-1 pound sign in lee.cor, which UTF-8 decoding rejects.
_LEE_FILES = {"train": "lee_background.cor", "validation": "lee.cor"}
_LEE_ENCODING = "latin-1"
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text", ".cor": "text"}
_DEFAULT_SPLIT = {"train": "train", "validation": "validation"}

# datasets sleeps config.SLEEP_TIME_ON_THREADS_SHUTDOWN (5 s) whenever an iterator over several shards ends, so that
# arrow's reader threads are gone before the interpreter is (apache/arrow#45214; arrow#39862 reports 100 ms after a
# scan enough). Only interpreter exit needs that: the end of an epoch or a dropped stream does not, and there it
# stalls training and every short job. So the sleep is 0 while a process runs, and at exit the process waits until
# _EXIT_WAIT seconds have passed since it last read a stream. 1 s was not enough on a loaded CPU: a study worker
# (tiny matrix, 2 cores and 3 busy processes) aborted at exit ("terminate called without an active exception") in
# 2 of 8 runs at 1 s and 0 of 10 at 3 s.
_EXIT_WAIT = 3.0
datasets.config.SLEEP_TIME_ON_THREADS_SHUTDOWN = 0
_last_read = [None]  # time.monotonic() of the last row read through this module


def _wait_for_reader_threads() -> None:
    if _last_read[0] is not None:
        time.sleep(max(0.0, _EXIT_WAIT - (time.monotonic() - _last_read[0])))


atexit.register(_wait_for_reader_threads)


def read_rows(stream):
    """The rows of a datasets stream, each read noted for the wait at exit (see above); closing this closes the
    stream (``_Documents.close``)."""
    rows = iter(stream)
    try:
        for row in rows:
            _last_read[0] = time.monotonic()
            yield row
    finally:
        if hasattr(rows, "close"):  # datasets' generator: its own cleanup shuts its reader threads down, now
            rows.close()
        # arrow's threads wind down after the stream ends or is closed, as after a read: the exit waits for them too
        _last_read[0] = time.monotonic()


class DataError(ValueError):
    """Training or validation data that cannot be read; the message names the file or source."""


def _builder_for(path: str) -> str | None:
    return _BUILDERS.get(os.path.splitext(path)[1].lower())


def _is_url(path: str) -> bool:
    return "://" in path


def _embedded_file(split: str) -> str:
    if split not in _LEE_FILES:
        raise ValueError(f"{LEE_CORPUS} has splits {sorted(_LEE_FILES)}, not {split!r}")
    # find_spec locates the package without importing it: importing gensim pulls in scipy and takes seconds.
    spec = importlib.util.find_spec("gensim")
    if spec is None:
        raise ModuleNotFoundError(
            f"the corpus {LEE_CORPUS!r} ships with gensim: `pip install gensim` (or use {EMBEDDED_CORPUS!r})"
        )
    return os.path.join(spec.submodule_search_locations[0], "test", "test_data", _LEE_FILES[split])


def resolve_files(source: str | Sequence[str], split: str) -> tuple[str, str | list[str] | None]:
    """Map a data source to (datasets builder name, data_files).

    `source` is an embedded corpus ("python:docs", "gensim:lee"), a path or glob (or a list of them) ending in .parquet, .json,
    .jsonl, .txt or .cor, or else a dataset for ``datasets.load_dataset`` (hub name, ``hf://datasets/owner/name``,
    local folder, builder name), returned as (source, None). Local globs are expanded here; URLs such as
    ``hf://datasets/owner/name@revision/dir/*.parquet`` go to ``datasets`` unchanged, which resolves them.
    """
    if isinstance(source, str):
        if source == EMBEDDED_CORPUS:
            if split not in corpus.SPLITS:
                raise ValueError(f"{EMBEDDED_CORPUS} has splits {list(corpus.SPLITS)}, not {split!r}")
            return "json", str(corpus.corpus_files()[split])
        if source == LEE_CORPUS:
            return "text", _embedded_file(split)
        if source.startswith(EMBEDDED_PREFIXES):
            raise ValueError(f"unknown embedded corpus {source!r}; there are {EMBEDDED_CORPUS!r} and {LEE_CORPUS!r}")
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
        if _is_url(pattern):
            files.append(pattern)
            continue
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


def describe(source) -> str:
    """A data source in one short line, for messages: the string itself, or the set fields of a DataSource."""
    if isinstance(source, DataSource):
        fields = {k: v for k, v in dataclasses.asdict(source).items() if v is not None}
        path = fields.pop("path", None)
        rest = ", ".join(f"{k}={v!r}" for k, v in fields.items())
        return f"{path} ({rest})" if path and rest else path or f"({rest})"
    if source is None or isinstance(source, str):
        return str(source)
    return ", ".join(map(str, source))


def _is_files(path: str) -> bool:
    """A path that names its files itself (so no config name, data_files, data_dir or revision apply)."""
    return path.startswith(EMBEDDED_PREFIXES) or _builder_for(path) is not None


def resolve_source(data: DataConfig, role: str) -> tuple[DataSource, int]:
    """The dataset that ``data.<role>`` (``train`` or ``validation``) reads, every field filled in, and how many of
    its first documents are held out for validation (``validation.from_train``; 0 without): the training stream
    skips them, the validation stream reads only them. Raises ConfigError naming the key."""
    if role not in _DEFAULT_SPLIT:
        raise ValueError(f"role must be 'train' or 'validation', not {role!r}")
    train = _as_source(data.train, "ds_async.data.train")
    if train.from_train is not None:
        raise ConfigError("ds_async.data.train.from_train: only in ds_async.data.validation")
    if train.path is None:
        raise ConfigError("ds_async.data.train.path: required (a dataset, files or python:docs)")
    train = _filled(train, "train", "ds_async.data.train")
    val = None if data.validation is None else _as_source(data.validation, "ds_async.data.validation")
    held_out = 0
    if val is not None and val.from_train is not None:
        if val.from_train < 1:
            raise ConfigError(f"ds_async.data.validation.from_train: must be >= 1, got {val.from_train}")
        others = [f.name for f in dataclasses.fields(val)
                  if f.name != "from_train" and getattr(val, f.name) is not None]
        if others:
            raise ConfigError(f"ds_async.data.validation.{others[0]}: not with from_train (the held-out documents "
                              "are the first documents of ds_async.data.train)")
        held_out = val.from_train
    if held_out:
        return train, held_out
    if val is None:
        if role == "validation":
            raise ConfigError("ds_async.data.validation: null (no validation data)")
        return train, 0
    if val.path is None:  # another split of the training dataset
        if _is_files(train.path) and not train.path.startswith(EMBEDDED_PREFIXES):
            raise ConfigError("ds_async.data.validation.path: required, since ds_async.data.train "
                              f"({train.path}) names files, which have no splits; name the validation files, or "
                              "hold documents out with from_train")
        val = dataclasses.replace(val, **{f.name: getattr(train, f.name) for f in dataclasses.fields(val)
                                          if f.name != "split" and getattr(val, f.name) is None})
    val = _filled(val, "validation", "ds_async.data.validation")
    return (train, 0) if role == "train" else (val, 0)


def _as_source(value, key: str) -> DataSource:
    if isinstance(value, DataSource):
        return value
    if isinstance(value, str):
        return DataSource(path=value)
    if isinstance(value, dict):  # a DataConfig built in code: parsed as the JSON is
        return from_dict(DataSource, value, key)
    raise ConfigError(f"{key}: expected a string or an object, got {type(value).__name__} {value!r}")


def _filled(src: DataSource, role: str, key: str) -> DataSource:
    """``src`` with its split defaulted, after checking that its fields go together."""
    if src.path is not None and _is_files(src.path):
        for name in ("name", "revision", "data_files", "data_dir"):
            if getattr(src, name) is not None:
                hint = " (an hf:// path takes @revision after the repository name)" if name == "revision" else ""
                raise ConfigError(f"{key}.{name}: does not apply to {src.path!r}, which names its files itself{hint}")
    files = src.data_files
    if isinstance(files, dict):
        for split, patterns in files.items():
            if not (isinstance(patterns, str) or
                    isinstance(patterns, list) and patterns and all(isinstance(p, str) for p in patterns)):
                raise ConfigError(f"{key}.data_files.{split}: expected a file pattern or a list of them, "
                                  f"got {patterns!r}")
    return dataclasses.replace(src, split=src.split or _DEFAULT_SPLIT[role])


def load_text_stream(source: str | Sequence[str] | DataSource, split: str, text_field: str = "text",
                     key: str | None = None) -> datasets.IterableDataset:
    """Stream `split` of `source` as rows holding each document under `text_field`.

    `source` is a string or list (see `resolve_files`) or a DataSource (its own ``split`` and ``text_field``, when
    set, take precedence; one without ``path`` needs the training source: see `open_batches`). `key` (the config
    key, e.g. ``ds_async.data.train``) starts the messages of DataError, FileNotFoundError and ConfigError.
    """
    label = f"{key}: " if key else ""
    src = source if isinstance(source, DataSource) else None
    if src is not None:
        if src.path is None or src.from_train is not None:
            raise ConfigError(f"{key or 'data source'}: {describe(src)} has no path of its own; a validation source "
                              "without one reads data.train's dataset: open it with ds_async.data.open_batches")
        source, split = src.path, src.split or split
    try:
        builder, files = resolve_files(source, split)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{label}{e}") from None
    except ValueError as e:
        raise DataError(f"{label}{e}") from None
    # A dataset name that is neither a local folder nor one of datasets' own builders (parquet, json, ...), or files
    # by hf:// URL: read from the hub.
    on_hub = (files is None and not os.path.exists(builder) and builder not in _PACKAGED_DATASETS_MODULES) or any(
        str(f).startswith("hf://") for f in ([files] if isinstance(files, str) else files or []))
    why = hub.unreachable() if on_hub else None
    if why is not None:
        raise DataError(f"{label}{describe(src or source)}: cannot reach the Hugging Face hub ({why}); without a "
                        "network set HF_HUB_OFFLINE=1 to read a dataset from the local cache, or point the key at "
                        "local files")
    if files is None:  # a dataset: load_dataset(path, name=..., revision=..., data_files=..., data_dir=...)
        fields = dataclasses.asdict(src) if src is not None else {}
        kwargs = {k: fields[k] for k in ("name", "revision", "data_files", "data_dir") if fields.get(k) is not None}
    else:
        for file in [files] if isinstance(files, str) else files:
            if not _is_url(file):
                try:
                    _check_readable(file, builder)
                except DataError as e:
                    raise DataError(f"{label}{e}") from None
        kwargs = {"data_files": {split: files}}
    # Bytes of a text line that are not UTF-8 become U+FFFD instead of stopping the stream; PackedBatches skips
    # and counts such lines.
    if source == LEE_CORPUS:
        kwargs["encoding"] = _LEE_ENCODING
    elif builder == "text":
        kwargs["encoding_errors"] = "replace"
    column = "text" if builder == "text" else src.text_field if src is not None and src.text_field else text_field
    try:
        ds = datasets.load_dataset(builder, split=split, streaming=True, **kwargs)
        if column != text_field:
            ds = ds.rename_column(column, text_field)
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow/hub errors rarely name the source
        raise DataError(f"{label}{describe(src or source)}: cannot open the data ({one_line(e, 400)})") from None
    return ds


def load_tokenizer(spec: str, key: str | None = None) -> PreTrainedTokenizerFast:
    """Load a tokenizer.json file, or a directory / hub name through AutoTokenizer (never running code of its own:
    a folder with ``auto_map`` is refused); it must define an EOS token. With ``key`` (the config key, e.g.
    ``ds_async.tokenizer``) every failure is a one-line ConfigError naming it and ``spec``."""

    where = f"{key}: {spec}" if key else spec
    try:
        if spec.endswith(".json"):
            if not os.path.isfile(spec):
                raise FileNotFoundError(f"no tokenizer file {spec!r}")
            tokenizer = PreTrainedTokenizerFast(tokenizer_file=spec)
            # A bare tokenizer.json has no config naming its EOS; ours (see ds_async.tokenizer) reserve EOS_TOKEN.
            if EOS_TOKEN in tokenizer.get_vocab():
                tokenizer.eos_token = EOS_TOKEN
        else:
            refuse_remote_code(spec, where)
            tokenizer = AutoTokenizer.from_pretrained(spec, trust_remote_code=False)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a missing file, an unreachable hub name, a file tokenizers rejects
        if key is None:
            raise
        raise ConfigError(f"{where}: cannot load the tokenizer ({one_line(e)})") from None
    try:
        eos_id(tokenizer)
    except ValueError as e:
        if key is None:
            raise
        raise ConfigError(f"{key}: {e}") from None
    return tokenizer


def document_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """A function from documents to their token ids, equal to ``tokenizer(texts, add_special_tokens=False,
    split_special_tokens=True)["input_ids"]`` (a literal ``<|endoftext|>`` in a document is text, not a boundary).

    For a tokenizer with a Rust backend it encodes with a copy of that backend, set up once as that call sets it up
    (no truncation, no padding, special tokens split) and without computing character offsets
    (``encode_batch_fast``): 1.25x the call's tokens/s on 64 enwiki documents at a time (2-core CPU, 2.0-2.1M
    against 1.6-1.7M). The copy is this function's own, so a stream read in a background thread shares no settings
    with the caller's tokenizer, which the call would set on every use."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a Python or SentencePiece tokenizer: the call itself
        return lambda texts: tokenizer(texts, add_special_tokens=False, split_special_tokens=True,
                                       return_attention_mask=False)["input_ids"]
    backend = Tokenizer.from_str(backend.to_str())
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = True
    return lambda texts: [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]


def eos_id(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no EOS token to separate documents")
    return tokenizer.eos_token_id


SKIP_REASONS = ("empty", "short", "non_utf8", "not_text")
HELD_OUT = "held_out"  # a further skip reason, counted only by streams with held-out documents
_REASONS = (*SKIP_REASONS, HELD_OUT)
REPLACEMENT_CHAR = "\ufffd"
# What a document of no text holds: C0 control characters (NUL first: a zero-filled file is valid UTF-8), DEL and
# whitespace. Stripped from both ends only, so a real document costs a look at its first character.
_NOT_TEXT_CHARS = "".join(map(chr, range(32))) + "\x7f \u00a0\u2028\u2029\ufeff"


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
    if not value.strip(_NOT_TEXT_CHARS):
        return None, "not_text"  # NUL or other control characters only
    if not value.isascii() and REPLACEMENT_CHAR in value:
        return None, "non_utf8"  # a text-file line whose bytes were not UTF-8 (decoded with errors="replace")
    if min_chars > 1 and _visible_chars(value, min_chars) < min_chars:
        return None, "short"
    return value, None


PIECE_CHARS = 1 << 18
"""Documents longer than this many characters are tokenized in pieces of at most this many, as the token buffer
needs them (:func:`next_piece`), so that neither tokenizing nor the token buffer grows with a document's length (a
100 MB line tokenized at once took 6.2 GiB); the stream's state holds the document's untokenized rest as text."""


def next_piece(text: str, start: int, size: int = PIECE_CHARS) -> int:
    """Where the piece of ``text`` that starts at ``start`` ends: ``len(text)`` if at most ``size`` characters are
    left, else just before the last newline, or failing that the last whitespace, in the second half of the next
    ``size`` characters, or failing both after ``size`` characters. A byte-level BPE splits words from the
    whitespace before them, so pieces cut before whitespace tokenize as the whole text does; a cut that falls
    inside a run the tokenizer would not split (``size`` characters without whitespace) changes the tokens there."""
    end = start + size
    if end >= len(text):
        return len(text)
    lo = start + size // 2
    for sep in ("\n", " ", "\t"):
        cut = text.rfind(sep, lo, end)
        if cut > start:
            return cut
    return end


def _visible_chars(text: str, enough: int) -> int:
    """The non-whitespace characters of ``text``, counted until ``enough`` (a long document is not split whole)."""
    count = 0
    for word in re.finditer(r"\S+", text):
        count += word.end() - word.start()
        if count >= enough:
            break
    return count


def usable_texts(stream, text_field: str, min_chars: int = 1) -> Iterator[str]:
    """The documents of ``stream`` that training reads (``usable_text``), in order: a tokenizer's training text."""
    for row in read_rows(stream):
        text = usable_text(row.get(text_field), min_chars)[0]
        if text is not None:
            yield text


NON_UTF8_REFUSED, NON_UTF8_WARNED = 0.5, 0.1
"""Shares of non-UTF-8 documents among those read at start that stop the job / print a warning."""


def check_encoding(documents: int, non_utf8: int, where: str) -> str | None:
    """The verdict on ``non_utf8`` of the first ``documents`` documents of source ``where`` (config key and
    source): DataError from half of them (not UTF-8 text: binary data, or another encoding), a warning line from a
    tenth (the rest trains, those are skipped), else None."""
    if not documents or non_utf8 < NON_UTF8_WARNED * documents:
        return None
    what = f"{where}: {non_utf8} of the first {documents} documents are not valid UTF-8"
    if non_utf8 >= NON_UTF8_REFUSED * documents:
        raise DataError(f"{what}; this is not UTF-8 text (binary data, or another encoding: convert it to UTF-8)")
    return f"ds_async: warning: {what} and are skipped (another encoding, or binary data mixed in?)"


def text_digest(text: str) -> bytes:
    """What identifies a held-out document: a 16-byte BLAKE2b digest of its text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class _QuietRefill(logging.Filter):
    """datasets warns that a loaded shuffle-buffer state has no buffer content. Our streams use datasets' shuffle
    only with buffer_size=1 (a pass-through that keeps its shard shuffle) and save the buffer themselves."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Loading a state dict of a shuffle buffer")


logging.getLogger("datasets.iterable_dataset").addFilter(_QuietRefill())
_END = object()


class _Documents:
    """One data-parallel rank's documents in training order, epoch after epoch, and where it stands.

    Order: datasets' shard order (``shuffle(seed, buffer_size=1)``: shards shuffled per epoch, up to 10 interleaved;
    no example buffer), then a shuffle buffer of ``shuffle_buffer`` documents run here with datasets 5's algorithm
    (fill, permute, emit all but half, keep half; permute the rest at the end) and its seeds. Ranks take whole shards
    when the shard count is a multiple of the rank count, else every ``world``-th document after the buffer, as
    ``split_dataset_by_node`` does. Each document is what `classify` makes of a row: the text, or the index of a
    skip reason.

    ``state_dict`` holds the source's ``IterableDataset.state_dict()`` (as JSON text), the buffered documents and
    the buffer's RNG, so ``load_state_dict`` continues exactly without re-reading consumed documents (datasets
    reopens the saved shard at the saved record batch). Where the stream reports no state (an iterable that does
    not implement one) or its shard count changed since the save, the source is re-read up to the saved count.
    """

    def __init__(self, dataset: datasets.IterableDataset, classify, *, seed: int, shuffle_buffer: int,
                 dp_rank: int, dp_world_size: int):
        self._shards = dataset.num_shards
        by_shard = self._shards % dp_world_size == 0
        self._step, self._offset = (1, 0) if by_shard else (dp_world_size, dp_rank)
        source = dataset.shuffle(seed=seed, buffer_size=1) if shuffle_buffer else dataset
        # Always a new IterableDataset: set_epoch and load_state_dict change the object.
        self._source = split_dataset_by_node(source, rank=dp_rank if by_shard else 0,
                                             world_size=dp_world_size if by_shard else 1)
        self._classify, self._seed, self._size = classify, seed, shuffle_buffer
        self.columns: list[str] | None = None  # of the first row read, for messages
        self.open(0)

    def open(self, epoch: int) -> None:
        self._source.set_epoch(epoch)
        self._rows = read_rows(iter(self._source))
        self.epoch, self.read, self.emitted, self.exhausted = epoch, 0, 0, False
        self._kept: list = []
        self._pending: collections.deque = collections.deque()
        self._rng = None
        if self._size:
            # datasets' buffer generator: default_rng(seed), shifted per epoch as shift_ex_examples_rngs does.
            rng = np.random.default_rng(self._seed)
            self._rng = rng if epoch == 0 else np.random.default_rng(int(rng.integers(0, 1 << 63)) - epoch)

    def close(self) -> None:
        """Stop reading: datasets' iterator shuts its reader threads down now, in this thread. Left to the garbage
        collector, that shutdown joins threads wherever a collection happens to run: inside threading's bookkeeping
        of a starting thread it deadlocks that start (CPython 3.11)."""
        self._rows.close()

    def next(self):
        """The next document of this rank, or None at the end of the epoch."""
        while True:
            if self._pending:
                doc, index = self._pending.popleft(), self.emitted
                self.emitted += 1
                if index % self._step == self._offset:
                    return doc
            elif self.exhausted:
                return None
            else:
                self._fill()

    def _fill(self) -> None:
        size = max(self._size, 1)
        while len(self._kept) < size:
            row = next(self._rows, _END)
            if row is _END:
                self.exhausted = True
                break
            self.read += 1
            if self.columns is None and isinstance(row, dict):
                self.columns = list(row)
            self._kept.append(self._classify(row))
        keep = 0 if self.exhausted else size // 2
        order = self._rng.permutation(len(self._kept)) if self._rng is not None and self._kept else \
            range(len(self._kept))
        cut = len(self._kept) - keep
        self._pending.extend(self._kept[i] for i in order[:cut])
        self._kept = [self._kept[i] for i in order[cut:]]

    def state_dict(self) -> dict:
        source = None
        if self.read:
            # As JSON text: the layout is datasets' own, and differs between equal positions reached differently
            # (read through, or resumed), which nothing outside datasets should compare.
            try:
                source = json.dumps(_plain(self._source.state_dict()))
            except (AttributeError, NotImplementedError, RuntimeError, TypeError):
                source = None  # no state for this stream: resume re-reads `read` rows
        return {"epoch": self.epoch, "read": self.read, "emitted": self.emitted, "exhausted": self.exhausted,
                "shards": self._shards, "source": source, "kept": list(self._kept), "pending": list(self._pending),
                "rng": self._rng.bit_generator.state if self._rng is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.open(state["epoch"])
        if state["read"] and not state["exhausted"]:
            if state["source"] is not None and state["shards"] == self._shards:
                self._source.load_state_dict(json.loads(state["source"]))
                self._rows = read_rows(iter(self._source))
            else:  # skipped now, so that _rows stays the generator close() closes
                collections.deque(itertools.islice(self._rows, state["read"]), maxlen=0)
        self.read, self.emitted, self.exhausted = state["read"], state["emitted"], state["exhausted"]
        self._kept = list(state["kept"])
        self._pending = collections.deque(state["pending"])
        if self._rng is not None:
            self._rng.bit_generator.state = state["rng"]


def _classify(row, text_field: str, min_chars: int, held_out: frozenset[bytes]) -> str | int:
    """A row as its text, or the index in ``_REASONS`` of why it is skipped."""
    value = row.get(text_field)
    text, reason = usable_text(value, min_chars)
    if reason is None and held_out and text_digest(text) in held_out:
        reason = HELD_OUT
    return text if reason is None else _REASONS.index(reason)


def _plain(state):
    """A datasets state as JSON- and ``torch.load(weights_only=True)``-safe data (numpy scalars as Python's)."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [_plain(v) for v in state]
    return state.item() if isinstance(state, np.generic) else state


class PackedBatches:
    """Iterator of micro-batches (input_ids, labels), each a LongTensor [micro_batch_size, seq_len].

    Documents are tokenized without special tokens, each followed by EOS, and concatenated into one stream that is
    cut into rows: row k has input_ids = stream[k*T : k*T+T] and labels = stream[k*T+1 : k*T+T+1], so every token
    is an input exactly once, in order. The document order is datasets' shard shuffle and a streaming shuffle buffer
    of `shuffle_buffer` documents seeded by `seed` (for buffers under 20 documents the order of
    ``dataset.shuffle(seed, shuffle_buffer)``; no shuffle when shuffle_buffer=0), split across data-parallel ranks
    as `split_dataset_by_node` splits, so ranks read disjoint documents (see `_Documents`). With `repeat` the stream
    restarts after each epoch in a new order (`set_epoch`); without it, iteration stops at the end and the last
    partial batch is dropped. Documents that are empty or whitespace-only, have fewer than `min_chars`
    non-whitespace characters, are not valid UTF-8 (text-file lines decoded with U+FFFD replacements, or bytes; so
    a document containing U+FFFD is taken as not UTF-8), are not text at all (not a string, or only NUL and other
    control characters), or whose `text_digest` is in `held_out` (reason ``HELD_OUT``) are skipped and counted by
    reason (`skipped`).
    A document longer than PIECE_CHARS is tokenized a piece at a time as the rows need it (:func:`next_piece`).
    A file that fails to read mid-stream raises DataError naming `source`. `state_dict` / `load_state_dict`
    resume exactly where the iterator stood, from the stream's own position (no re-reading; see `_Documents`).
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
        source=None,
        held_out: frozenset[bytes] | None = None,
    ):
        if seq_len < 1 or micro_batch_size < 1 or tokenize_batch < 1 or min_chars < 1:
            raise ValueError("seq_len, micro_batch_size, tokenize_batch and min_chars must be positive")
        if not 0 <= dp_rank < dp_world_size:
            raise ValueError(f"dp_rank {dp_rank} is outside dp_world_size {dp_world_size}")
        self._encode = document_encoder(tokenizer)
        self._eos = eos_id(tokenizer)
        self._seq_len = seq_len
        self._micro_batch_size = micro_batch_size
        self._dp_rank, self._dp_world_size = dp_rank, dp_world_size
        self._repeat = repeat
        self._tokenize_batch = tokenize_batch
        self._held_out = held_out or frozenset()
        self._source = describe(source) if source is not None else "the data stream"
        # A function of its own, not a bound method: no reference cycle, so a dropped PackedBatches closes its
        # stream at once, on its own thread (a cycle left it to the garbage collector, on whatever thread runs it,
        # where closing datasets' reader threads can deadlock a thread that is starting).
        classify = functools.partial(_classify, text_field=text_field, min_chars=min_chars, held_out=self._held_out)
        self._docs = _Documents(dataset, classify, seed=seed, shuffle_buffer=max(shuffle_buffer, 0),
                                dp_rank=dp_rank, dp_world_size=dp_world_size)

        self._text_field = text_field
        self._tokens = 0
        self._used = 0
        self._skipped = dict.fromkeys(self._reasons(), 0)
        self._epoch_has_text = False
        # Tokens not yet emitted are self._buffer[self._pos:]; consumed ones are dropped in bulk at refill time
        # so that taking a batch never shifts the whole list.
        self._buffer: list[int] = []
        self._pos = 0
        # A document longer than PIECE_CHARS, tokenized up to character self._long_at (one string, not copied).
        self._long, self._long_at = "", 0

    def _reasons(self) -> tuple[str, ...]:
        return _REASONS if self._held_out else SKIP_REASONS

    def _next_doc(self):
        try:
            return self._docs.next()
        except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors mid-stream rarely name the file
            raise DataError(f"{self._source}: reading failed after document {self._docs.read} of epoch "
                            f"{self._docs.epoch} ({type(e).__name__}: {e})") from None

    def _refill(self, needed: int) -> bool:
        """Buffer at least `needed` unemitted tokens; False when a non-repeating stream runs out first. A document
        longer than PIECE_CHARS is tokenized a piece at a time, as the buffer needs it (:func:`next_piece`)."""
        del self._buffer[: self._pos]
        self._pos = 0
        while len(self._buffer) < needed:
            if self._long_at < len(self._long):  # the rest of a long document comes first
                self._take_piece()
                continue
            texts, taken = [], 0
            while taken < self._tokenize_batch:
                doc = self._next_doc()
                if doc is None:
                    break
                taken += 1
                if isinstance(doc, str) and len(doc) > PIECE_CHARS:
                    self._used += 1
                    self._epoch_has_text = True
                    self._long, self._long_at = doc, 0
                    break  # its pieces follow the documents taken before it
                if isinstance(doc, str):
                    texts.append(doc)
                else:
                    self._skipped[_REASONS[doc]] += 1
            if not taken:
                if not self._repeat:
                    return False
                if not self._epoch_has_text:
                    raise DataError(self._no_text())
                self._docs.open(self._docs.epoch + 1)
                self._epoch_has_text = False
                continue
            if not texts:
                continue
            self._epoch_has_text = True
            self._used += len(texts)
            for ids in self._encode(texts):
                self._buffer.extend(ids)
                self._buffer.append(self._eos)
        return True

    def _take_piece(self) -> None:
        """Tokenize the next piece of the long document in hand into the buffer (EOS after its last)."""
        end = next_piece(self._long, self._long_at)
        self._buffer.extend(self._encode([self._long[self._long_at:end]])[0])
        self._long_at = end
        if end == len(self._long):
            self._buffer.append(self._eos)
            self._long, self._long_at = "", 0

    def _no_text(self) -> str:
        """Why a whole pass over this rank's documents gave no text to train on, naming the source and the key."""
        skipped = {k: v for k, v in self._skipped.items() if v}
        if not skipped:
            if self._dp_world_size > 1:
                return (f"{self._source}: no documents for data-parallel rank {self._dp_rank} of "
                        f"{self._dp_world_size} (empty, or fewer documents or files than replicas)")
            return f"{self._source}: no documents (empty)"
        counts = ", ".join(f"{v} {k.replace('_', '-')}" for k, v in skipped.items())
        hint = ""
        columns = self._docs.columns
        if columns is not None and self._text_field not in columns:
            hint = (f"; the rows have no column '{self._text_field}' (ds_async.data.text_field), they have "
                    f"{', '.join(map(repr, columns[:10]))}")
        elif skipped.get("non_utf8"):
            hint = "; non-UTF-8 text files are skipped line by line: convert them to UTF-8"
        elif skipped.get("short"):
            hint = "; ds_async.data.min_chars may be too high"
        elif skipped.get("not_text"):
            hint = "; the documents hold no text (only NUL or other control characters, or values that are not " \
                "strings)"
        return (f"{self._source}: no usable text: all {sum(skipped.values())} documents data-parallel rank "
                f"{self._dp_rank} read in a whole pass were skipped ({counts}){hint}")

    def peek(self) -> None:
        """Buffer the next micro-batch's tokens without emitting them (the next ``__next__`` returns them): a
        stream that cannot be read or holds no usable text raises DataError now. StopIteration for a non-repeating
        stream too short for one micro-batch."""
        n = self._micro_batch_size * self._seq_len
        if len(self._buffer) - self._pos < n + 1 and not self._refill(n + 1):
            raise StopIteration

    @property
    def documents(self) -> int:
        """Documents taken so far, used or skipped."""
        return self._used + sum(self._skipped.values())

    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._micro_batch_size * self._seq_len
        # One token beyond the batch is needed as the last label; it stays buffered as the next batch's first input.
        if len(self._buffer) - self._pos < n + 1 and not self._refill(n + 1):
            raise StopIteration
        # Through numpy: 3.4x faster than torch.tensor(list) (0.46 against 1.59 ms for 32k tokens), time a stream
        # read in a background thread holds the GIL against the training loop.
        flat = torch.from_numpy(np.array(self._buffer[self._pos : self._pos + n + 1], dtype=np.int64))
        self._pos += n
        self._tokens += n
        inputs = flat[:-1].view(self._micro_batch_size, self._seq_len)
        # Own storage, so that masking labels in place cannot alter the inputs.
        labels = flat[1:].clone().view(self._micro_batch_size, self._seq_len)
        return inputs, labels

    @property
    def tokens_seen(self) -> int:
        return self._tokens

    def close(self) -> None:
        """Stop reading the stream and release its reader threads (see ``_Documents.close``); the counters and
        ``state_dict`` stay readable."""
        self._docs.close()

    @property
    def skipped(self) -> dict[str, int]:
        """Documents skipped so far, by reason (``SKIP_REASONS``, and ``HELD_OUT`` with `held_out` documents)."""
        return dict(self._skipped)

    def state_dict(self) -> dict:
        """Plain data (JSON- and ``torch.load(weights_only=True)``-safe): the stream's position, the documents in the
        shuffle buffer, the tokens not yet emitted and the counters."""
        return {
            "version": 2,
            "epoch": self._docs.epoch,
            "docs": self._docs.emitted,
            "tokens": self._tokens,
            "skipped_docs": sum(self._skipped.values()),
            "skipped": dict(self._skipped),
            "used": self._used,
            "has_text": self._epoch_has_text,
            "buffer": self._buffer[self._pos :],
            "stream": self._docs.state_dict(),
            # The long document being tokenized in pieces and how far (a reference: taking a state copies nothing).
            "long": self._long,
            "long_at": self._long_at,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()` of an iterator built with the same dataset and arguments."""
        if state.get("version", 1) >= 2:
            self._docs.load_state_dict(state["stream"])
            self._epoch_has_text = state["has_text"]
        else:  # a version-1 state has no stream position, only the count of documents read (`docs`)
            warnings.warn("data stream state of an older ds_async: re-reading to the saved document count; the "
                          "document order may differ from the interrupted run's", stacklevel=2)
            self._docs.open(state["epoch"])
            for _ in range(state["docs"]):
                if self._next_doc() is None:
                    break
            self._epoch_has_text = state["docs"] > 0
        self._tokens = state["tokens"]
        self._skipped = dict.fromkeys(self._reasons(), 0)
        self._skipped.update(state.get("skipped", {"empty": state["skipped_docs"]}))
        self._used = state.get("used", 0)
        self._buffer = list(state["buffer"])
        self._pos = 0
        self._long, self._long_at = state.get("long", ""), state.get("long_at", 0)


def open_batches(data: DataConfig, role: str, tokenizer, micro_batch_size: int, *, dp_rank: int = 0,
                 dp_world_size: int = 1, seed: int = 0, tokenize_batch: int = 64) -> PackedBatches:
    """One data-parallel rank's micro-batches of ``data.train`` (shuffled by ``data.shuffle_buffer``, repeating, the
    ``validation.from_train`` documents skipped) or of ``data.validation`` (file order, one pass), for a DataConfig
    ``data``. Errors name the config key: ConfigError for the config, DataError or FileNotFoundError for the data."""
    source, held_out = resolve_source(data, role)
    key = "ds_async.data.train" if held_out else f"ds_async.data.{role}"
    stream = load_text_stream(source, source.split, data.text_field, key=key)
    exclude = None
    if held_out:
        # As training reads them (UTF-8 bytes decoded), so that the digests match; unusable ones are read by neither.
        texts = [text for text, _ in (usable_text(t, 0) for t in _first_texts(stream, held_out, data.text_field, key))
                 if text is not None]
        if role == "validation":
            stream = datasets.Dataset.from_dict({data.text_field: texts}).to_iterable_dataset()
        else:
            exclude = frozenset(text_digest(t) for t in texts)
    train = role == "train"
    return PackedBatches(stream, tokenizer, data.seq_len, micro_batch_size, dp_rank=dp_rank,
                         dp_world_size=dp_world_size, seed=seed, shuffle_buffer=data.shuffle_buffer if train else 0,
                         repeat=train, text_field=data.text_field, tokenize_batch=tokenize_batch,
                         min_chars=data.min_chars, source=f"{key}: {describe(source)}", held_out=exclude)


def _first_texts(stream: datasets.IterableDataset, n: int, text_field: str, key: str) -> list:
    """The `text_field` values of the first `n` rows of `stream` in file order (the held-out documents)."""
    try:
        return [row.get(text_field) for row in itertools.islice(read_rows(stream), n)]
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors rarely name the source
        raise DataError(f"{key}: reading the held-out documents failed ({one_line(e, 400)})") from None
