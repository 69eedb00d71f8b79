"""Delay corrections: transforms of the update ``u(t) = x(t) - x(t+1)`` a base optimizer produced, applied in its
place. They act on ``u`` and on their own per-parameter buffer only, never on which weights the forward pass
uses, so they compose with every optimizer in :mod:`ds_async.optim` and every engine (2BW, PipeDream, the
emulation). Their buffers live in the optimizer's per-parameter ``state``, so they are saved and loaded with the
optimizer's ``state_dict`` and sharded with it.

Notation: under PipeDream-2BW the gradient of step ``t`` is evaluated at ``x(t-1)`` (a one-step delay), and the
base optimizer turns it into ``u(t)``. Uncorrected: ``x(t+1) = x(t) - u(t)``.

Two corrections, both extrapolations of the update sequence:

``ErrorFeedback`` (``"ef"``) applies ``u(t) + lambda * (u(t) - u(t-1))``. With ``lambda = 1`` and a one-step
delay this is ``x(t+1) = x(t) - 2 u(t) + u(t-1)``; indexing updates by the weights their gradient was taken at
(``u(t)`` here is ``u(t-1)`` there) it is the ``x(t+1) = x(t) - 2u(t-1) + u(t-2)`` of the delay-compensation
literature. The stale gradient's update is extrapolated linearly to where the fresh one would be; for a delay
``tau`` use ``lambda = tau``. First step: ``u(-1) = 0``, so the first applied update is ``(1 + lambda) u(0)``.

``NesterovLookahead`` (``"nesterov"``) is a weight-space look-ahead, the idea behind Ajanthan et al.'s NAG variant
(ICML 2025, arXiv:2505.01099, "Nesterov Method for Asynchronous Pipeline Parallel Optimization": NAG takes the
gradient at a point ahead of the iterate along its momentum) and behind SpecTrain's weight prediction: publish
weights that are ahead of the iterate along its direction of travel by as many steps as the gradient will be
late, so that the late gradient is (to first order) the gradient at the iterate. Exactly:

    m(t)  = mu * m(t-1) + (1 - mu) * u(t)            velocity estimate, an EMA of the base updates
    u'(t) = u(t) + tau * (m(t) - m(t-1))              applied update
          = u(t) + tau * (1 - mu) * (u(t) - m(t-1))

Writing ``x(t) = W(t) + tau * m(t-1)`` for the published weights ``W`` gives ``x(t+1) = x(t) - u(t)``: ``x`` is
the uncorrected optimizer's iterate and ``W(t) = x(t) - tau * m(t-1)`` is that iterate moved ``tau`` steps ahead
at the estimated velocity. Why it corrects a delay of one (``tau = 1``): the gradient of step ``t`` is taken at
``W(t-1) = x(t-1) - m(t-2)``; with a steady velocity ``m ~ u`` that is ``x(t-1) - u(t-1) = x(t)``, so the
iterate ``x`` receives the gradient at itself, as an undelayed optimizer would. For a sequence of updates that
changes linearly, ``u(t) - m(t-1) = slope / (1 - mu)`` and the correction adds exactly ``tau * slope``.

Why this form rather than the paper's own: their algorithm changes the optimizer's momentum itself (their code
is NAdamW with beta1 = 0.99, whose look-ahead distance is tied to its momentum coefficient); as a transform of
``u`` the look-ahead must carry its own velocity estimate, and its distance is set by the delay ``tau`` instead.
With ``mu = 0`` it is ``ErrorFeedback`` with ``lambda = tau`` (up to the first step); ``mu > 0`` averages the
velocity over ``~1/(1-mu)`` steps, which damps the noise the correction adds (EF's difference of two single-step
updates gives the applied update 5x the noise variance of ``u`` at ``lambda = 1``), at the price of following
changes of direction ``~mu/(1-mu)`` steps late. First step: ``m(-1) = u(0)`` (the buffer starts at the first
update), so the first applied update is ``u(0)`` unchanged.

Neither correction widens the range of stable step sizes of plain gradient descent on a quadratic with a one-step
delay (stable for ``lr * curvature < 1``): both extrapolate, and EF at ``lambda = 1`` already diverges at 0.9.
What they buy is a smaller bias of the update direction for step sizes well inside that range.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..config import correction_config


class Correction:
    """A transform of each parameter's update; subclasses keep what they need in ``state`` under ``buffer_key``
    (one parameter-sized tensor)."""

    name: str = "correction"
    buffer_key: str = ""

    def __call__(self, us: list[Tensor], states: list[dict]) -> list[Tensor]:
        """For the updates ``us`` of several parameters (``states``: their optimizer states), the terms ``e`` to
        add: ``u + e`` is applied instead of ``u`` (new tensors; ``us`` are left alone). Returning the difference
        rather than ``u + e`` keeps a zero correction bit-exact. Foreach kernels over the list: the same
        arithmetic per element as one call per parameter."""
        raise NotImplementedError

    def _buffers(self, us: list[Tensor], states: list[dict], init) -> list[Tensor]:
        """Each parameter's buffer, created as ``init(u)`` on its first step."""
        for u, state in zip(us, states):
            if self.buffer_key not in state:
                state[self.buffer_key] = init(u)
        return [state[self.buffer_key] for state in states]

    def buffer(self, state: dict) -> Tensor | None:
        return state.get(self.buffer_key)


@dataclass
class ErrorFeedback(Correction):
    """``u(t) + lam * (u(t) - u(t-1))``; ``lam = 0`` is the base optimizer exactly."""

    lam: float = 1.0
    name = "ef"
    buffer_key = "ef_prev_update"

    def __call__(self, us, states):
        # u(-1) = 0: the buffer starts at zero (allocated on the first step, like the optimizers' own state).
        prevs = self._buffers(us, states, torch.zeros_like)
        extras = torch._foreach_sub(us, prevs)
        torch._foreach_mul_(extras, self.lam)
        torch._foreach_copy_(prevs, us)
        return extras


@dataclass
class NesterovLookahead(Correction):
    """``u(t) + tau * (1 - mu) * (u(t) - m(t-1))`` with ``m`` an EMA of the updates (see the module docstring)."""

    momentum: float = 0.9
    delay: int = 1
    name = "nesterov"
    buffer_key = "lookahead_velocity"

    def __post_init__(self):
        if not 0.0 <= self.momentum < 1.0:
            raise ValueError(f"nesterov correction: momentum must be in [0, 1), got {self.momentum}")
        if self.delay < 0:
            raise ValueError(f"nesterov correction: delay must be >= 0, got {self.delay}")

    def __call__(self, us, states):
        # m(-1) = u(0): no velocity is known before the first update, and a zero start would read the whole first
        # update as acceleration.
        velocities = self._buffers(us, states, lambda u: u.detach().clone())
        # m(t) - m(t-1) = (1 - mu) * (u(t) - m(t-1))
        deltas = torch._foreach_sub(us, velocities)
        torch._foreach_add_(velocities, deltas, alpha=1 - self.momentum)
        torch._foreach_mul_(deltas, self.delay * (1 - self.momentum))
        return deltas


def build_correction(spec) -> Correction | None:
    """A correction from ``None``, a :class:`Correction`, a ``ds_async.config_sections.CorrectionConfig`` or its JSON
    dict (``{"type": "ef", "lambda": 1.0}``, ``{"type": "nesterov", "momentum": 0.9, "delay": 1}``,
    ``{"type": "none"}``; strict: an unknown key, or a key of another type, raises naming it)."""
    if isinstance(spec, Correction):
        return spec
    cfg = correction_config(spec)
    if cfg.type == "ef":
        return ErrorFeedback(lam=1.0 if cfg.lam is None else cfg.lam)
    if cfg.type == "nesterov":
        return NesterovLookahead(momentum=0.9 if cfg.momentum is None else cfg.momentum,
                                 delay=1 if cfg.delay is None else cfg.delay)
    return None
