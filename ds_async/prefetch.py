"""Training batches read ahead of the step that uses them, and staged on the device in chunks.

:class:`Prefetcher` turns one or more micro-batch streams (``(inputs, labels)`` iterators with
``state_dict``/``load_state_dict``, such as :class:`ds_async.data.PackedBatches`) into steps: each step is the next
``per_step`` micro-batches of every stream, stream after stream (replica after replica, as the emulation and the
engine order them). Steps are read ``chunk`` at a time; on a GPU a background thread reads and stacks the next
chunks into pinned memory while the device trains (the tokenizer releases the GIL), and each chunk reaches the
device in one asynchronous copy, so the training loop never waits on the host for data. Without ``background``
a chunk is read when it is needed, in the caller's thread: the same steps in the same order.

Position: :meth:`state_dict` is the streams' states at the start of the chunk being consumed plus the steps of it
consumed since; :meth:`load_state_dict` (before the first step) restores the streams and skips those steps, so a
resumed run reads exactly the steps the interrupted one would have read next.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch


class Prefetcher:
    """Steps of ``per_step`` micro-batches from each of ``streams``, on ``device``; ``steps``: how many will be
    taken (None: no end), so that nothing past the run's last step is read; ``chunk`` steps are read and copied at a
    time; ``background``: read in a thread (default: on a GPU); ``depth``: chunks read ahead."""

    def __init__(self, streams: Sequence, per_step: int, device: torch.device, steps: int | None = None,
                 chunk: int = 16, background: bool | None = None, depth: int = 2):
        self.streams, self.per_step, self.device, self.chunk = list(streams), per_step, device, max(1, chunk)
        self._left = steps  # steps still to read from the streams
        self.background = device.type == "cuda" if background is None else background
        self.depth = depth
        self._states: list[dict] | None = None  # the streams' states at the start of the current chunk
        self._steps: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        self._used = 0
        self._skip = 0
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- reading -------------------------------------------------------------------------------------------------
    def _read_chunk(self) -> tuple[list[dict], torch.Tensor, torch.Tensor]:
        """The streams' states, then ``chunk`` steps of micro-batches stacked as ``[steps, per_step * streams,
        micro_batch, seq_len]`` inputs and labels (pinned when the device is a GPU)."""
        states = [s.state_dict() for s in self.streams]
        n = self.chunk if self._left is None else min(self.chunk, self._left)
        if n <= 0:
            raise RuntimeError("Prefetcher: every step it was built for has been taken")
        if self._left is not None:
            self._left -= n
        xs, ys = [], []
        for _ in range(n):
            for stream in self.streams:
                for _ in range(self.per_step):
                    x, y = next(stream)
                    xs.append(x)
                    ys.append(y)
        shape = (n, self.per_step * len(self.streams), *xs[0].shape)
        x, y = torch.stack(xs).view(shape), torch.stack(ys).view(shape)
        if self.device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return states, x, y

    def _produce(self) -> None:
        try:
            while not self._stop.is_set() and (self._left is None or self._left > 0):
                item = self._read_chunk()
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it in its own thread
            self._queue.put(e)

    def _next_chunk(self) -> None:
        if self.background:
            if self._thread is None:
                self._queue = queue.Queue(maxsize=self.depth)
                self._thread = threading.Thread(target=self._produce, name="ds_async-prefetch", daemon=True)
                self._thread.start()
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
        else:
            item = self._read_chunk()
        states, x, y = item
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        self._states = states
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

    # -- position --------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where the next step comes from (plain data, ``torch.load(weights_only=True)``-safe)."""
        if self._states is None:  # nothing read yet: the streams stand where they were built
            return {"streams": [s.state_dict() for s in self.streams], "skip": self._skip}
        return {"streams": self._states, "skip": self._used}

    def load_state_dict(self, state: dict) -> None:
        if self._states is not None or self._thread is not None:
            raise RuntimeError("Prefetcher.load_state_dict: load before the first step")
        for stream, s in zip(self.streams, state["streams"], strict=True):
            stream.load_state_dict(s)
        self._skip = state["skip"]
        if self._left is not None:
            self._left += self._skip

    def close(self) -> None:
        """Stop the background thread (it may be blocked reading; it exits at its next chunk)."""
        self._stop.set()
        if self._queue is not None:
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
