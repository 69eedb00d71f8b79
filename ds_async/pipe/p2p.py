"""Non-blocking point-to-point between neighbouring pipeline stages.

DeepSpeed's pipeline exchanges activations and gradients with blocking ``send``/``recv`` on one communicator per
pair of ranks. A stage that sends waits, on its compute stream, until the neighbour posts the matching receive,
and activations going down and gradients coming back between the same two stages queue behind each other, which
couples neighbouring stages step by step. Measured on 4x H200 (``launch/results/README.md``), this module does not
beat it: 2BW ran 1-3% slower with it at p = 4 (idle time fell on the middle stages only), so ``"p2p": "deepspeed"``
stays the default and this is kept as an option and a base for a better overlap.

Here each direction between two neighbours has its own process group (so its own NCCL communicator and stream).
Sends are posted and kept alive only until they complete; receives land in fresh tensors and make the compute
stream, not the host, wait for them. The host runs ahead and the GPUs follow the data. On gloo (CPU) a receive's
``wait`` blocks the host, which is still strictly less blocking than DeepSpeed's blocking sends, so any schedule
that runs under DeepSpeed's p2p runs here.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist


class NeighbourLinks:
    """This rank's four channels: activations to the next stage / from the previous one, gradients back.

    Every rank must construct it (``new_group`` is collective over the world, in the same order everywhere).
    ``pipelines`` lists the global ranks of each pipeline, stage by stage.
    """

    def __init__(self, pipelines: Sequence[Sequence[int]], rank: int):
        self.next = self.prev = None  # (peer rank, activation group, gradient group)
        for pipe in pipelines:
            for a, b in zip(pipe, pipe[1:]):
                activations, gradients = dist.new_group([a, b]), dist.new_group([a, b])
                if rank == a:
                    self.next = (b, activations, gradients)
                if rank == b:
                    self.prev = (a, activations, gradients)
        self._sends: deque[tuple[dist.Work, Sequence[torch.Tensor]]] = deque()

    # Activations travel on the first group of a pair, gradients on the second.
    def send_activations(self, tensors: Sequence[torch.Tensor]) -> None:
        peer, group, _ = self.next
        self._send(tensors, peer, group)

    def recv_activations(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        peer, group, _ = self.prev
        return self._recv(like, peer, group)

    def send_gradients(self, tensors: Sequence[torch.Tensor]) -> None:
        peer, _, group = self.prev
        self._send(tensors, peer, group)

    def recv_gradients(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        peer, _, group = self.next
        return self._recv(like, peer, group)

    def _send(self, tensors: Sequence[torch.Tensor], peer: int, group) -> None:
        while self._sends and self._sends[0][0].is_completed():
            self._sends.popleft()
        for t in tensors:
            t = t.contiguous()
            self._sends.append((dist.isend(t, peer, group=group), t))

    @staticmethod
    def _recv(like: Sequence[torch.Tensor], peer: int, group) -> list[torch.Tensor]:
        out = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in like]
        works = [dist.irecv(t, peer, group=group) for t in out]
        for w in works:
            w.wait()  # NCCL: the current stream waits; the host goes on
        return out

    def wait_sends(self) -> None:
        """Complete every posted send (before the pipeline is declared drained)."""
        while self._sends:
            self._sends.popleft()[0].wait()


class NonBlockingP2P:
    """PipelineEngine mixin: DeepSpeed's four p2p instructions over :class:`NeighbourLinks` when the engine has
    ``self.links``; DeepSpeed's own when ``links`` is None."""

    links: NeighbourLinks | None = None

    def _exec_send_activations(self, buffer_id):
        if self.links is None:
            return super()._exec_send_activations(buffer_id)
        outputs = self.pipe_buffers["outputs"][buffer_id]
        if self.first_output_send:  # shapes go once, on DeepSpeed's own channel
            self.first_output_send = False
            self._send_tensor_meta(outputs, self.next_stage)
        self.links.send_activations(_as_tuple(outputs))

    def _exec_recv_activations(self, buffer_id):
        if self.links is None:
            return super()._exec_recv_activations(buffer_id)
        if self.pipe_recv_buf is None:
            self.pipe_recv_buf = self._recv_tensor_meta(self.prev_stage)  # used as shape templates only
        received = self.links.recv_activations(_as_tuple(self.pipe_recv_buf))
        for t in received:
            t.requires_grad = t.is_floating_point()
        self.pipe_buffers["inputs"][buffer_id] = received[0] if torch.is_tensor(self.pipe_recv_buf) \
            else tuple(received)

    def _exec_send_grads(self, buffer_id):
        if self.links is None:
            return super()._exec_send_grads(buffer_id)
        inputs = _as_tuple(self.pipe_buffers["inputs"][buffer_id])
        self.links.send_gradients([t.grad for t in inputs if t.is_floating_point()])
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id):
        if self.links is None:
            return super()._exec_recv_grads(buffer_id)
        outputs = _as_tuple(self.pipe_buffers["outputs"][buffer_id])
        grads = self.links.recv_gradients([t for t in outputs if t.is_floating_point()])
        self.grad_layer = grads[0] if torch.is_tensor(self.pipe_buffers["outputs"][buffer_id]) else grads


def _as_tuple(x) -> tuple:
    return (x,) if torch.is_tensor(x) else tuple(x)
