"""The optimizer's Triton passes (:mod:`ds_async.optim.passes_triton`, what GPUs run) against the eager passes.

Each pass runs over runs of same-shaped tensors (odd sizes, several blocks, so masks and the address tables are
exercised) and must write what the eager pass writes into the same buffers, up to last-bit rounding (the GPU compiler
fuses multiply-adds, as CUDA's eager kernels do): fp32 state to 1e-5 relative, bf16 directions to one bf16 rounding
of such a difference; every bf16 output is exactly the bf16 of its new master, and the scaled copy is exact. On a CPU
the kernels run under Triton's interpreter in a child process (it reads ``TRITON_INTERPRET`` when Triton is
imported: ``python tests/test_passes_triton.py``); on a GPU in process.
"""
import pytest
import torch

from interpreter import run_interpreted

from ds_async.optim import adamw_pass, clip, muon_pass
from ds_async.optim.adamw_pass import adamw_hyper
from ds_async.optim.gpu import same_shape_runs
from ds_async.optim.muon import orthogonalise_batched
from ds_async.optim.muon_pass import muon_hyper

SHAPES = [(32, 16), (70, 130), (32, 16), (3, 24, 8), (70, 130), (37, 5)]


def test_triton_passes_under_the_interpreter():
    run_interpreted(__file__, 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_triton_passes_on_the_gpu():
    assert _check(torch.device("cuda")) == 6


def _close(have, want, what, rtol=1e-5):
    for k, (h, w) in enumerate(zip(have, want)):
        torch.testing.assert_close(h.cpu().float(), w.float(), rtol=rtol, atol=1e-7, msg=lambda m: f"{what} {k}: {m}")


def _check_outs_and_sums(outs, masters, have, want):
    """Every bf16 out is exactly its new master's bf16; the pass's sums of squares match the eager pass's."""
    assert all(torch.equal(a, m.to(torch.bfloat16)) for a, m in zip(outs, masters)), "bf16 out"
    torch.testing.assert_close(have.cpu(), want, rtol=1e-5, atol=0)


def _on(device, tensors):
    return [t.to(device, copy=True) for t in tensors]  # a copy on the CPU too


def _check(device: torch.device) -> int:
    from ds_async.optim import passes_triton

    gen = torch.Generator().manual_seed(3)

    def randn(scale=1.0, dtype=torch.float32):
        return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in SHAPES]

    grads, masters, momenta, prevs = randn(dtype=torch.bfloat16), randn(0.02), randn(0.1), randn(1e-3)
    ortho = [o.contiguous() for o in orthogonalise_batched(randn())]
    runs = same_shape_runs(masters)
    assert runs == [[0, 2], [1, 4], [3], [5]]
    done = 0
    for grad_dtype in (torch.float32, torch.bfloat16):
        scale = torch.tensor(0.37719).to(grad_dtype)
        for nesterov in (True, False):
            hyper = muon_hyper(dict(lr=0.02, momentum=0.95, weight_decay=0.1, lr_rule="original"), SHAPES,
                               torch.device("cpu"), 1.0)
            bs, ds = [b.clone() for b in momenta], [torch.empty(s, dtype=torch.bfloat16) for s in SHAPES]
            bs2, ds2 = _on(device, momenta), _on(device, ds)
            g2, h2, s2 = _on(device, grads), hyper.to(device), scale.to(device)
            for ks in runs:
                muon_pass._muon_directions([grads[k] for k in ks], [bs[k] for k in ks], [ds[k] for k in ks], hyper,
                                           scale, grad_dtype, nesterov)
                passes_triton.muon_head([g2[k] for k in ks], [bs2[k] for k in ks], [ds2[k] for k in ks], h2, s2,
                                        grad_dtype, nesterov)
            _close(bs2, bs, "momentum")
            # a last-bit difference of the fp32 direction may flip its bf16 rounding: 2^-8 relative
            _close(ds2, ds, "direction", rtol=2 ** -8)
    print("ok Muon head (grad dtypes, Nesterov or not)")
    done += 1

    for ef in (True, False):
        ms, ps, outs = [m.clone() for m in masters], [p.clone() for p in prevs], [torch.empty(s) for s in SHAPES]
        ms2, ps2, ortho2, h2 = _on(device, masters), _on(device, prevs), _on(device, ortho), hyper.to(device)
        outs2 = [[torch.empty(s, dtype=torch.bfloat16, device=device) for s in SHAPES] for _ in range(2)]
        want = have = 0
        for ks in runs:
            want = want + muon_pass._muon_tail([ms[k] for k in ks], [ortho[k] for k in ks],
                                               [ps[k] for k in ks] if ef else None, [[outs[k] for k in ks]], hyper,
                                               4 + ks[0])
            have = have + passes_triton.muon_tail([ms2[k] for k in ks], [ortho2[k] for k in ks],
                                                  [ps2[k] for k in ks] if ef else None,
                                                  [[o[k] for k in ks] for o in outs2], h2, 4 + ks[0])
        _close(ms2, ms, f"master (EF {ef})")
        _close(ps2, ps if ef else prevs, f"EF buffer (EF {ef})")
        for o in outs2:
            _check_outs_and_sums(o, ms2, have, want)
        assert (want[1] > 0) == ef
    print("ok Muon tail (with and without EF)")
    done += 1

    olds = randn(0.02)
    news = [o * 0.999 for o in olds]
    ms, ps = [m.clone() for m in news], [p.clone() for p in prevs]
    ms2, ps2, olds2 = _on(device, news), _on(device, prevs), _on(device, olds)
    outs2 = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in SHAPES]
    lam = torch.tensor(0.5)
    want, have = 0, 0
    for ks in runs:
        want = want + muon_pass._ef_tail([ms[k] for k in ks], [olds[k] for k in ks], [ps[k] for k in ks], [], lam)
        have = have + passes_triton.ef_tail([ms2[k] for k in ks], [olds2[k] for k in ks], [ps2[k] for k in ks],
                                            [[outs2[k] for k in ks]], lam.to(device))
    _close(ms2, ms, "EF master")
    _close(ps2, ps, "EF buffer")
    _check_outs_and_sums(outs2, ms2, have, want)
    print("ok EF tail")
    done += 1

    for grad_dtype in (torch.float32, torch.bfloat16):
        group = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        hyper = adamw_hyper(group, 3, torch.device("cpu"))
        scale = torch.tensor(0.5).to(grad_dtype)
        ms, m1, v1 = [m.clone() for m in masters], [b.clone() for b in momenta], [b.square() for b in momenta]
        ms2, m2, v2 = _on(device, ms), _on(device, m1), _on(device, v1)
        g2, h2, s2 = _on(device, grads), hyper.to(device), scale.to(device)
        outs2 = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in SHAPES]
        want = have = 0
        for ks in runs:
            want = want + adamw_pass._adamw_pass([ms[k] for k in ks], [grads[k] for k in ks], [m1[k] for k in ks],
                                                 [v1[k] for k in ks], [], hyper, scale, grad_dtype, True)
            have = have + passes_triton.adamw([ms2[k] for k in ks], [g2[k] for k in ks], [m2[k] for k in ks],
                                              [v2[k] for k in ks], [[outs2[k] for k in ks]], h2, s2, grad_dtype)
        _close(ms2, ms, "AdamW master")
        _close(m2, m1, "AdamW exp_avg")
        _close(v2, v1, "AdamW exp_avg_sq")
        _check_outs_and_sums(outs2, ms2, have, want)
    print("ok AdamW (grad dtypes)")
    done += 1

    scale = torch.tensor(0.0123)
    for dst_dtype in (torch.float32, torch.bfloat16):
        src = randn()
        want = [torch.empty(s, dtype=dst_dtype) for s in SHAPES]
        have = [torch.full(s, float("nan"), dtype=dst_dtype, device=device) for s in SHAPES]
        for ks in runs:
            clip._copy_scaled([want[k] for k in ks], [src[k].bfloat16() for k in ks], scale)
            passes_triton.copy_scaled([have[k] for k in ks], [src[k].bfloat16().to(device) for k in ks],
                                      scale.to(dst_dtype).to(device))
        assert all(torch.equal(h.cpu(), w) for h, w in zip(have, want)), dst_dtype
    print("ok scaled copy (fp32 and bf16)")
    done += 1

    with pytest.raises(ValueError, match="contiguous"):
        passes_triton.copy_scaled([torch.empty(4, 6, device=device).mT], [torch.empty(6, 4, device=device)], scale)
    print("ok refuses a strided tensor")
    return done + 1


if __name__ == "__main__":
    _check(torch.device("cpu"))
