"""bf16 weights with fp32 master weights, held by ds_async's optimizers per whole tensor.

DeepSpeed's bf16 optimizer hands its optimizer flat fp32 partitions, which an elementwise rule accepts and a
matrix rule (Muon) cannot. :class:`MasterWeights` keeps the master weights itself instead: the optimizer built
over the module's fp32 parameters keeps those tensors as its masters (with its momentum, moments and delay-correction
buffers, all per whole tensor), and the module gets bf16 copies in their place. Forwards, backwards, weight-version
slots and gradient all-reduces run in bf16; a step reads the bf16 gradients (times the clip factor) in fp32, steps
the masters and writes them, rounded, into the module's weights and any other bf16 outputs (the new weight version
of a flush-free pipeline). DeepSpeed sees an fp32 job with a client optimizer.

``fused`` steps Muon in a few passes per tensor (:func:`ds_async.optim.muon_pass.hybrid_muon_step_`) instead of
the optimizer's own ``step`` and the copies around it; both give the same bits on CPU.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .muon_pass import hybrid_muon_step_

LOW = torch.bfloat16


class MasterWeights(torch.optim.Optimizer):
    """Wrap ``optimizer`` (built over ``module``'s fp32 parameters) so that ``module`` trains in bf16.

    On construction every parameter of ``optimizer`` found in ``module`` is replaced there by a bf16 copy (a new
    ``nn.Parameter``), and the masters move to ``device``; :attr:`masters` and :attr:`weights` list the fp32 masters and their bf16 weights in the same
    order. ``param_groups`` and ``state`` are the wrapped optimizer's (LR schedulers reach it through either).
    ``optimizer`` may be a :class:`~ds_async.optim.sharded.ShardedOptimizer`: its owners step their masters and
    broadcast them, and every rank writes its bf16 weights.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, fused: bool = False,
                 device: torch.device | str | None = None):
        self.optimizer, self.fused = optimizer, fused
        self.masters: list[Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        if any(optimizer.state.values()):
            raise ValueError("MasterWeights: wrap the optimizer before its first step")
        index = {id(p): i for i, p in enumerate(self.masters)}
        weights: list[nn.Parameter | None] = [None] * len(self.masters)
        for owner in module.modules():
            for name, p in list(owner.named_parameters(recurse=False)):
                i = index.get(id(p))
                if i is None:
                    continue
                if weights[i] is None:
                    weights[i] = nn.Parameter(p.detach().to(LOW), requires_grad=p.requires_grad)
                owner._parameters[name] = weights[i]
        missing = [i for i, w in enumerate(weights) if w is None]
        if missing:
            raise ValueError(f"MasterWeights: {len(missing)} of the optimizer's parameters are not in the module")
        if any(m.dtype != torch.float32 for m in self.masters):
            raise ValueError("MasterWeights: the optimizer's parameters (the masters) must be fp32")
        self.weights: list[nn.Parameter] = weights
        if device is not None:  # DeepSpeed moves the module (the bf16 weights) to the device, not the masters
            for m in self.masters:
                m.data = m.data.to(device)
        super().__init__(self.masters, optimizer.defaults)
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def master_of(self, weight: Tensor) -> Tensor:
        """The fp32 master of one of the module's bf16 :attr:`weights`."""
        if not hasattr(self, "_master_of"):
            self._master_of = {id(w): m for w, m in zip(self.weights, self.masters)}
        return self._master_of[id(weight)]

    def step(self, closure=None):
        if closure is not None:
            raise NotImplementedError("MasterWeights does not support closure")
        self.step_with()

    @torch.no_grad()
    def step_with(self, scale: Tensor | None = None, outs: list[list[Tensor]] = (),
                  clipped_norm: Tensor | None = None) -> None:
        """Step the masters from the bf16 gradients on :attr:`weights` times ``scale`` (a 0-dim tensor, the clip
        factor; ``None``: 1), then write them rounded into :attr:`weights` and every list of ``outs`` (bf16 tensors
        in :attr:`masters`' order). ``clipped_norm``: the gradient norm ``scale`` came from, for the report."""
        if clipped_norm is not None:
            self._global_grad_norm = clipped_norm
        grads = [w.grad for w in self.weights]
        for w in self.weights:
            w.grad = None
        if self.fused:
            device = self.masters[0].device
            one = torch.ones((), device=device)
            hybrid_muon_step_(self.optimizer, grads, one if scale is None else scale, [self.weights, *outs],
                              orthogonalise=self.optimizer.orthogonalise)
            return
        for m, g in zip(self.masters, grads):
            m.grad = None if g is None else g.float() if scale is None else g.float() * scale.float()
        self.optimizer.step()
        for m in self.masters:
            m.grad = None
        for out in (self.weights, *outs):
            torch._foreach_copy_(list(out), self.masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for w in self.weights:
            w.grad = None

    def state_dict(self) -> dict:
        """The wrapped optimizer's state and the fp32 masters (the module's bf16 weights are saved with the model)."""
        return {"optimizer": self.optimizer.state_dict(), "masters": [m.detach().cpu().clone() for m in self.masters]}

    def load_state_dict(self, state_dict: dict) -> None:
        masters = state_dict["masters"]
        if len(masters) != len(self.masters) or any(a.shape != b.shape for a, b in zip(masters, self.masters)):
            raise ValueError("MasterWeights: the saved master weights do not fit this model's parameters")
        self.optimizer.load_state_dict(state_dict["optimizer"])
        with torch.no_grad():
            torch._foreach_copy_(self.masters, [m.to(self.masters[0].device) for m in masters])
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
