"""Tensor-granular ZeRO-1 (``ShardedOptimizer``) on 2 gloo processes equals the unsharded optimizer bit for bit.

Each rank holds the full model and a reference copy stepped by the unsharded optimizer in the same process;
gradients differ per rank and are averaged with a real all-reduce, as the engine does before the step.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from distributed import free_port
from ds_async.optim import build_optimizer
from ds_async.optim.sharded import ShardedOptimizer, partition_params

WORLD, STEPS, RESUME_AT = 2, 5, 3
BLOCK = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1, "lr_rule": "match_rms_adamw",
                                    "adam_lr": 3e-3, "adam_weight_decay": 0.05}}
CORRECTION = {"type": "ef", "lambda": 1.0}


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 24, 16) * 0.1)


class Head(nn.Linear):
    def ds_async_roles(self):
        return {self.weight: "head"}


def toy_model():
    """Every role and shape class: embedding, matrices, a 3-D expert stack, norm vectors, biases, a head."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16, bias=False),
                         Experts(), nn.Linear(16, 16), Head(16, 50, bias=False))


def averaged_grads(model, step):
    """Rank r's gradient is randn(seed = step, r); the average over ranks, all-reduced (gloo) on this rank and
    computed locally for the reference (two addends: the sum is the same in either order)."""
    mine, ref = [], []
    for i, p in enumerate(model.parameters()):
        per_rank = [torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + 10 * i + r))
                    for r in range(WORLD)]
        g = per_rank[dist.get_rank()].clone()
        dist.all_reduce(g)
        mine.append(g.div_(WORLD))
        ref.append((per_rank[0] + per_rank[1]).div_(WORLD))
    return mine, ref


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        model, ref_model = toy_model(), toy_model()
        sharded = ShardedOptimizer(build_optimizer(BLOCK, model, correction=CORRECTION))
        plain = build_optimizer(BLOCK, ref_model, correction=CORRECTION)
        saved = None
        for step in range(STEPS):
            if step == RESUME_AT:  # the state_dict is this rank's shard: save it and continue from a rebuilt one
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(sharded.state_dict()))
            mine, ref = averaged_grads(model, step)
            for p, q, g, h in zip(model.parameters(), ref_model.parameters(), mine, ref):
                p.grad, q.grad = g, h
            sharded.step()
            plain.step()
        stats, plain_stats = sharded.stats(), plain.stats()

        resumed = toy_model()
        resumed.load_state_dict(saved[0])
        opt = ShardedOptimizer(build_optimizer(BLOCK, resumed, correction=CORRECTION))
        opt.load_state_dict(saved[1])
        for step in range(RESUME_AT, STEPS):
            mine, _ = averaged_grads(resumed, step)
            for p, g in zip(resumed.parameters(), mine):
                p.grad = g
            opt.step()

        params = list(model.parameters())
        torch.save({"params": [p.detach() for p in params], "ref": [p.detach() for p in ref_model.parameters()],
                    "resumed": [p.detach() for p in resumed.parameters()],
                    "owned": [i for i, p in enumerate(params) if sharded.owner[p] == rank],
                    # state_dict numbers parameters in param-group order (Muon's groups are by role)
                    "owned_in_groups": [i for i, p in enumerate(q for g in sharded.param_groups for q in g["params"])
                                        if sharded.owner[p] == rank],
                    "state": sorted(sharded.state_dict()["state"]), "stats": stats, "plain_stats": plain_stats,
                    "start": [p.detach() for p in toy_model().parameters()]},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_sharded_muon_ef_equals_unsharded(tmp_path):
    mp.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    n = len(ranks[0]["params"])
    owned = [set(r["owned"]) for r in ranks]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == set(range(n)) and all(owned)
    for r in ranks:
        # Optimizer state (moments, momentum, EF buffer) only for owned parameters.
        assert r["state"] == r["owned_in_groups"]
        for i, (p, q, p0) in enumerate(zip(r["params"], ranks[0]["ref"], r["start"])):
            assert torch.equal(p, q), f"param {i}: max diff {(p - q).abs().max().item():.3g}"
            assert not torch.equal(p, p0)
        for i, (p, q) in enumerate(zip(r["resumed"], r["params"])):
            assert torch.equal(p, q), f"resumed param {i}"
        assert r["stats"].keys() == r["plain_stats"].keys()
        for key, value in r["plain_stats"].items():
            assert r["stats"][key] == pytest.approx(value, rel=1e-6), key


def test_partition_is_greedy_and_deterministic():
    shapes = [(10,), (100, 4), (30, 30), (5, 5), (400,), (20, 20)]
    params = [torch.empty(s) for s in shapes]
    owners = partition_params(params, 2)
    assert owners == partition_params(params, 2)
    load = [sum(p.numel() for p, o in zip(params, owners) if o == r) for r in range(2)]
    assert owners[2] == 0 and owners[1] == 1 and owners[4] == 1  # 900, then the two 400s to the lighter rank
    assert max(load) - min(load) <= max(p.numel() for p in params)
