"""Newton-Schulz split across data-parallel replicas: the assignment is balanced and deterministic, and real gloo
runs on 2 and 3 processes give every rank the bits of the unsplit batched Newton-Schulz."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from distributed import free_port
from ds_async.flops import newton_schulz_flops
from ds_async.optim import ErrorFeedback, Muon, muon_param_groups
from ds_async.optim.muon import orthogonalise_batched, split_rows, zeropower_via_newtonschulz
from ds_async.optim.muon_pass import hybrid_muon_step_
from ds_async.optim.ns_split import assign, loads, orthogonalise_split


def llama_shapes(hidden=64, ffn=176, heads=4, kv_heads=2, layers=2, experts=4):
    """A small LLaMA stage's hidden matrices (q, k, v, o with grouped KV heads; gate, up, down) and an MoE layer
    (router, expert stacks ``[E, rows, cols]``), in module order."""
    kv = hidden // heads * kv_heads
    layer = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
             (hidden, ffn)]
    return layer * layers + [(experts, hidden), (experts, ffn, hidden), (experts, ffn, hidden),
                             (experts, hidden, ffn)]


SHAPES = llama_shapes()


def directions_for(shapes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in shapes]


@pytest.mark.parametrize("replicas", [1, 2, 3, 4, 8])
def test_assignment_is_balanced_and_deterministic(replicas):
    """Every matrix has one owner in range; the busiest replica's Newton-Schulz FLOPs are at most the ideal share
    plus the largest matrix's (the greedy bound); the same shapes always give the same owners, and the owners depend
    on shapes, not values."""
    owners = assign(SHAPES, replicas)
    assert len(owners) == len(SHAPES) and set(owners) <= set(range(replicas))
    costs = [newton_schulz_flops([s], 5) for s in SHAPES]
    load = loads(SHAPES, owners, replicas)
    assert sum(load) == pytest.approx(sum(costs))
    assert max(load) <= sum(costs) / replicas + max(costs)
    if replicas <= len(SHAPES):
        assert set(owners) == set(range(replicas))  # no idle replica
    assert assign(list(SHAPES), replicas) == owners
    assert assign([torch.Size(s) for s in SHAPES], replicas) == owners


def test_assignment_of_a_902m_stage_is_near_ideal():
    """The benchmark's stage (hidden 2048, ffn 5632, 4 layers) on 2, 4 and 8 replicas: within 25% of ideal (whole
    matrices cannot be split: 28 matrices of three sizes)."""
    shapes = [(2048, 2048)] * 16 + [(5632, 2048)] * 8 + [(2048, 5632)] * 4
    total = newton_schulz_flops(shapes, 5)
    for replicas in (2, 4, 8):
        assert max(loads(shapes, assign(shapes, replicas), replicas)) <= 1.25 * total / replicas


def test_split_gate_up_stacks_are_balanced_by_their_halves():
    """Under ``split_gate_up`` a fused ``[E, 2I, H]`` stack reaches the split as one ``[E, 2, I, H]`` tensor: one
    owner (whole parameters move), costed as its ``2E`` half-size matrices, which is what Newton-Schulz runs (not
    as ``E`` fused ``2I x H`` ones: more or fewer FLOPs, as ``H`` or ``I`` is the smaller side)."""
    experts, hidden, ffn = 4, 64, 176
    fused = (experts, 2 * ffn, hidden)
    halves = (experts, 2, ffn, hidden)
    assert newton_schulz_flops([halves], 5) == 2 * newton_schulz_flops([(experts, ffn, hidden)], 5)
    assert newton_schulz_flops([halves], 5) != newton_schulz_flops([fused], 5)
    shapes = [s if s != (experts, ffn, hidden) else halves for s in SHAPES]
    for replicas in (2, 3, 4):
        owners = assign(shapes, replicas)
        costs = [newton_schulz_flops([s], 5) for s in shapes]
        assert max(loads(shapes, owners, replicas)) <= sum(costs) / replicas + max(costs)
    d = torch.randn(fused, generator=torch.Generator().manual_seed(2))
    assert split_rows(d, 2).shape == halves and split_rows(d, 2).data_ptr() == d.data_ptr()


def test_smaller_batches_are_bit_equal_on_cpu():
    """Why the split may batch differently from the unsplit path: a matrix orthogonalised alone or in any sub-batch
    of its shape gives the bits it gets in the full batch (batched matmuls compute each matrix independently)."""
    for shape in [(64, 64), (176, 64), (4, 64, 176)]:
        ds = directions_for([shape] * 5, seed=3)
        full = orthogonalise_batched(ds)
        for subset in ([0], [1, 3], [4, 2, 0], [1, 2, 3, 4]):
            for i, got in zip(subset, orthogonalise_batched([ds[i] for i in subset])):
                assert torch.equal(got, full[i]), (shape, subset, i)
            assert torch.equal(zeropower_via_newtonschulz(ds[subset[0]]), full[subset[0]])


class TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16)
        self.q = nn.Linear(16, 16, bias=False)
        self.k = nn.Linear(16, 16, bias=False)
        self.up = nn.Linear(16, 40, bias=False)
        self.down = nn.Linear(40, 16, bias=False)
        self.experts = nn.Parameter(torch.randn(3, 40, 16) * 0.05)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 40, bias=False)

    def ds_async_roles(self):
        return {self.head.weight: "head"}


class TinyFusedMoE(TinyMoE):
    """TinyMoE whose expert stack is declared a fused ``[gate; up]`` stack (``ds_async_gate_up``: 20 gate rows, then
    20 up rows per expert), as Mixtral's ``gate_up_proj``."""

    def ds_async_gate_up(self):
        return [self.experts]


def hybrid_pair(model_cls=TinyMoE, **options):
    torch.manual_seed(0)
    model = model_cls()

    def build():
        groups = muon_param_groups(model, lr=0.02, weight_decay=0.1, adam_lr=3e-3, adam_weight_decay=0.05, **options)
        for g in groups:
            g["params"] = [p.detach().clone().requires_grad_() for p in g["params"]]
        return Muon(groups, correction=ErrorFeedback(1.0))
    return build(), build()


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = {}
        # The small LLaMA + MoE mix, fp32 and bf16 inputs; and fewer matrices than ranks (an idle owner).
        for name, ds in [("llama", directions_for(SHAPES)),
                         ("llama_bf16", [d.bfloat16() for d in directions_for(SHAPES, seed=1)]),
                         ("two", directions_for([(8, 8), (8, 12)], seed=2))]:
            split = orthogonalise_split(ds)
            result[name] = [t.clone() for t in split]
            result[name + "_ok"] = all(torch.equal(s, r) for s, r in zip(split, orthogonalise_batched(ds)))
        # The expert stacks of the mix as Muon hands them over under split_gate_up: [E, 2, rows / 2, cols] views.
        blocks = [split_rows(d, 2) if len(d.shape) == 3 and d.shape[1] % 2 == 0 else d
                  for d in directions_for(SHAPES, seed=3)]
        split = orthogonalise_split(blocks)
        result["blocks_ok"] = all(torch.equal(s, r) for s, r in zip(split, orthogonalise_batched(blocks)))
        # A whole hybrid Muon + EF step with the split Newton-Schulz against the class's step, 3 steps; also with a
        # fused [gate; up] stack split in two (its own group of row blocks).
        for key, (ref, fast) in [("hybrid_ok", hybrid_pair()),
                                 ("hybrid_gate_up_ok", hybrid_pair(TinyFusedMoE, split_gate_up=True))]:
            gen = torch.Generator().manual_seed(7)
            for _ in range(3):
                ref_params = [p for g in ref.param_groups for p in g["params"]]
                grads = [torch.randn(p.shape, generator=gen).bfloat16() for p in ref_params]
                for p, grad in zip(ref_params, grads):
                    p.grad = grad.float()
                ref.step()
                hybrid_muon_step_(fast, grads, torch.tensor(1.0), orthogonalise=orthogonalise_split)
            result[key] = all(torch.equal(p.detach(), q.detach()) for gr, gf in
                              zip(ref.param_groups, fast.param_groups) for p, q in zip(gr["params"], gf["params"]))
        result["gate_up_group"] = [g["name"] for g in ref.param_groups] == ["matrix", "gate_up", "embedding", "head",
                                                                            "vector"]
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_split_equals_unsplit_on_every_rank(world, tmp_path):
    """Real gloo processes: every rank's gathered result is bit-equal to ``orthogonalise_batched`` of the whole list
    (checked on the rank and against this process's own), for the small LLaMA + MoE mix in fp32 and bf16 and for
    fewer matrices than ranks, and for the expert stacks split into row blocks; a hybrid Muon + EF step driven by the
    split equals ``Muon.step()``, also with ``split_gate_up``."""
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        want = {"llama": orthogonalise_batched(directions_for(SHAPES)),
                "llama_bf16": orthogonalise_batched([d.bfloat16() for d in directions_for(SHAPES, seed=1)]),
                "two": orthogonalise_batched(directions_for([(8, 8), (8, 12)], seed=2))}
    finally:
        torch.set_num_threads(threads)
    for r, got in enumerate(ranks):
        assert got["hybrid_ok"], f"rank {r}: hybrid step with split Newton-Schulz differs from Muon.step()"
        assert got["blocks_ok"], f"rank {r}: expert stacks split into row blocks differ from their unsplit result"
        assert got["gate_up_group"] and got["hybrid_gate_up_ok"], \
            f"rank {r}: split_gate_up's hybrid step with split Newton-Schulz differs from Muon.step()"
        for name, ws in want.items():
            assert got[name + "_ok"], f"rank {r}: {name} differs from its own unsplit result"
            for i, (g, w) in enumerate(zip(got[name], ws)):
                assert g.dtype == torch.bfloat16 and g.shape == w.shape
                assert torch.equal(g, w), f"rank {r}, {name}[{i}] {tuple(w.shape)}"
