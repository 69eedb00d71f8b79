"""The optimizer's pointwise passes as Triton kernels, one launch per run of same-shaped tensors: what GPUs run.

Each function here takes what its eager pass takes (:mod:`ds_async.optim.muon_pass`, :mod:`ds_async.optim.adamw_pass`,
:mod:`ds_async.optim.clip`) and does its arithmetic op for op, in fp32, in the same order; a tensor's elements are
read once and written once. The tensors of one call must be contiguous and of one size; the kernel finds them
through a table of their addresses (one int64 per tensor and operand, kept on the device for addresses seen
before), so a run of 15 matrices is one launch, and nothing is compiled per shape or per list length: a kernel is
compiled once per combination of dtypes and flags (and of Triton's specialisations of its integer arguments) and
cached by Triton on disk (``performance.compile_cache``).

Rounding: products and sums are fp32 and may be fused into multiply-adds by the GPU compiler, as CUDA's eager
kernels fuse them, so results may differ from the eager ops in the last bit (tests: ``tests/test_passes_triton.py``,
under Triton's CPU interpreter and, on GPUs, against the eager ops). Square roots and divisions are IEEE
(``sqrt_rn``, ``div_rn``), as torch's. bf16 results are rounded to nearest even by :func:`_bf16`, bit for bit what
torch's cast does on every backend (the interpreter's own cast truncates).

Sums of squares (the optimizer's statistics) are added per block of elements, then over the blocks by torch: the
same every run, equal to the eager sums up to the order of the additions.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096
WARPS = 8
_TABLES: dict[tuple, Tensor] = {}
_TABLES_KEPT = 4096  # address tables kept on the device before the cache starts over


@triton.jit
def _bf16(x):
    """fp32 to bf16, rounded to nearest even (NaN stays NaN)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _in_dtype(x, BF16: tl.constexpr):
    """``x`` (fp32) rounded to bf16 and back where ``BF16``: a value held in a bf16 buffer."""
    if BF16:
        return _bf16(x).to(tl.float32)
    return x


@triton.jit
def _lerp(start, end, weight):
    # torch's lerp: start + w (end - start) for |w| < 0.5, else end - (end - start)(1 - w)
    diff = end - start
    return tl.where(tl.abs(weight) < 0.5, start + weight * diff, end - diff * (1.0 - weight))


@triton.jit
def _operand(table, operand, n, t, dtype: tl.constexpr):
    return tl.load(table + operand * n + t).to(tl.pointer_type(dtype))


@triton.jit
def _block(numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < numel


@triton.jit
def _store_outs(table, first, n, t, offs, x, mask, N_OUTS: tl.constexpr):
    for j in tl.static_range(N_OUTS):
        tl.store(_operand(table, first + j, n, t, tl.bfloat16) + offs, _bf16(x), mask=mask)


@triton.jit
def _store_sums(sums, base, applied, mask, stride):
    # one column per program: row 0 the applied update's square, row 1 the base update's
    column = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    tl.store(sums + column, tl.sum(tl.where(mask, applied * applied, 0.0), axis=0))
    tl.store(sums + stride + column, tl.sum(tl.where(mask, base * base, 0.0), axis=0))


@triton.jit
def _scaled_grad(table, operand, n, t, offs, mask, scale_ptr, G: tl.constexpr, GRAD_BF16: tl.constexpr):
    # (G.to(grad_dtype) * scale).to(fp32), scale already in grad_dtype
    g = _in_dtype(tl.load(_operand(table, operand, n, t, G) + offs, mask=mask).to(tl.float32), GRAD_BF16)
    return _in_dtype(g * tl.load(scale_ptr).to(tl.float32), GRAD_BF16)


@triton.jit
def _muon_head_kernel(table, n, numel, hyper, scale_ptr, G: tl.constexpr, GRAD_BF16: tl.constexpr,
                      NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    offs, mask = _block(numel, BLOCK)
    g = _scaled_grad(table, 0, n, t, offs, mask, scale_ptr, G, GRAD_BF16)
    b_ptr = _operand(table, 1, n, t, tl.float32) + offs
    b = _lerp(tl.load(b_ptr, mask=mask), g, tl.load(hyper))
    tl.store(b_ptr, b, mask=mask)
    d = _lerp(g, b, tl.load(hyper + 1)) if NESTEROV else b
    tl.store(_operand(table, 2, n, t, tl.bfloat16) + offs, _bf16(d), mask=mask)


@triton.jit
def _muon_tail_kernel(table, n, numel, hyper, lr_index, sums, stride, O: tl.constexpr, EF: tl.constexpr,
                      N_OUTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    offs, mask = _block(numel, BLOCK)
    p_ptr = _operand(table, 0, n, t, tl.float32) + offs
    p = tl.load(p_ptr, mask=mask, other=0.0)
    o = tl.load(_operand(table, 1, n, t, O) + offs, mask=mask, other=0.0).to(tl.float32)
    new = p * tl.load(hyper + 2) + o * tl.load(hyper + lr_index)  # decayed(x).add_(O, alpha=-adjusted_lr)
    u = p - new
    if EF:  # u_prev <- u; new -= lam (u - u_prev); the base update's square is the statistic before the correction
        base = u
        prev_ptr = _operand(table, 2, n, t, tl.float32) + offs
        extra = (u - tl.load(prev_ptr, mask=mask, other=0.0)) * tl.load(hyper + 3)
        tl.store(prev_ptr, u, mask=mask)
        new = new - extra
        u = u + extra
    else:
        base = tl.zeros_like(u)
    tl.store(p_ptr, new, mask=mask)
    _store_outs(table, 3 if EF else 2, n, t, offs, new, mask, N_OUTS)
    _store_sums(sums, base, u, mask, stride)


@triton.jit
def _ef_tail_kernel(table, n, numel, lam_ptr, sums, stride, N_OUTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    offs, mask = _block(numel, BLOCK)
    p_ptr = _operand(table, 0, n, t, tl.float32) + offs
    prev_ptr = _operand(table, 2, n, t, tl.float32) + offs
    p = tl.load(p_ptr, mask=mask, other=0.0)
    u = tl.load(_operand(table, 1, n, t, tl.float32) + offs, mask=mask, other=0.0) - p
    extra = (u - tl.load(prev_ptr, mask=mask, other=0.0)) * tl.load(lam_ptr)
    tl.store(prev_ptr, u, mask=mask)
    p = p - extra
    tl.store(p_ptr, p, mask=mask)
    _store_outs(table, 3, n, t, offs, p, mask, N_OUTS)
    _store_sums(sums, u, u + extra, mask, stride)


@triton.jit
def _adamw_kernel(table, n, numel, hyper, scale_ptr, sums, stride, G: tl.constexpr, GRAD_BF16: tl.constexpr,
                  N_OUTS: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    offs, mask = _block(numel, BLOCK)
    g = _scaled_grad(table, 1, n, t, offs, mask, scale_ptr, G, GRAD_BF16)
    p_ptr = _operand(table, 0, n, t, tl.float32) + offs
    m_ptr = _operand(table, 2, n, t, tl.float32) + offs
    v_ptr = _operand(table, 3, n, t, tl.float32) + offs
    old = tl.load(p_ptr, mask=mask, other=0.0)
    p = old * tl.load(hyper)
    m = _lerp(tl.load(m_ptr, mask=mask, other=0.0), g, tl.load(hyper + 1))
    v = tl.load(v_ptr, mask=mask, other=0.0) * tl.load(hyper + 2) + (g * tl.load(hyper + 3)) * g
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(hyper + 5)) + tl.load(hyper + 6)
    p = p + tl.div_rn(m * tl.load(hyper + 4), denom)
    tl.store(m_ptr, m, mask=mask)
    tl.store(v_ptr, v, mask=mask)
    tl.store(p_ptr, p, mask=mask)
    _store_outs(table, 4, n, t, offs, p, mask, N_OUTS)
    _store_sums(sums, old - p, old - p, mask, stride)


@triton.jit
def _copy_scaled_kernel(table, n, numel, scale_ptr, D: tl.constexpr, S: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(1)
    offs, mask = _block(numel, BLOCK)
    x = tl.load(_operand(table, 1, n, t, S) + offs, mask=mask)
    d_ptr = _operand(table, 0, n, t, D) + offs
    if D == tl.bfloat16:  # (src.to(dst) * scale.to(dst)), rounded to dst's dtype
        tl.store(d_ptr, _bf16(_bf16(x.to(tl.float32)).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)), mask=mask)
    else:
        tl.store(d_ptr, (x.to(tl.float32) * tl.load(scale_ptr).to(tl.float32)).to(D), mask=mask)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _table(operands: Sequence[Sequence[Tensor]]) -> tuple[Tensor, int, int]:
    """The device table of the operands' addresses (operand-major), the number of tensors and their size."""
    n, numel = len(operands[0]), operands[0][0].numel()
    for ts in operands:
        if len(ts) != n or any(t.numel() != numel or t.dtype != ts[0].dtype or not t.is_contiguous() for t in ts):
            raise ValueError("passes_triton: every operand needs one contiguous tensor of one size per entry, all of "
                             "one dtype")
    key = tuple(t.data_ptr() for ts in operands for t in ts)
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        device = operands[0][0].device
        host = torch.tensor(key, dtype=torch.int64, pin_memory=device.type == "cuda")
        table = _TABLES[key] = host.to(device, non_blocking=True)
    return table, n, numel


def _grid(n: int, numel: int) -> tuple[int, int]:
    return triton.cdiv(numel, BLOCK), n


def _sums(n: int, numel: int, device: torch.device) -> Tensor:
    return torch.empty(2, n * triton.cdiv(numel, BLOCK), dtype=torch.float32, device=device)


def muon_head(grads: list[Tensor], momentum_buffers: list[Tensor], directions: list[Tensor], hyper: Tensor,
              grad_scale: Tensor, grad_dtype: torch.dtype, nesterov: bool) -> None:
    """:func:`ds_async.optim.muon_pass._muon_directions`: momentum and bf16 directions of one run of tensors."""
    table, n, numel = _table([grads, momentum_buffers, directions])
    _muon_head_kernel[_grid(n, numel)](table, n, numel, hyper, grad_scale, G=_TL[grads[0].dtype],
                                       GRAD_BF16=grad_dtype == torch.bfloat16, NESTEROV=nesterov, BLOCK=BLOCK,
                                       num_warps=WARPS)


def muon_tail(params: list[Tensor], orthogonalised: list[Tensor], prev_updates: list[Tensor] | None,
              outs: list[list[Tensor]], hyper: Tensor, lr_index: int) -> Tensor:
    """:func:`ds_async.optim.muon_pass._muon_tail` over one run, its lr ``hyper[lr_index]``; returns the sums of
    squares ``[applied, base]`` (fp32, ``[2]``)."""
    ef = prev_updates is not None
    table, n, numel = _table([params, orthogonalised, *([prev_updates] if ef else []), *outs])
    sums = _sums(n, numel, params[0].device)
    _muon_tail_kernel[_grid(n, numel)](table, n, numel, hyper, lr_index, sums, sums.stride(0),
                                       O=_TL[orthogonalised[0].dtype], EF=ef, N_OUTS=len(outs), BLOCK=BLOCK,
                                       num_warps=WARPS)
    return sums.sum(1)


def ef_tail(params: list[Tensor], olds: list[Tensor], prev_updates: list[Tensor], outs: list[list[Tensor]],
            lam: Tensor) -> Tensor:
    """:func:`ds_async.optim.muon_pass._ef_tail` over one run; returns ``[applied, base]`` sums of squares."""
    table, n, numel = _table([params, olds, prev_updates, *outs])
    sums = _sums(n, numel, params[0].device)
    _ef_tail_kernel[_grid(n, numel)](table, n, numel, lam, sums, sums.stride(0), N_OUTS=len(outs), BLOCK=BLOCK,
                                     num_warps=WARPS)
    return sums.sum(1)


def adamw(params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
          outs: list[list[Tensor]], hyper: Tensor, grad_scale: Tensor, grad_dtype: torch.dtype) -> Tensor:
    """:func:`ds_async.optim.adamw_pass._adamw_pass` over one run; returns the update's sum of squares (0-dim)."""
    table, n, numel = _table([params, grads, exp_avgs, exp_avg_sqs, *outs])
    sums = _sums(n, numel, params[0].device)
    _adamw_kernel[_grid(n, numel)](table, n, numel, hyper, grad_scale, sums, sums.stride(0), G=_TL[grads[0].dtype],
                                   GRAD_BF16=grad_dtype == torch.bfloat16, N_OUTS=len(outs), BLOCK=BLOCK,
                                   num_warps=WARPS)
    return sums[0].sum()


def copy_scaled(dst: list[Tensor], src: list[Tensor], scale: Tensor) -> None:
    """:func:`ds_async.optim.clip._copy_scaled` over one run."""
    table, n, numel = _table([dst, src])
    _copy_scaled_kernel[_grid(n, numel)](table, n, numel, scale, D=_TL[dst[0].dtype], S=_TL[src[0].dtype],
                                         BLOCK=BLOCK, num_warps=WARPS)

