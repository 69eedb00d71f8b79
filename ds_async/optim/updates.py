"""Elementwise update rules as pure functions: AdamW, SGD with momentum, Lion.

Each ``*_step`` function advances the optimizer state it is given (in place) and returns the parameter's new
value as a new tensor, leaving the parameter alone; the update is ``u = x - new`` (learning rate and decoupled
weight decay included). The optimizer classes form ``u`` and apply it in one place, where a delay correction can
act on it.

The arithmetic is ``torch.optim``'s single-tensor implementation op for op (weight decay as ``x * (1 - lr * wd)``,
then the fused ``addcdiv``/``add`` with ``-lr``), so without a correction the result is bit-equal to torch's.
They work on tensors of any shape, DeepSpeed's flat 1-D ZeRO partitions included.
"""
from __future__ import annotations

from torch import Tensor


def decayed(param: Tensor, lr: float, weight_decay: float) -> Tensor:
    """A new tensor ``x * (1 - lr * weight_decay)``: decoupled weight decay, as torch applies it."""
    return param.mul(1 - lr * weight_decay) if weight_decay else param.clone()


def adamw_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step: int, *, lr: float,
               betas: tuple[float, float], eps: float, weight_decay: float) -> Tensor:
    """AdamW (Loshchilov & Hutter) with bias correction; ``step`` counts from 1 and includes this step.

    ``new = x (1 - lr wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``
    """
    beta1, beta2 = betas
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = lr / (1 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    return decayed(param, lr, weight_decay).addcdiv_(exp_avg, denom, value=-step_size)


def sgd_step(param: Tensor, grad: Tensor, momentum_buffer: Tensor | None, *, lr: float, momentum: float,
             dampening: float, nesterov: bool, weight_decay: float) -> tuple[Tensor, Tensor | None]:
    """SGD with (optionally Nesterov) momentum and decoupled weight decay; returns ``(new, momentum_buffer)``.

    The buffer starts as the first gradient (torch's convention) and is ``None`` without momentum.
    ``new = x (1 - lr wd) - lr d`` with ``d`` the gradient, the buffer or ``g + momentum * buffer``. Unlike
    ``torch.optim.SGD`` the weight decay is decoupled (not added to the gradient, so momentum never sees it);
    with ``weight_decay = 0`` the two are the same.
    """
    direction = grad
    if momentum:
        if momentum_buffer is None:
            momentum_buffer = grad.detach().clone()
        else:
            momentum_buffer.mul_(momentum).add_(grad, alpha=1 - dampening)
        direction = grad.add(momentum_buffer, alpha=momentum) if nesterov else momentum_buffer
    return decayed(param, lr, weight_decay).add_(direction, alpha=-lr), momentum_buffer


def lion_step(param: Tensor, grad: Tensor, exp_avg: Tensor, *, lr: float, betas: tuple[float, float],
              weight_decay: float) -> Tensor:
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    ``new = x (1 - lr wd) - lr * sign(beta1 m + (1 - beta1) g)``, then ``m <- beta2 m + (1 - beta2) g``.
    """
    beta1, beta2 = betas
    direction = exp_avg.lerp(grad, 1 - beta1).sign_()
    exp_avg.lerp_(grad, 1 - beta2)
    return decayed(param, lr, weight_decay).add_(direction, alpha=-lr)
