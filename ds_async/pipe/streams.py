"""The CUDA streams of one flush-free pipeline stage; on CPU every method is a no-op.

The forward and backward passes (and their p2p) run on a high-priority *compute* stream, so that the *side*
stream's kernels take only the SMs the passes leave free (their tails, the waits for neighbours). The batch
boundary (gradient hand-over, reduce, norm) and the optimizer step run on the side stream: with blocking p2p,
work on the compute stream would stall every neighbour once per stage per batch. Forwards never read the
optimizer's master weights, so only the first forward on a version that a step publishes waits for that step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch


class StageStreams:
    def __init__(self, enabled: bool):
        self.side = torch.cuda.Stream() if enabled else None
        self.compute = torch.cuda.Stream(priority=-1) if enabled else None
        self._published: dict[int, torch.cuda.Event] = {}  # version -> event on the side stream, not yet waited for

    @contextmanager
    def computing(self):
        """Run on the compute stream, ordered after the caller's stream on entry and before it on exit (GPU-side
        waits only), so what the caller does between calls (a loss ``.item()``, a checkpoint) sees finished work."""
        if self.compute is None:
            yield
            return
        caller = torch.cuda.current_stream()
        self.compute.wait_stream(caller)
        try:
            with torch.cuda.stream(self.compute):
                yield
        finally:
            caller.wait_stream(self.compute)

    @contextmanager
    def on_side(self, after_current: bool = True, keep: list[torch.Tensor] = ()):
        """Queue the enclosed work on the side stream (behind what is queued there), after the current stream's
        work when ``after_current``; ``keep``: tensors made on the current stream whose memory must outlive the
        side stream's reads of them."""
        if self.side is None:
            yield
            return
        if after_current:
            self.side.wait_stream(torch.cuda.current_stream())
        for t in keep:
            t.record_stream(self.side)
        with torch.cuda.stream(self.side):
            yield

    def published(self, version: int) -> None:
        """Mark ``version`` as being written by the side stream's work queued so far."""
        if self.side is not None:
            self._published[version] = torch.cuda.Event()
            self._published[version].record(self.side)

    def wait_for_version(self, version: int) -> None:
        """Make the current stream wait until ``version`` is written (once per version)."""
        ready = self._published.pop(version, None)
        if ready is not None:
            torch.cuda.current_stream().wait_event(ready)

    def wait_for_side(self) -> None:
        """Order the current stream after everything queued on the side stream."""
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
            self._published.clear()


def to_device(x, device):
    """``x`` (a tensor or nested tuple of them) on ``device`` through pinned memory, without the host waiting:
    DeepSpeed's ``.to(device)`` from pageable memory makes the host wait for the GPU, so it could never run ahead,
    which flush-free schedules rely on."""
    if torch.is_tensor(x):
        return x if x.device == device else x.pin_memory().to(device, non_blocking=True)
    return type(x)(to_device(y, device) for y in x)
