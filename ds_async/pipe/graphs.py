"""CUDA graphs of a pipeline stage's forward and backward passes (``performance.cuda_graphs``).

A stage of small layers costs the host longer to issue a pass (Python, guards, dispatch, one launch per kernel)
than the GPU takes to run it; a replayed CUDA graph issues the whole pass with one launch. ``GraphedStage(layers,
run)`` is called as ``run(x)`` is, under autograd, and returns what ``run(x)`` returns, computed by a replay.

A graph replays fixed addresses, and a flush-free stage breaks both assumptions a single graph would make: its
parameters change (2BW swaps one of two weight slots into the module for each forward:
:class:`~ds_async.pipe.versions.WeightVersions`) and several micro-batches are in flight at once (1F1B keeps up to
``p`` forwards waiting for their backward, each holding its activations). So a stage holds *instances*, each a
forward graph and a backward graph captured together, as ``torch.cuda.make_graphed_callables`` captures them, with
their own memory pool: its input, output, saved activations and parameter gradients. Instances are grouped by the parameters they
were captured on (their addresses: one group per weight slot) and the inputs' signature. A forward takes a free
instance of its group, capturing a new one when all are taken; an instance is free again once its backward has
started or its output's autograd graph is gone (an evaluation forward). A group grows to the number of
micro-batches the schedule keeps in flight on that slot and no further.

Exactness: a replay runs the kernels the capture recorded, on the same values, so each pass computes the bits the
ungraphed pass computes; gradients reach the parameters' ``.grad`` (and any hook on them) through autograd's
accumulation, outside the graphs, in the same order. The copies in and out of an instance's buffers are exact.
(``make_graphed_callables`` itself is not used: it hands its own gradient buffers to autograd, which keeps a
first gradient as the parameter's ``.grad``, so a second micro-batch's replay would overwrite an accumulating
gradient.)

What stays outside the graphs, and why: the loss (the last stage's labels arrive per micro-batch from the data
path; it is one small compiled call), p2p sends and receives (NCCL calls DeepSpeed issues between passes, each
with its own synchronisation), the optimizer step and everything at the batch boundary, and gradient
accumulation into ``.grad`` (it must follow autograd's first-assign-then-add rule to stay bit-equal). Not
graphable: a stage that recomputes activations in its backward (the recomputation would run outside the
replayed backward) and a model with dropout (random masks would be replayed): the config refuses both.
"""
from __future__ import annotations

import gc
import itertools
import weakref
from typing import Callable, Sequence

import torch
import torch.utils._pytree
from torch import nn


class GraphedStage:
    def __init__(self, layers: Sequence[nn.Module], run: Callable, max_instances: int = 16):
        self.layers = list(layers)
        self.run = run
        self.max_instances = max_instances
        self.groups: dict[tuple, list[_Instance]] = {}

    @property
    def captured(self) -> int:
        """How many instances (forward + backward graph pairs) have been captured."""
        return sum(len(group) for group in self.groups.values())

    def __call__(self, x):
        inputs = x if isinstance(x, tuple) else (x,)
        key = (tuple(p.data_ptr() for layer in self.layers for p in layer.parameters()), _signature(inputs))
        group = self.groups.setdefault(key, [])
        instance = _free(group)
        if instance is None and len(group) >= self.max_instances:
            gc.collect()  # an autograd graph kept alive only by a reference cycle still holds its instance
            instance = _free(group)
            if instance is None:
                raise RuntimeError(f"{len(group)} graphed forwards of this stage are waiting for their backward; a "
                                   "pipeline schedule keeps at most its number of stages in flight")
        if instance is None:
            instance = _Instance(self.layers, self.run, inputs)
            group.append(instance)
        return instance(inputs)


def _signature(inputs: tuple) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) if torch.is_tensor(t) else type(t) for t in inputs)


def _free(group: list[_Instance]) -> _Instance | None:
    return next((instance for instance in group if instance.lease is None), None)


class _Lease:
    """One forward's hold on an instance; the instance is free again when the lease is returned or collected."""
    __slots__ = ("__weakref__",)


class _Instance:
    """A forward graph and a backward graph captured on one weight slot, with their memory pool and buffers."""
    _ids = itertools.count()

    def __init__(self, layers: Sequence[nn.Module], run: Callable, inputs: tuple, warmup: int = 3):
        self.params = tuple(p for layer in layers for p in layer.parameters())
        self.inputs = tuple(t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
                            for t in inputs)
        self.wrt = tuple(t for t in self.inputs + self.params if torch.is_tensor(t) and t.requires_grad)
        forward = (lambda: run(self.inputs[0] if len(self.inputs) == 1 else self.inputs))
        # Lazy initialisation (compilation, cuBLAS and cuDNN plans, autotuning) happens outside the capture.
        torch.cuda.synchronize()
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(warmup):
                outs = [o for o in torch.utils._pytree.tree_leaves(forward()) if o.requires_grad]
                torch.autograd.grad(outs, self.wrt, [torch.empty_like(o) for o in outs], allow_unused=True)
            del outs
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool):
            outputs = forward()
        self.outputs, self.spec = torch.utils._pytree.tree_flatten(outputs)
        self.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in self.outputs]
        with torch.cuda.graph(self.backward_graph, pool=pool):
            self.grads = torch.autograd.grad([o for o in self.outputs if o.requires_grad], self.wrt,
                                             [g for g in self.grad_outputs if g is not None], allow_unused=True)
        self.lease: int | None = None

    def __call__(self, inputs: tuple):
        with torch.no_grad():
            for static, given in zip(self.inputs, inputs):
                if torch.is_tensor(static) and static.data_ptr() != given.data_ptr():
                    static.copy_(given)
        lease_id = next(self._ids)
        self.lease = lease_id
        lease = _Lease()
        weakref.finalize(lease, self.release, lease_id)
        outs = _Replay.apply(self, lease_id, lease, *inputs, *self.params)
        return torch.utils._pytree.tree_unflatten(list(outs), self.spec)

    def release(self, lease_id: int) -> None:
        if self.lease == lease_id:  # a lease returned by its backward is not returned again when collected
            self.lease = None


class _Replay(torch.autograd.Function):
    """The instance's forward graph, whose backward is its backward graph. The context holds the lease: the
    backward returns it (autograd is then inside this micro-batch's backward, which reads the instance's buffers
    before any later forward could replay it), and an output whose graph is dropped without a backward (an
    evaluation) returns it when collected."""

    @staticmethod
    def forward(ctx, instance: _Instance, lease_id: int, lease: _Lease, *inputs_and_params):
        ctx.instance, ctx.lease_id, ctx.lease = instance, lease_id, lease
        n = len(instance.inputs)
        # (tensor, is a parameter) for each position, None where no gradient is wanted
        ctx.targets = [(t, i >= n) if torch.is_tensor(t) and t.requires_grad else None
                       for i, t in enumerate(inputs_and_params)]
        instance.forward_graph.replay()
        outs = tuple(o.detach() for o in instance.outputs)
        ctx.mark_non_differentiable(*(o for o, s in zip(outs, instance.outputs) if not s.requires_grad))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        instance = ctx.instance
        instance.release(ctx.lease_id)
        for static, grad in zip(instance.grad_outputs, grads):
            if static is not None:
                static.copy_(grad) if grad is not None else static.zero_()
        instance.backward_graph.replay()
        computed = iter(instance.grads)
        out = [None if target is None else _handed_over(*target, next(computed)) for target in ctx.targets]
        return (None, None, None, *out)


def _handed_over(target: torch.Tensor, is_param: bool, grad: torch.Tensor | None) -> torch.Tensor | None:
    """What autograd receives for ``target``. It keeps a leaf's first gradient as the leaf's ``.grad`` and adds
    later ones in place, and a stage's input gradient is sent to the previous stage after this backward: the
    instance's own buffer (overwritten by its next replay) is handed over only to be added into a parameter's
    existing ``.grad``; otherwise a copy."""
    if grad is None:
        return None
    return grad if is_param and target.grad is not None else grad.clone()
