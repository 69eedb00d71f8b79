"""Documents -> packed, resumable micro-batches: :func:`open_batches` opens one data-parallel rank's
:class:`PackedBatches` for a role (``train`` or ``validation``): documents tokenized, each ended by EOS, packed back
to back into rows of ``seq_len`` (every token an input exactly once), ranks reading disjoint documents, unusable
documents skipped and counted by reason; ``state_dict`` / ``load_state_dict`` resume a stream exactly where it
stood.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import logging
import warnings
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import DataConfig
from ..hub import one_line
from .sources import DataError, datasets_library, describe, load_text_stream, read_rows, resolve_source
from .text import (COUNTED_REASONS, HELD_OUT, PIECE_CHARS, SKIP_REASONS, document_encoder, eos_id, next_piece,
                   text_digest, usable_text)

if TYPE_CHECKING:
    import datasets


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
        split = datasets_library().distributed.split_dataset_by_node
        self._source = split(source, rank=dp_rank if by_shard else 0, world_size=dp_world_size if by_shard else 1)
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
    """A row as its text, or the index in ``COUNTED_REASONS`` of why it is skipped."""
    value = row.get(text_field)
    text, reason = usable_text(value, min_chars)
    if reason is None and held_out and text_digest(text) in held_out:
        reason = HELD_OUT
    return text if reason is None else COUNTED_REASONS.index(reason)


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
        return COUNTED_REASONS if self._held_out else SKIP_REASONS

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
                    self._skipped[COUNTED_REASONS[doc]] += 1
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
        # Through numpy, which converts a list of ints several times faster than torch.tensor(list): a stream read
        # in a background thread holds the GIL against the training loop while it converts.
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
            stream = datasets_library().Dataset.from_dict({data.text_field: texts}).to_iterable_dataset()
        else:
            exclude = frozenset(text_digest(t) for t in texts)
    train = role == "train"
    return PackedBatches(stream, tokenizer, data.seq_len, micro_batch_size, dp_rank=dp_rank,
                         dp_world_size=dp_world_size, seed=seed, shuffle_buffer=data.shuffle_buffer if train else 0,
                         repeat=train, text_field=data.text_field, tokenize_batch=tokenize_batch,
                         min_chars=data.min_chars, source=f"{key}: {describe(source)}", held_out=exclude)


def open_replica_streams(data: DataConfig, tokenizer, micro_batch_size: int, replicas: int, seed: int,
                         tokenize_batch: int) -> list[PackedBatches]:
    """Each data-parallel replica's training stream (:func:`open_batches`) in one process, as the emulation reads
    them: what its reader process opens, so it takes only picklable arguments and lives in an importable module
    (a function of a ``python -m`` module's ``__main__`` does not unpickle in the reader)."""
    return [open_batches(data, "train", tokenizer, micro_batch_size, dp_rank=r, dp_world_size=replicas, seed=seed,
                         tokenize_batch=tokenize_batch) for r in range(replicas)]


def _first_texts(stream: datasets.IterableDataset, n: int, text_field: str, key: str) -> list:
    """The `text_field` values of the first `n` rows of `stream` in file order (the held-out documents)."""
    try:
        return [row.get(text_field) for row in itertools.islice(read_rows(stream), n)]
    except Exception as e:  # noqa: BLE001 - datasets/pyarrow errors rarely name the source
        raise DataError(f"{key}: reading the held-out documents failed ({one_line(e, 400)})") from None
