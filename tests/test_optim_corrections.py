"""Delay corrections on a quadratic under a one-step delay, against trajectories written out by hand; their state
across ``state_dict`` save/load.

Objective: ``f(X) = 1/2 tr(X^T A X) - tr(B^T X)`` over a matrix ``X`` (so Muon applies too), gradient
``A X - B``. One-step delay (PipeDream-2BW): the gradient of step ``t`` is taken at ``X(t-1)``, ``X(-1) = X(0)``.
"""
import io

import pytest
import torch
from torch import nn

from ds_async.pipe.delayed import DelayedTrainer
from ds_async.optim import SGD, AdamW, ErrorFeedback, Lion, Muon, NesterovLookahead, build_optimizer, optimizers

N, K = 6, 4


def problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(N, N, generator=gen, dtype=torch.float64)
    a = q @ q.T / N + 0.5 * torch.eye(N, dtype=torch.float64)
    return a, torch.randn(N, K, generator=gen, dtype=torch.float64), torch.randn(N, K, generator=gen,
                                                                                 dtype=torch.float64)


class Quadratic(nn.Module):
    """The objective as a "model" the emulation can train (its input is ignored)."""

    def __init__(self, a, b, x0):
        super().__init__()
        self.register_buffer("a", a)
        self.register_buffer("b", b)
        self.x = nn.Parameter(x0.clone())

    def forward(self, _):
        return 0.5 * (self.x * (self.a @ self.x)).sum() - (self.b * self.x).sum()


def emulated(optimizer_for, steps, seed=0):
    """Train the quadratic with ``ds_async.pipe.delayed.DelayedTrainer`` under the 2BW one-step delay."""
    a, b, x0 = problem(seed)
    model = Quadratic(a, b, x0)
    trainer = DelayedTrainer([model], [0], lambda out, _: out, optimizer_for(model), "2bw", micro_batches=1,
                             stages=1)
    xs = [model.x.detach().clone()]
    for _ in range(steps):
        trainer.train_batch([(torch.zeros(1), torch.zeros(1))])
        xs.append(model.x.detach().clone())
    return xs


def test_ef_trajectory_closed_form():
    """Plain SGD (lr h) with EF, lambda = 1: x(t+1) = x(t) - 2u(t-1) + u(t-2), u(s) = h (A x(s) - B), indexing
    updates by the point their gradient was taken at. Edge terms: x(-1) = x(0) (no older weights) and
    u(-2) := 0 on the first step (the EF buffer starts at zero), u(-1) = u(0)."""
    h, steps = 0.1, 12
    a, b, x0 = problem()
    u = lambda x: h * (a @ x - b)  # noqa: E731
    want = [x0]
    for t in range(steps):
        x_prev = want[t - 1] if t >= 1 else x0
        older = (u(want[t - 2]) if t >= 2 else u(x0)) if t >= 1 else torch.zeros_like(x0)
        want.append(want[t] - 2 * u(x_prev) + older)
    got = emulated(lambda m: SGD(m.parameters(), lr=h, correction=ErrorFeedback(1.0)), steps)
    for t, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12, msg=f"step {t}")
    # The correction changes the trajectory (or the comparison above would prove nothing about it).
    plain = emulated(lambda m: SGD(m.parameters(), lr=h), steps)
    assert (plain[-1] - got[-1]).abs().max() > 1e-2


OPTIMIZERS = {
    "adamw": lambda ps, c: AdamW(ps, lr=0.05, betas=(0.9, 0.95), weight_decay=0.0, correction=c),
    "sgd": lambda ps, c: SGD(ps, lr=0.1, momentum=0.9, nesterov=True, correction=c),
    "lion": lambda ps, c: Lion(ps, lr=0.01, betas=(0.9, 0.99), correction=c),
    "muon": lambda ps, c: Muon([dict(params=ps, use_muon=True)], lr=0.05, correction=c),
}


def delayed_run(make, correction, steps=8, seed=0):
    """Hand-written one-step-delayed loop; returns the iterates and the gradients fed."""
    a, b, x0 = problem(seed)
    x = x0.clone().requires_grad_()
    opt = make([x], correction)
    xs, grads, prev = [x.detach().clone()], [], x0.clone()
    for _ in range(steps):
        x.grad = a @ prev - b  # gradient at X(t-1)
        grads.append(x.grad.clone())
        prev = x.detach().clone()
        opt.step()
        xs.append(x.detach().clone())
    return xs, grads


def base_updates(make, grads):
    """The uncorrected optimizer's updates u(t) for the same gradients. Without weight decay no update depends on
    the parameter's value, so a second parameter starting anywhere gives them."""
    y = torch.zeros(N, K, dtype=torch.float64, requires_grad=True)
    opt = make([y], None)
    us = []
    for g in grads:
        before = y.detach().clone()
        y.grad = g.clone()
        opt.step()
        us.append(before - y.detach())
    return us


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ef_lambda_zero_is_the_plain_delayed_optimizer(name):
    plain, _ = delayed_run(OPTIMIZERS[name], None)
    ef0, _ = delayed_run(OPTIMIZERS[name], ErrorFeedback(0.0))
    for p, e in zip(plain, ef0):
        assert torch.equal(p, e)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ef_applies_twice_the_update_minus_the_previous(name):
    make = OPTIMIZERS[name]
    xs, grads = delayed_run(make, ErrorFeedback(1.0))
    us = base_updates(make, grads)
    for t in range(len(us)):
        want = 2 * us[t] - (us[t - 1] if t else 0)
        torch.testing.assert_close(xs[t] - xs[t + 1], want, rtol=1e-12, atol=1e-14, msg=f"{name} step {t}")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_lookahead_formula(name):
    """u'(t) = u(t) + tau (m(t) - m(t-1)), m(t) = mu m(t-1) + (1 - mu) u(t), m(-1) = u(0); and the weights are the
    uncorrected iterate moved tau steps ahead: x(t) = xbar(t) - tau m(t-1), xbar(t+1) = xbar(t) - u(t) (so
    xbar(0) = x(0) + tau u(0))."""
    mu, tau = 0.6, 2
    make = OPTIMIZERS[name]
    xs, grads = delayed_run(make, NesterovLookahead(momentum=mu, delay=tau))
    us = base_updates(make, grads)
    m_prev = us[0]
    xbar = xs[0] + tau * us[0]
    for t, u in enumerate(us):
        m = mu * m_prev + (1 - mu) * u
        torch.testing.assert_close(xs[t] - xs[t + 1], u + tau * (m - m_prev), rtol=1e-12, atol=1e-14)
        xbar = xbar - u
        torch.testing.assert_close(xs[t + 1], xbar - tau * m, rtol=1e-12, atol=1e-13)
        m_prev = m


@pytest.mark.parametrize("correction", [{"type": "ef", "lambda": 0.7}, {"type": "nesterov", "momentum": 0.8}])
def test_correction_state_survives_state_dict(correction):
    """Stop after 3 steps, save the optimizer, rebuild everything from the saved state, continue: the same as
    never stopping."""
    from test_optim import tiny_llama

    block = {"type": "Muon", "params": {"lr": 0.02, "weight_decay": 0.1, "adam_lr": 1e-3}}
    model = tiny_llama(1)
    opt = build_optimizer(block, model, correction=correction)
    gen = torch.Generator().manual_seed(0)
    grads = [[torch.randn(p.shape, generator=gen) for p in model.parameters()] for _ in range(6)]

    def run(m, o, steps):
        for gs in steps:
            for p, g in zip(m.parameters(), gs):
                p.grad = g.clone()
            o.step()

    run(model, opt, grads[:3])
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
    key = opt.correction.buffer_key
    assert all(key in opt.state[p] for p in model.parameters())
    run(model, opt, grads[3:])

    saved.seek(0)
    ckpt = torch.load(saved, weights_only=True)
    resumed = tiny_llama(1)
    resumed.load_state_dict(ckpt["model"])
    opt2 = build_optimizer(block, resumed, correction=correction)
    opt2.load_state_dict(ckpt["optimizer"])
    run(resumed, opt2, grads[3:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)
    # Without the correction's buffer the continuation differs: the test can tell.
    resumed.load_state_dict(ckpt["model"])
    opt3 = build_optimizer(block, resumed, correction=correction)
    stripped = ckpt["optimizer"]
    for s in stripped["state"].values():
        s.pop(key)
    opt3.load_state_dict(stripped)
    run(resumed, opt3, grads[3:])
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), resumed.parameters()))


@pytest.mark.parametrize("correction", [ErrorFeedback(1.0), NesterovLookahead(0.8)])
def test_chunked_apply_equals_whole_group(monkeypatch, correction):
    """Updates are applied with foreach kernels over chunks of parameters; where the chunks fall must not change
    a single bit of the parameters or the optimizer state. The statistics are sums over the chunks, added in
    another grouping, so they agree to rounding."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(6, 4), (5,), (3, 7), (7, 3), (2,)]
    base = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]

    def run(chunk_numel):
        monkeypatch.setattr(optimizers, "APPLY_CHUNK_NUMEL", chunk_numel)
        params = [b.clone().requires_grad_() for b in base]
        opt = AdamW(params, lr=0.05, weight_decay=0.1, correction=correction)
        for gs in grads:
            for p, g in zip(params, gs):
                p.grad = g.clone()
            opt.step()
        return params, opt

    whole, opt_whole = run(2 ** 28)
    single, opt_single = run(1)  # every parameter a chunk of its own
    for a, b in zip(whole, single):
        assert torch.equal(a, b)
    for a, b in zip(whole, single):
        for key, value in opt_whole.state[a].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_single.state[b][key])), key
    assert opt_whole.stats().keys() == opt_single.stats().keys()
    for key, value in opt_whole.stats().items():
        assert value == pytest.approx(opt_single.stats()[key], rel=1e-6), key
