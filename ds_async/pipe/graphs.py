"""CUDA graphs of a pipeline stage's forward and backward passes (``performance.cuda_graphs``).

A stage of small layers costs the host longer to issue a pass (Python, guards, dispatch, one launch per kernel)
than the GPU takes to run it; a replayed CUDA graph issues the whole pass with one launch. ``GraphedStage(layers,
run)`` is called as ``run(x)`` is, under autograd, and returns what ``run(x)`` returns, computed by a replay.

A graph replays fixed addresses, and a flush-free stage breaks both assumptions a single graph would make: its
parameters change (2BW swaps one of two weight slots into the module for each forward:
:class:`~ds_async.pipe.versions.WeightVersions`) and several micro-batches are in flight at once (1F1B keeps up to
``p`` forwards waiting for their backward, each holding its activations). So a stage holds *instances*, each a
forward graph and a backward graph captured together (``torch.cuda.make_graphed_callables``) with their own memory
pool: its input, output, saved activations and parameter gradients. Instances are grouped by the parameters they
were captured on (their addresses: one group per weight slot) and the inputs' signature. A forward takes a free
instance of its group, capturing a new one when all are taken; an instance is free again once its backward has
started or its output's autograd graph is gone (an evaluation forward). A group grows to the number of
micro-batches the schedule keeps in flight on that slot and no further.

Exactness: a replay runs the kernels the capture recorded, on the same values, so each pass computes the bits the
ungraphed pass computes; gradients reach the parameters' ``.grad`` (and any hook on them) through autograd's
accumulation, outside the graphs, in the same order. The copies in and out of an instance's buffers are exact.

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
        out = instance(inputs)
        return out[0] if not isinstance(x, tuple) and len(out) == 1 else out


def _signature(inputs: tuple) -> tuple:
    return tuple((tuple(t.shape), t.dtype, t.requires_grad) if torch.is_tensor(t) else type(t) for t in inputs)


def _free(group: list[_Instance]) -> _Instance | None:
    return next((instance for instance in group if instance.lease is None), None)


class _Layers(nn.Module):
    """``run`` over ``layers`` as a module: ``make_graphed_callables`` captures a module's parameters as they are
    at capture time, which here is the weight slot swapped in."""

    def __init__(self, layers: Sequence[nn.Module], run: Callable):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self._run = run

    def forward(self, *inputs):
        return self._run(inputs[0] if len(inputs) == 1 else inputs)


class _Lease:
    """One forward's hold on an instance; the instance is free when the lease is returned or collected."""
    __slots__ = ("__weakref__",)


class _Instance:
    _ids = itertools.count()

    def __init__(self, layers: Sequence[nn.Module], run: Callable, inputs: tuple):
        sample = tuple(t.detach().clone().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t
                       for t in inputs)
        self.graphed = torch.cuda.make_graphed_callables(_Layers(layers, run), sample, allow_unused_input=True)
        self.lease: int | None = None

    def __call__(self, inputs: tuple) -> tuple:
        lease_id = next(self._ids)
        self.lease = lease_id
        out = self.graphed(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        lease = _Lease()
        weakref.finalize(lease, self.release, lease_id)
        return _Release.apply(self, lease_id, lease, *outs)

    def release(self, lease_id: int) -> None:
        if self.lease == lease_id:  # a lease returned by its backward is not returned again when collected
            self.lease = None


class _Release(torch.autograd.Function):
    """Identity on the instance's outputs whose backward frees the instance: by then autograd is inside this
    micro-batch's backward, which reads the instance's buffers before any later forward could replay it. Its
    context holds the lease, so an output whose graph is dropped without a backward frees the instance too."""

    @staticmethod
    def forward(ctx, instance: _Instance, lease_id: int, lease: _Lease, *outs):
        ctx.instance, ctx.lease_id, ctx.lease = instance, lease_id, lease
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.instance.release(ctx.lease_id)
        return (None, None, None, *grads)
