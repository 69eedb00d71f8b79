"""Newton-Schulz split across data-parallel replicas: each orthogonalises about ``1/d`` of the matrices, then all
replicas gather every result (as microsoft/dion and Moonshot's distributed Muon split the orthogonalisation).

Without ZeRO every replica holds the same all-reduced gradients and the same Muon momentum, so all of them would
run the same Newton-Schulz on every matrix: the step's largest compute, repeated ``d`` times. Here each matrix
(a whole tensor: an expert stack ``[E, rows, cols]`` stays on one replica) has one owner, chosen by
:func:`assign` from the shapes alone, so every rank computes the same assignment without communicating. A fused
``[gate; up]`` expert stack that Muon splits (``split_gate_up``) arrives as the view ``[E, 2, rows / 2, cols]``
(:func:`ds_async.optim.muon.orthogonalise_blocks`): still one tensor with one owner, and its cost is that of its
``2E`` half-size matrices, which is what Newton-Schulz runs on it.

Contract: :func:`orthogonalise_split` returns, on every rank, the bits :func:`ds_async.optim.muon.
orthogonalise_batched` returns for the whole list. Each owner runs ``orthogonalise_batched`` on its own matrices
(same shapes batched), so a matrix may be orthogonalised in a smaller batch than the unsplit path stacks it in;
that is bit-identical because a batched matmul computes every matrix of the batch with the same per-matrix
kernel, independent of the batch size and of its place in the batch (verified on CPU by the tests; on GPUs by
``launch/bench/bench_newton_schulz.py``, which reports ``split_bit_equal`` for the benchmark's shapes). The
results travel in bf16 (Newton-Schulz's own precision), per shape one flat buffer per owner in one
``all_gather_into_tensor`` (``all_gather_single`` from torch 2.13).

Each shape's gather is issued as soon as its Newton-Schulz is done, overlapping the next shape's, rather than one
gather after all of them, which measured slower (``launch/bench/RESULTS.md``, "Newton-Schulz").
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..flops import newton_schulz_flops
from .muon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, orthogonalise_batched


# torch >= 2.13 renames all_gather_into_tensor (and warns on the old name); the same collective either way.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def assign(shapes: Sequence[Sequence[int]], replicas: int, steps: int = NS_STEPS) -> list[int]:
    """The owner (``0 .. replicas-1``) of each matrix of ``shapes``, balancing Newton-Schulz FLOPs
    (:func:`ds_async.flops.newton_schulz_flops`): largest first (ties: earlier first), each to the replica with
    the least FLOPs so far (ties: lowest). Depends only on the shapes and their order, so every rank computes the
    same; the busiest replica carries at most ``total / replicas + largest``."""
    if replicas < 1:
        raise ValueError(f"assign: replicas must be >= 1, got {replicas}")
    costs = [newton_schulz_flops([tuple(s)], steps) for s in shapes]
    load = [0.0] * replicas
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(replicas), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += costs[i]
    return owners


def loads(shapes: Sequence[Sequence[int]], owners: Sequence[int], replicas: int, steps: int = NS_STEPS
          ) -> list[float]:
    """Newton-Schulz FLOPs each replica carries under ``owners``."""
    out = [0.0] * replicas
    for s, r in zip(shapes, owners):
        out[r] += newton_schulz_flops([tuple(s)], steps)
    return out


@torch.no_grad()
def orthogonalise_split(directions: list[Tensor], steps: int = NS_STEPS,
                        coefficients: tuple[float, float, float] = NS_COEFFICIENTS, eps: float = NS_EPS, *,
                        group: dist.ProcessGroup | None = None, owners: Sequence[int] | None = None
                        ) -> list[Tensor]:
    """:func:`ds_async.optim.muon.orthogonalise_batched` of ``directions`` (every rank of ``group`` passes the same
    list), computed ``1/d`` per rank and all-gathered; bf16 results, views into the gathered buffers. ``owners``
    (default :func:`assign`) must be the same on every rank. Signature compatible with ``muon_pass_``'s
    ``orthogonalise`` (bind ``group`` with ``functools.partial``).

    One all-gather round (:func:`orthogonalise_owned`) per shape, largest in bytes first, each started as soon as
    that shape is orthogonalised, so that it runs while the next shape's Newton-Schulz does and only the last,
    smallest gather is exposed (module docstring)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1 or not directions:
        return orthogonalise_batched(directions, steps, coefficients, eps)
    if owners is None:
        owners = assign([d.shape for d in directions], world, steps)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for i, d in enumerate(directions):
        by_shape.setdefault(tuple(d.shape), []).append(i)
    out: list[Tensor] = [None] * len(directions)  # type: ignore[list-item]
    works = []
    for indices in sorted(by_shape.values(), key=lambda idx: -sum(directions[i].numel() for i in idx)):
        results, work = orthogonalise_owned(directions, indices, owners, steps, coefficients, eps, group=group,
                                            async_op=True)
        works.append(work)
        for i, o in zip(indices, results):
            out[i] = o
    for work in works:
        work.wait()
    return out


@torch.no_grad()
def orthogonalise_owned(directions: Sequence[Tensor], indices: Sequence[int], owners: Sequence[int],
                        steps: int = NS_STEPS, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                        eps: float = NS_EPS, *, group: dist.ProcessGroup | None = None, async_op: bool = False
                        ) -> tuple[list[Tensor], object]:
    """One all-gather round of :func:`orthogonalise_split` over ``directions[i]`` for ``i`` in ``indices``: this
    rank orthogonalises the ones ``owners`` gives it (batched by shape), packs them in order into one bf16 buffer
    padded to the widest owner's, and all ranks gather every owner's buffer. Returns the results for ``indices``, in
    their order (views into the gathered buffer), and the collective's work handle (``async_op``: wait on it before
    reading them; None otherwise)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    indices = list(indices)
    mine = [i for i in indices if owners[i] == rank]
    numel = [0] * world
    for i in indices:
        numel[owners[i]] += directions[i].numel()
    width = max(numel)
    device = directions[indices[0]].device
    send = torch.empty(width, dtype=torch.bfloat16, device=device)
    offset = 0
    for o in orthogonalise_batched([directions[i] for i in mine], steps, coefficients, eps):
        send[offset:offset + o.numel()].view_as(o).copy_(o)
        offset += o.numel()
    send[offset:].zero_()  # padding to the widest owner: sent, never read
    gathered = torch.empty(world * width, dtype=torch.bfloat16, device=device)
    work = _all_gather_single(gathered, send, group=group, async_op=async_op)
    out = []
    offsets = [r * width for r in range(world)]
    for i in indices:
        r, n = owners[i], directions[i].numel()
        out.append(gathered[offsets[r]:offsets[r] + n].view(directions[i].shape))
        offsets[r] += n
    return out, work
