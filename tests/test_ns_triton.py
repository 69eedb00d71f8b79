"""Muon's Triton Newton-Schulz (:mod:`ds_async.optim.ns_triton`) on a CPU under Triton's interpreter.

The kernel computes the upper triangle's tiles of ``alpha X X^T + beta D`` and mirrors them: against fp32 products
(odd sizes, so partial tiles and the mirror's masks are exercised) and, through five iterations, as close to the
fp32 iteration as the matmul path is. The interpreter reads ``TRITON_INTERPRET`` when Triton is imported, so the
checks run in a child process (``python tests/test_ns_triton.py``). GPU timing and bit-equality with cuBLAS:
``launch/bench/bench_newton_schulz.py``.
"""
import torch

from interpreter import run_interpreted


def test_symmetric_newton_schulz_under_the_interpreter():
    run_interpreted(__file__, 8)


def _newton_schulz_fp32(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic iteration in fp32 throughout: what both bf16 versions approximate."""
    from ds_async.optim.muon import NS_COEFFICIENTS, NS_EPS

    a, b, c = NS_COEFFICIENTS
    x = g.mT if g.size(-2) > g.size(-1) else g
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if g.size(-2) > g.size(-1) else x


def _check() -> None:
    from ds_async.optim.muon import zeropower_matmul, zeropower_symmetric
    from ds_async.optim.ns_triton import sym_product

    gen = torch.Generator().manual_seed(0)
    for batch, m, k in ((2, 70, 150), (1, 130, 64)):
        x = torch.randn(batch, m, k, generator=gen).bfloat16()
        want = x.float() @ x.float().mT
        got = sym_product(x, blocks=(32, 32), upcast=True)
        assert got.dtype == torch.bfloat16 and torch.equal(got, got.mT), "not symmetric"
        err = ((got.float() - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, (batch, m, k, err)  # bf16 rounding of the result: 2^-8
        print(f"ok sym_product {batch}x{m}x{k}: rel err {err:.2e}")
        d = want.bfloat16()
        got = sym_product(d, d, alpha=2.0, beta=-3.0, blocks=(32, 32), upcast=True)
        want2 = 2.0 * d.float() @ d.float().mT - 3.0 * d.float()
        err2 = ((got.float() - want2).abs().max() / want2.abs().max()).item()
        assert err2 < 1e-2, (batch, m, k, err2)
        print(f"ok sym_product with d {batch}x{m}x{m}: rel err {err2:.2e}")
    for shape in ((96, 96), (2, 200, 96), (96, 200), (3, 40, 72)):
        g = torch.randn(shape, generator=gen).bfloat16()
        got = zeropower_symmetric(g, 5, blocks=(32, 32), upcast=True)
        ref = zeropower_matmul(g, 5)
        assert got.shape == ref.shape and got.dtype == torch.bfloat16
        exact = _newton_schulz_fp32(g.float(), 5)
        own = ((got.float() - exact).norm() / exact.norm()).item()
        theirs = ((ref.float() - exact).norm() / exact.norm()).item()
        assert own < 1.2 * theirs, (shape, own, theirs)  # bf16 rounding of the same size, not another iteration
        print(f"ok newton-schulz {shape}: from the fp32 iteration {own:.2e} (matmul path {theirs:.2e})")


if __name__ == "__main__":
    _check()
