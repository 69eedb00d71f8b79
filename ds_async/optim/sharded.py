"""Tensor-granular ZeRO-1: optimizer state sharded across data-parallel ranks by whole parameters.

DeepSpeed's ZeRO-1 flattens each param group and hands every rank a 1-D slice, which elementwise optimizers
accept and matrix optimizers (Muon) cannot. :class:`ShardedOptimizer` instead gives every parameter to one owner
rank: only the owner keeps its optimizer state (and delay-correction buffer) and computes its update; the owner
then broadcasts the new values. Memory for state is ~1/world of the unsharded optimizer (balance permitting: a
parameter is never split), communication is one broadcast of every parameter per step, the same volume as
ZeRO-1's all-gather.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .optimizers import UpdateOptimizer, finish_stats, stack_sums


def partition_params(params: Sequence[Tensor], world: int) -> list[int]:
    """The owner rank of each parameter: largest first (ties: earlier first), each to the rank holding the fewest
    elements so far (ties: lowest rank). Depends only on shapes and order, so every rank computes the same."""
    load = [0] * world
    owners = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += params[i].numel()
    return owners


class ShardedOptimizer(torch.optim.Optimizer):
    """Run ``optimizer`` on this rank's share of the parameters and broadcast the results.

    ``param_groups`` is the wrapped optimizer's (every parameter, so LR schedulers and DeepSpeed see them all);
    ``state`` and ``state_dict()`` hold only the owned parameters' state (this rank's shard: save one per rank).
    Gradients must already be averaged over ``group`` when :meth:`step` runs; non-owned gradients are ignored.

    Args:
        optimizer: any ``torch.optim.Optimizer`` that skips parameters without a gradient (all of torch's and
            ds_async's do), built over all parameters and not yet stepped.
        group: the data-parallel process group (default: the whole world).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None = None):
        self.optimizer, self.group = optimizer, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        owners = partition_params(self._params, self.world)
        self.owner = {p: r for p, r in zip(self._params, owners)}
        for p in self._params:
            if self.owner[p] != self.rank:
                optimizer.state.pop(p, None)
        # torch's Optimizer.__init__ sets up hooks and bookkeeping; then share the wrapped optimizer's groups
        # and state instead of copies, so that changes through either object are seen by both.
        super().__init__(self._params, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step: closures are not supported (each rank steps a different shard)")
        hidden = {p: p.grad for p in self._params if self.owner[p] != self.rank and p.grad is not None}
        for p in hidden:
            p.grad = None
        try:
            self.optimizer.step()
        finally:
            for p, g in hidden.items():
                p.grad = g
        self._broadcast()

    def _broadcast(self) -> None:
        """Every parameter from its owner, coalesced into one buffer per (owner, dtype, device)."""
        buckets: dict[tuple, list[Tensor]] = {}
        for p in self._params:
            buckets.setdefault((self.owner[p], p.dtype, p.device), []).append(p)
        for (owner, _, _), params in buckets.items():
            data = [p.detach() for p in params]
            flat = _flatten_dense_tensors(data)
            dist.broadcast(flat, src=self._global_ranks[owner], group=self.group)
            if owner != self.rank:
                for p, new in zip(data, _unflatten_dense_tensors(flat, data)):
                    p.copy_(new)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)
        # torch's load_state_dict builds new group dicts and a new state: share them again, or LR schedulers (which
        # set lr on this object's groups) would no longer reach the optimizer.
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state

    def stats(self) -> dict[str, float]:
        """The wrapped :class:`UpdateOptimizer`'s stats over all ranks' shards (a collective: call on every rank)."""
        if not isinstance(self.optimizer, UpdateOptimizer):
            raise TypeError(f"stats() needs a ds_async optimizer, not {type(self.optimizer).__name__}")
        sums = self.optimizer.stat_sums()
        # On the parameters' device even on a rank that owns nothing (whose sums are plain zeros): NCCL needs it.
        values = stack_sums(sums).to(self._params[0].device)
        dist.all_reduce(values, group=self.group)
        return finish_stats(list(sums), values, self.optimizer.last_lrs)
