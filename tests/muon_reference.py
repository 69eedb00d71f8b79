"""A slow, plainly written hybrid Muon + AdamW, only for tests of :class:`ds_async.optim.Muon`.

Everything is float64, one matrix at a time, with the textbook formulas; the caller says which parameters are
matrices (no role machinery). The Newton-Schulz iteration is the same polynomial as the fast version's but in
float64 instead of bf16, so the two agree to bf16 accuracy of the orthogonalised direction, not bit for bit.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

A, B, C = 3.4445, -4.7750, 2.0315


def newton_schulz(g: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """One matrix: ``X = G / |G|_F``, then ``steps`` times ``X <- a X + (b XX^T + c (XX^T)^2) X``."""
    transposed = g.shape[0] > g.shape[1]
    x = g.T if transposed else g
    x = x / max(x.norm().item(), eps)
    for _ in range(steps):
        gram = x @ x.T
        x = A * x + (B * gram + C * gram @ gram) @ x
    return x.T if transposed else x


def orthogonalise(g: Tensor, steps: int = 5) -> Tensor:
    """Each matrix of a 2-D tensor or of a stack (leading dimensions), separately."""
    if g.ndim == 2:
        return newton_schulz(g, steps)
    return torch.stack([orthogonalise(m, steps) for m in g])


class ReferenceHybridMuon:
    """Muon on ``matrices``, AdamW on ``others``; parameters are updated in place (their dtype is kept, the
    arithmetic is float64)."""

    def __init__(self, matrices: list[Tensor], others: list[Tensor], lr: float, momentum: float, nesterov: bool,
                 ns_steps: int, weight_decay: float, lr_rule: str, adam_lr: float, adam_betas: tuple[float, float],
                 adam_eps: float, adam_weight_decay: float):
        self.matrices, self.others = matrices, others
        self.lr, self.momentum, self.nesterov, self.ns_steps = lr, momentum, nesterov, ns_steps
        self.weight_decay, self.lr_rule = weight_decay, lr_rule
        self.adam_lr, self.adam_betas, self.adam_eps, self.adam_wd = adam_lr, adam_betas, adam_eps, adam_weight_decay
        self.buffers = [torch.zeros(p.shape, dtype=torch.float64) for p in matrices]
        self.m = [torch.zeros(p.shape, dtype=torch.float64) for p in others]
        self.v = [torch.zeros(p.shape, dtype=torch.float64) for p in others]
        self.t = 0

    def scale(self, shape) -> float:
        rows, cols = shape[-2], shape[-1]
        if self.lr_rule == "original":
            return math.sqrt(max(1.0, rows / cols))
        return 0.2 * math.sqrt(max(rows, cols))

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        mu = self.momentum
        for p, buf in zip(self.matrices, self.buffers):
            x, g = p.double(), p.grad.double()
            buf.mul_(mu).add_((1 - mu) * g)
            d = (1 - mu) * g + mu * buf if self.nesterov else buf
            new = x - self.lr * self.weight_decay * x - self.lr * self.scale(p.shape) * orthogonalise(d, self.ns_steps)
            p.copy_(new)
        b1, b2 = self.adam_betas
        for p, m, v in zip(self.others, self.m, self.v):
            x, g = p.double(), p.grad.double()
            m.mul_(b1).add_((1 - b1) * g)
            v.mul_(b2).add_((1 - b2) * g * g)
            m_hat, v_hat = m / (1 - b1 ** self.t), v / (1 - b2 ** self.t)
            p.copy_(x - self.adam_lr * self.adam_wd * x - self.adam_lr * m_hat / (v_hat.sqrt() + self.adam_eps))
