"""Newton-Schulz's two symmetric products, one triangle each (Triton): what Muon runs on GPUs.

Each quintic iteration ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` has two products whose results are
symmetric: ``A`` itself and ``A^2 = A A^T``. cuBLAS has no bf16 SYRK, so the matmul path computes them whole;
:func:`sym_product` computes only the tiles on and above the diagonal and writes each one twice (itself and its
mirror), about half the FLOPs of the full product. With ``X`` of ``m x n`` (``m <= n``) an iteration costs
``2 m^2 n + 2 m^3 + 2 m^2 n`` FLOPs whole and about ``m^2 n + m^3 + 2 m^2 n`` this way (for a stage of the 0.9B
benchmark model, 31% fewer; its speed against cuBLAS: ``launch/bench/RESULTS.md``, "Newton-Schulz").

The kernel alone: :func:`iterate` is Newton-Schulz's loop on a normalised batch, which
``ds_async.optim.muon.zeropower_symmetric`` prepares as ``zeropower_matmul`` does and takes and returns what that
does (bf16, same shape), with the same arithmetic: fp32 accumulation of each product, ``alpha * acc + beta * D`` rounded once to
bf16 as ``torch.baddbmm`` does; bit-equal to cuBLAS's where ``launch/bench/bench_newton_schulz.py`` checked it
(the results page says where), other cards or shapes may differ in the last bits.
``ds_async.optim.muon.zeropower_via_newtonschulz`` takes this path for CUDA tensors where Triton imports (the matmul
path elsewhere); this module imports nothing of ds_async's; ``tests/test_ns_triton.py`` runs it under Triton's CPU interpreter against fp32 products, the fp32
iteration and the matmul path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIGS = [triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
           triton.Config({"BLOCK": 128, "BLOCK_K": 64}, num_warps=8, num_stages=4),
           triton.Config({"BLOCK": 128, "BLOCK_K": 32}, num_warps=4, num_stages=4),
           triton.Config({"BLOCK": 64, "BLOCK_K": 64}, num_warps=4, num_stages=4)]


@triton.jit
def _sym_kernel(x_ptr, d_ptr, c_ptr, M, K, sxb, sxm, sxk, sdb, sdm, sdn, scb, scm, scn, alpha, beta,
                HAS_D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr = False):
    """One tile ``(i, j)``, ``i <= j``, of ``C = alpha X X^T (+ beta D)`` for batch entry ``program_id(1)``, stored at
    ``(i, j)`` and mirrored at ``(j, i)``. ``UPCAST``: multiply in fp32 (Triton's interpreter returns garbage for a
    bf16 ``tl.dot``, so the tests multiply bf16 tiles as fp32, exactly; GPUs take the bf16 tensor cores)."""
    tiles = tl.cdiv(M, BLOCK)
    t = tl.program_id(0)
    # t enumerates the upper triangle row by row: row i holds tiles - i of them.
    i = 0
    left = t
    while left >= tiles - i:
        left -= tiles - i
        i += 1
    j = i + left
    b = tl.program_id(1)
    rm = i * BLOCK + tl.arange(0, BLOCK)
    rn = j * BLOCK + tl.arange(0, BLOCK)
    rk = tl.arange(0, BLOCK_K)
    x = x_ptr + b * sxb
    a_ptrs = x + rm[:, None] * sxm + rk[None, :] * sxk
    bt_ptrs = x + rn[None, :] * sxm + rk[:, None] * sxk
    acc = tl.zeros((BLOCK, BLOCK), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        kin = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & kin[None, :], other=0.0)
        bt = tl.load(bt_ptrs, mask=(rn[None, :] < M) & kin[:, None], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), bt.to(tl.float32), acc)
        else:
            acc = tl.dot(a, bt, acc)
        a_ptrs += BLOCK_K * sxk
        bt_ptrs += BLOCK_K * sxk
    acc = acc * alpha
    inside = (rm[:, None] < M) & (rn[None, :] < M)
    if HAS_D:
        d = tl.load(d_ptr + b * sdb + rm[:, None] * sdm + rn[None, :] * sdn, mask=inside, other=0.0)
        acc += beta * d.to(tl.float32)
    out = acc.to(c_ptr.dtype.element_ty)
    c = c_ptr + b * scb
    tl.store(c + rm[:, None] * scm + rn[None, :] * scn, out, mask=inside)
    if i != j:
        tl.store(c + rn[None, :] * scm + rm[:, None] * scn, out, mask=inside)


_sym_tuned = triton.autotune(configs=CONFIGS, key=["M", "K", "HAS_D"], cache_results=True)(_sym_kernel)


def sym_product(x: torch.Tensor, d: torch.Tensor | None = None, alpha: float = 1.0, beta: float = 0.0,
                blocks: tuple[int, int] | None = None, upcast: bool = False) -> torch.Tensor:
    """``alpha * x @ x.mT + beta * d`` for a batch ``x`` of ``[B, M, K]`` (``d``: ``[B, M, M]``, symmetric), in
    ``x``'s dtype; only the upper triangle's tiles are multiplied. ``blocks``: ``(BLOCK, BLOCK_K)`` instead of the
    autotuned configs (Triton's interpreter cannot autotune); ``upcast``: see :func:`_sym_kernel`."""
    batch, m, k = x.shape
    # Under upcast the tile is stored in fp32 and rounded by torch: the interpreter's fp32 -> bf16 cast truncates,
    # where the GPU's rounds to nearest even as torch does.
    c = torch.empty(batch, m, m, dtype=torch.float32 if upcast else x.dtype, device=x.device)
    dd = d if d is not None else c

    def grid(meta):
        tiles = triton.cdiv(m, meta["BLOCK"])
        return tiles * (tiles + 1) // 2, batch

    args = (x, dd, c, m, k, *x.stride(), *dd.stride(), *c.stride(), alpha, beta)
    if blocks is None:
        _sym_tuned[grid](*args, HAS_D=d is not None)
    else:
        _sym_kernel[grid](*args, HAS_D=d is not None, BLOCK=blocks[0], BLOCK_K=blocks[1], UPCAST=upcast)
    return c.to(x.dtype)


def iterate(x: torch.Tensor, steps: int, coefficients: tuple[float, float, float],
            blocks: tuple[int, int] | None = None, upcast: bool = False) -> torch.Tensor:
    """The quintic iteration ``X <- a X + (b A + c A A^T) X``, ``A = X X^T``, ``steps`` times on a batch ``x`` of
    ``[B, M, K]`` (``M <= K``, rows contiguous along ``K``), the two symmetric products by :func:`sym_product`
    (``blocks``, ``upcast``: as there, for Triton's interpreter)."""
    a, b, c = coefficients
    for _ in range(steps):
        gram = sym_product(x, blocks=blocks, upcast=upcast)
        poly = sym_product(gram, gram, alpha=c, beta=b, blocks=blocks, upcast=upcast)  # b A + c A A^T, A symmetric
        x = torch.baddbmm(x, poly, x, beta=a)
    return x
