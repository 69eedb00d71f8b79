"""The optimizer figures a run logs (``optimizer/...`` in tensorboard), summed over every rank of the job.

Per parameter group: the update's RMS and the learning rate; the delay correction's buffer norm; and
``staleness`` = ||W_used - W_current||, the distance between the weights a batch's gradients were computed on and
the weights they update (0 under ``1f1b``). Collective over all ranks (one host sync and one object all-gather):
call it on logging steps only.
"""
from __future__ import annotations

import torch
from deepspeed import comm as dist

from .client import base_optimizer
from .optimizers import finish_stats, stack_sums
from .sharded import ShardedOptimizer


def optimizer_stats(engine, staleness_sq: torch.Tensor | None) -> dict[str, float]:
    """The last step's figures for the whole model, from an :class:`~ds_async.pipe.engine.AsyncPipelineEngine` and
    the staleness that step measured on this stage (its report's ``staleness_sq``)."""
    engine.wait_for_step()  # the step may still be queued on the side stream
    base = base_optimizer(engine.optimizer)
    inner = base.optimizer if isinstance(base, ShardedOptimizer) else base
    first_replica = engine.grid.data_parallel_id == 0
    sums, lrs = {}, {}
    if inner is not None and (isinstance(base, ShardedOptimizer) or first_replica):  # replicas repeat the rest
        raw = inner.stat_sums()
        sums = dict(zip(raw, stack_sums(raw).tolist()))
        lrs = inner.last_lrs
    if staleness_sq is not None and first_replica:
        sums["staleness_sq"] = staleness_sq.item()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (sums, lrs))
    total, all_lrs = {}, {}
    for rank_sums, rank_lrs in gathered:
        for k, v in rank_sums.items():
            total[k] = total.get(k, 0.0) + v
        all_lrs.update(rank_lrs)
    staleness = total.pop("staleness_sq", None)
    out = finish_stats(list(total), torch.tensor(list(total.values()), dtype=torch.float64), all_lrs) if total else {}
    if staleness is not None:
        out["staleness"] = staleness ** 0.5
    elif engine.stats_every and not engine.is_async:
        out["staleness"] = 0.0
    return out
