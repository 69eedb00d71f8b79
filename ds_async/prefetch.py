"""Training batches read ahead of the step that uses them, and staged on the device in chunks.

:class:`Prefetcher` turns one or more micro-batch streams (``(inputs, labels)`` iterators with
``state_dict``/``load_state_dict``, such as :class:`ds_async.data.PackedBatches`) into steps: each step is the next
``per_step`` micro-batches of every stream, stream after stream (replica after replica, as the emulation and the
engine order them). Steps are read ``chunk`` at a time. On a GPU a reader process opens the streams and reads and
stacks the next chunks while the device trains; each chunk arrives through shared memory, is pinned and reaches
the device in one asynchronous copy, so the training loop never waits on the host for data. Without
``background`` a chunk is read when it is needed, in the caller's thread: the same steps in the same order.

Why a process and not a thread: reading holds the GIL between tokenizer calls (datasets' rows, token lists), and
a training loop that launches kernels releases and retakes it at every op, so a reading thread stalls it at each
one, and a reading process does not (the CHANGELOG and ``launch/bench/RESULTS.md`` have the measurements).

Position: :meth:`state_dict` is the streams' states at the start of the chunk being consumed plus the steps of it
consumed since; :meth:`load_state_dict` (before the first step) restores the streams and skips those steps, so a
resumed run reads exactly the steps the interrupted one would have read next. :attr:`skipped` counts the documents
the streams skipped up to the end of the chunk being consumed, whatever the reader has read beyond it.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import multiprocessing
import multiprocessing.util
import os
import pickle
import queue
import sys
from collections.abc import Callable, Sequence

import torch
import torch.multiprocessing  # noqa: F401 - registers the reductions that pass tensors through shared memory

Streams = Sequence | Callable[[], Sequence]


def read_chunk(streams: Sequence, per_step: int, steps: int):
    """The streams' states; ``steps`` steps of micro-batches stacked as ``[steps, per_step * streams, micro_batch,
    seq_len]`` inputs and labels; the streams' skipped-document counts after them."""
    states = [s.state_dict() for s in streams]
    xs, ys = [], []
    for _ in range(steps):
        for stream in streams:
            for _ in range(per_step):
                x, y = next(stream)
                xs.append(x)
                ys.append(y)
    shape = (steps, per_step * len(streams), *xs[0].shape)
    skipped = [dict(getattr(s, "skipped", {})) for s in streams]
    return states, torch.stack(xs).view(shape), torch.stack(ys).view(shape), skipped


def open_streams(streams: Streams, states: list[dict] | None) -> list:
    """``streams`` (opened first if it is a function), restored to ``states`` when given."""
    streams = list(streams() if callable(streams) else streams)
    if states is not None:
        for stream, state in zip(streams, states, strict=True):
            stream.load_state_dict(state)
    return streams


def _serve(imports: tuple[str, ...], work, out, stop, ready) -> None:
    """A :class:`ReaderProcess`: imports ``imports``, sets ``ready``, waits for :func:`_read`'s first arguments on
    ``work`` (None: not needed after all), then reads."""
    parent = multiprocessing.parent_process()
    for name in imports:
        importlib.import_module(name)
    ready.set()
    while True:
        try:
            args = work.get(timeout=0.5)
            break
        except queue.Empty:
            if stop.is_set() or (parent is not None and not parent.is_alive()):
                args = None
                break
    if args is None:
        os._exit(0)
    _read(*args, out, stop)


def _read(streams: Streams, states, per_step: int, chunk: int, left: int | None, out, stop) -> None:
    """The reader process: opens the streams and puts chunks of ``chunk`` steps (``left`` in all; None: no end)
    into ``out`` until done or ``stop``; an exception instead of a chunk if reading fails. It then waits for
    ``stop``: a chunk's tensors travel as file descriptors this process hands over when they are unpickled, so it
    must outlive their reception. A consumer killed without a word (SIGKILL) counts as ``stop``: the reader ends
    instead of waiting for it forever."""
    parent = multiprocessing.parent_process()

    def stopped() -> bool:
        return stop.is_set() or (parent is not None and not parent.is_alive())

    try:
        torch.set_num_threads(1)
        streams = open_streams(streams, states)
        while not stopped() and (left is None or left > 0):
            n = chunk if left is None else min(chunk, left)
            item = read_chunk(streams, per_step, n)
            if left is not None:
                left -= n
            while not stopped():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
    except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it in its own process
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:  # noqa: BLE001 - one the consumer could not rebuild; the queue would fail in its own thread
            e = RuntimeError(f"{type(e).__name__}: {e}")
        out.put(e)
    while not stop.wait(timeout=0.5) and not stopped():
        pass
    out.cancel_join_thread()  # chunks still queued are not wanted once stopped: exit without flushing them
    for stream in streams if isinstance(streams, list) else ():
        if hasattr(stream, "close"):
            stream.close()
    # Straight out, without the interpreter's exit: ds_async.data's exit handler would wait out the grace period
    # that arrow's reader threads of an open stream need before teardown (the streams are closed above), and the
    # consumer's close() waits for this process.
    multiprocessing.util._exit_function()  # what a process's own end runs: finalizers (its semaphores), children
    os._exit(0)


def reads_in_background(mode: str, device: torch.device) -> bool:
    """Whether a job reads its training stream in a reader process: ``performance.data_reader`` ``mode`` is
    ``process``, or ``auto`` on a GPU (on a CPU the process would take cores from the training)."""
    return mode == "process" or (mode == "auto" and device.type == "cuda")


@contextlib.contextmanager
def _main_hidden():
    """A spawned child imports its parent's ``__main__`` (as ``__mp_main__``) before it runs its target, so that
    functions defined there unpickle; a reader's target and streams live in importable modules, and a training
    script's own imports (deepspeed, transformers: the parent's whole start-up) would delay the reader's first
    chunk by as long. Hidden while the child is started (its start reads them), restored after."""
    main = sys.modules["__main__"]
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


class ReaderProcess:
    """A spawned reader process, started before its streams are known: it imports ``imports`` (the modules that
    unpickling and opening its streams need) while the caller builds the rest, then waits for :meth:`begin`. A fresh
    interpreter spends seconds on imports alone (torch, datasets, transformers), which a process spawned at the
    first step makes the first step wait for. It does not import the parent's ``__main__`` (:func:`_main_hidden`):
    what it is given to read cannot be defined there. ``depth``: chunks read ahead."""

    def __init__(self, imports: Sequence[str] = (), depth: int = 2):
        ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold CUDA and datasets' threads
        self.queue, self.stop = ctx.Queue(maxsize=depth), ctx.Event()
        self._work = ctx.Queue(maxsize=1)
        self.ready = ctx.Event()  # set once its imports are done: it waits for its streams from then on
        self.begun = False
        self.states: list[dict] | None = None  # the streams' states it was begun at (None: where they open)
        self.process = ctx.Process(target=_serve, name="ds_async-prefetch", daemon=True,
                                   args=(tuple(imports), self._work, self.queue, self.stop, self.ready))
        with _main_hidden():
            self.process.start()

    def begin(self, streams: Streams, states: list[dict] | None, per_step: int, chunk: int,
              left: int | None) -> None:
        """Read ``chunk`` steps at a time (``left`` in all) from ``streams`` restored to ``states`` into
        :attr:`queue`: :func:`_read`'s arguments."""
        if self.begun:
            raise RuntimeError("ReaderProcess.begin: it reads one set of streams")
        self._work.put((streams, states, per_step, chunk, left))
        self.begun, self.states = True, states

    def close(self) -> None:
        """Stop it (at its next chunk, or while it waits for work) and wait for its end, terminating it after 5 s;
        one still importing, never given work, is terminated at once (it would see the stop only after its imports);
        once."""
        if self.stop.is_set():
            return
        self.stop.set()
        if not self.begun and not self.ready.is_set():
            self.process.terminate()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join()
        self.queue.close()
        self._work.close()


class Prefetcher:
    """Steps of ``per_step`` micro-batches from each of ``streams``, on ``device``. ``streams``: the streams, or a
    function that opens them (a reader process calls it, so it must pickle; the streams themselves pickle into the
    reader otherwise); ``steps``: how many will be taken (None: no end), so that nothing past the run's last step is
    read; ``chunk`` steps are read and copied at a time; ``background``: read in a process (default: on a GPU);
    ``depth``: chunks read ahead; ``reader``: a :class:`ReaderProcess` started earlier, to read with (its own
    depth then applies)."""

    def __init__(self, streams: Streams, per_step: int, device: torch.device, steps: int | None = None,
                 chunk: int = 16, background: bool | None = None, depth: int = 2,
                 reader: ReaderProcess | None = None):
        self.per_step, self.device, self.chunk = per_step, device, max(1, chunk)
        self.background = device.type == "cuda" if background is None else background
        self.depth = depth
        self._source = streams
        self._left = steps  # steps still to read from the streams
        self._loaded: list[dict] | None = None  # states given to load_state_dict, applied when the streams open
        self._streams: list | None = None  # the streams, when read in this process
        self._states: list[dict] | None = None  # the streams' states at the start of the current chunk
        self._skipped: list[dict] = []
        self._steps: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._used = 0
        self._skip = 0
        self._reader = reader  # given, or started at the first step; reading once it has begun
        if not self.background:  # opened now, so that a stream that cannot be opened fails here, not at step 1
            self._streams = open_streams(streams, None)

    # -- reading -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the reader process now rather than at the first step (nothing to do without ``background``)."""
        if self.background and not self._reading():
            self._start()

    def _reading(self) -> bool:
        return self._reader is not None and self._reader.begun

    def _start(self) -> None:
        if self._reader is None:
            self._reader = ReaderProcess(depth=self.depth)
        self._reader.begin(self._source, self._loaded, self.per_step, self.chunk, self._left)

    def _take(self):
        """The next chunk's item: read here, or the reader's next (it reads the same chunk sizes)."""
        n = self.chunk if self._left is None else min(self.chunk, self._left)
        if n <= 0:
            raise RuntimeError("Prefetcher: every step it was built for has been taken")
        if self.background and not self._reading():
            self._start()  # before counting this chunk: the reader reads all that is left
        if self._left is not None:
            self._left -= n
        if not self.background:
            return read_chunk(self._streams, self.per_step, n)
        while True:
            try:
                item = self._reader.queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._reader.process.is_alive():
                    raise RuntimeError(f"Prefetcher: the reader process died (exit code "
                                       f"{self._reader.process.exitcode})") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def _next_chunk(self) -> None:
        states, x, y, skipped = self._take()
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self._states, self._skipped = states, skipped
        self._steps = [list(zip(x[k].unbind(0), y[k].unbind(0))) for k in range(x.shape[0])]
        self._used = 0

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The next step's micro-batches, on the device."""
        while True:
            if self._used == len(self._steps):
                self._next_chunk()
            step = self._steps[self._used]
            self._used += 1
            if self._skip:
                self._skip -= 1
                continue
            return step

    @property
    def skipped(self) -> dict[str, int]:
        """Documents the streams skipped, by reason, up to the end of the chunk being consumed."""
        out: dict[str, int] = {}
        for counts in self._skipped:
            for reason, n in counts.items():
                out[reason] = out.get(reason, 0) + n
        return out

    # -- position --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the next step comes from (plain data, ``torch.load(weights_only=True)``-safe); ``streams`` is None
        for a reader's streams that have not been read yet and were given no state (they start where they open)."""
        if self._states is not None:
            return {"streams": self._states, "skip": self._used}
        if self._streams is not None:
            return {"streams": [s.state_dict() for s in self._streams], "skip": self._skip}
        return {"streams": self._loaded, "skip": self._skip}

    def load_state_dict(self, state: dict, steps: int | None = None) -> None:
        """Continue from ``state``; ``steps``: how many will be taken from there (None: the constructor's)."""
        if self._states is not None:
            raise RuntimeError("Prefetcher.load_state_dict: load before the first step")
        if self._reading() and self._reader.states != state["streams"]:  # a reader begun at this position is kept
            raise RuntimeError("Prefetcher.load_state_dict: its reader process reads from "
                               + ("the stream's start" if self._reader.states is None else "another position"))
        if self._streams is not None:  # read in this process: restore them now
            self._streams = open_streams(self._streams, state["streams"])
        else:
            self._loaded = state["streams"]
        self._skip = state["skip"]
        if steps is not None:
            self._left = steps
        if self._left is not None:  # the chunk's first steps are read again, then skipped
            self._left += self._skip

    def close(self) -> None:
        """Stop reading: close the streams read in this process (those with a ``close``), or stop the reader
        process (it exits at its next chunk, or is terminated), or the one given that never began."""
        for stream in self._streams or ():
            if hasattr(stream, "close"):
                stream.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None


def _as_streams(opener: Callable) -> list:
    return [opener()]


def _one_stream(opener: Callable) -> Callable[[], list]:
    """What a :class:`MicroBatchReader`'s reader process opens: ``opener``'s stream alone (one micro-batch a step)."""
    return functools.partial(_as_streams, opener)


class MicroBatchReader:
    """One rank's training micro-batches for the engine (an iterator of ``(inputs, labels)`` on ``device``), read
    ahead by a :class:`Prefetcher` over one stream at micro-batch granularity.

    ``stream``: the rank's stream, already opened in this process (a :class:`ds_async.data.PackedBatches`): the
    trainer's start-up checks read from it (``peek``, ``documents``, ``skipped``) and a checkpoint's position is
    loaded into it. ``opener``: a picklable function that opens the same stream afresh, for a reader process.
    :meth:`start` hands the stream's exact position over: with ``background`` a reader process opens the stream,
    restores that position and tokenizes and packs ``chunk`` micro-batches at a time while the device trains (the
    stream opened here is closed); without it the stream is read here, one micro-batch at a time, as before. On a
    GPU each chunk arrives pinned and is copied asynchronously, so taking a micro-batch never waits for the device.

    Position: :meth:`state_dict` is the stream's ``state_dict`` at the start of the chunk being consumed plus
    ``skip``, the micro-batches of it consumed since; :meth:`load_state_dict` takes that or a plain stream state
    (``skip`` 0), so checkpoints of either kind resume exactly. :attr:`skipped` counts the documents skipped up to
    the end of the chunk being consumed. ``reader``: a :class:`ReaderProcess` started earlier, for ``background``;
    one that :meth:`begin_at` set reading already, for a stream then given the same position or none."""

    def __init__(self, stream, opener: Callable, device: torch.device, chunk: int = 1, background: bool = False,
                 reader: ReaderProcess | None = None):
        self._stream, self._opener, self.device = stream, opener, device
        self.chunk, self.background = max(1, chunk), background
        self._reader = reader  # handed to the Prefetcher at start
        self._loaded: dict | None = None  # a state given before start
        self._prefetcher: Prefetcher | None = None

    @staticmethod
    def begin_at(reader: ReaderProcess, opener: Callable, chunk: int, position: dict | None = None) -> None:
        """Have ``reader`` read ``opener``'s stream from ``position`` (a :meth:`state_dict`; None: where the stream
        opens), ``chunk`` micro-batches at a time, before the MicroBatchReader over them exists: a run knows its
        position before anything is built (a fresh run's is the start, a resumed one's is in its checkpoint), so its
        first chunk is read while the model builds instead of after the set-up. The MicroBatchReader then given
        ``reader`` (with the same ``opener`` and ``chunk``) reads on from it, given the same position or none."""
        streams = None
        if position is not None:
            position = dict(position)
            position.pop("skip", None)  # the micro-batches of the chunk to pass over: the MicroBatchReader's count
            streams = [position]
        reader.begin(_one_stream(opener), streams, 1, max(1, chunk), None)

    # -- before start: the stream opened here ------------------------------------------------------------------------
    def peek(self) -> None:
        self._stream.peek()

    @property
    def documents(self) -> int:
        return self._stream.documents

    def load_state_dict(self, state: dict) -> None:
        if self._prefetcher is not None:
            raise RuntimeError("MicroBatchReader.load_state_dict: load before the first micro-batch")
        state = dict(state)
        skip = state.pop("skip", 0)
        self._stream.load_state_dict(state)
        self._loaded = {"streams": [state], "skip": skip}

    def start(self) -> None:
        """Hand the stream's position to the reader (a process with ``background``) unless it reads from there already
        (:meth:`begin_at`); idempotent."""
        if self._prefetcher is not None:
            return
        state = self._loaded or {"streams": [self._stream.state_dict()], "skip": 0}
        reading = self._reader is not None and self._reader.begun
        if reading and not self.background:
            raise RuntimeError("MicroBatchReader: its reader process reads already; it cannot be read in place")
        if reading and self._loaded is None and self._reader.states is not None:
            raise RuntimeError("MicroBatchReader: its reader process reads from a position this reader was not given")
        if self.background:
            if hasattr(self._stream, "close"):
                self._stream.close()
            self._prefetcher = Prefetcher(_one_stream(self._opener), 1, self.device, chunk=self.chunk,
                                          background=True, reader=self._reader)
        else:
            self._prefetcher = Prefetcher([self._stream], 1, self.device, chunk=self.chunk, background=False,
                                          reader=self._reader)
        self._reader = None
        # A stream read here stands at the chunk's start already; a reader begun already checks it reads from there.
        if (self.background and (self._loaded is not None or not reading)) or state["skip"]:
            self._prefetcher.load_state_dict(state)
        self._prefetcher.start()  # a reader process reads from now on, not from the first micro-batch

    # -- reading -----------------------------------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.start()
        return self._prefetcher.next_step()[0]

    @property
    def skipped(self) -> dict[str, int]:
        return self._stream.skipped if self._prefetcher is None else self._prefetcher.skipped

    def state_dict(self) -> dict:
        if self._prefetcher is None:
            return self._stream.state_dict() if self._loaded is None else {**self._loaded["streams"][0],
                                                                           "skip": self._loaded["skip"]}
        state = self._prefetcher.state_dict()
        if state["streams"] is None:  # read from the stream's start, nothing taken yet: the same data as from here
            return {**self._stream.state_dict(), "skip": 0}
        return {**state["streams"][0], "skip": state["skip"]}

    def close(self) -> None:
        """Stop reading (the reader process too, or the one given if reading never started) and close the stream
        opened here."""
        if self._prefetcher is not None:
            self._prefetcher.close()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if hasattr(self._stream, "close"):
            self._stream.close()
