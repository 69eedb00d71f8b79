"""How a pipeline stage's optimizer takes the pipeline's gradient norm and steps, one plan per kind of optimizer.

The engine computes the pipeline's squared gradient norm ahead of the step (each stage's share at its batch
boundary, gathered over the stages when the step is issued) and asks its plan for the step to run, with that norm
(and, under a flush-free rule, the slot of the new weight version) bound as explicit arguments; DeepSpeed's step
bookkeeping around it (LR scheduler, counters) runs unchanged (:func:`~ds_async.pipe.bf16.stepping_with`).

- :class:`StepPlan`: fp32 weights or DeepSpeed's ZeRO optimizers: DeepSpeed's own step; the engine's
  ``clip_fp32_gradients`` clips fp32 gradients by the norm (ZeRO computes its own).
- :class:`DeepSpeedBF16Step`: DeepSpeed's bf16 optimizer under a flush-free rule (:mod:`ds_async.pipe.bf16`).
- :class:`MasterWeightsStep`: ds_async's own fp32 masters under bf16 weights (:mod:`ds_async.optim.master`).
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ..optim.clip import clip_coefficient
from . import bf16


FUSED_NEEDS = ("performance.fused_optimizer_step needs a flush-free schedule, DeepSpeed's bf16 optimizer (bf16 "
               "enabled, ZeRO off) over torch's AdamW (\"torch_adam\": true, no amsgrad), one data-parallel replica "
               "and no MoE layers; or ds_async's Muon under bf16")


def clip_factor(sq: torch.Tensor | None, clip: float) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(norm, clip factor) from the pipeline's squared gradient norm, ``(None, None)`` with clipping off."""
    if clip <= 0.0:
        return None, None
    if sq is None:
        raise RuntimeError("optimizer step without this batch's gradient norm: its gradients were never reduced "
                           "(every step must follow its batch's ReduceGrads)")
    return clip_coefficient(sq, clip)


def slot_indices(entries, weights: list[torch.Tensor]) -> list[int]:
    """For some of the module's weights, each one's index in a weight-version slot (``WeightVersions.entries``)."""
    slot_of = {id(weight): k for k, (_, _, weight) in enumerate(entries)}
    return [slot_of[id(w)] for w in weights]


class StepPlan:
    """DeepSpeed's own step. ``own_norm``: DeepSpeed's optimizer computes the norm itself at step time (ZeRO,
    fp16, DeepSpeed's bf16 optimizer as it is): a barrier between stages, but correct. ``bf16_optimizer``: a
    DeepSpeed bf16 optimizer the gathered gradients are handed to (its hooks never fire on weight-version slots)."""

    grads_wait = False
    """Whether the batch's bf16 gradients stay on the parameters until the step reads them (no hand-over)."""
    writes_slot = False
    """Whether the step writes the new weight version's slot itself (the engine then does not publish it)."""

    def __init__(self, module: nn.Module, own_norm: bool, fused: bool = False, bf16_optimizer=None):
        if fused:
            raise ValueError(FUSED_NEEDS)
        self.module, self.own_norm, self.bf16_optimizer = module, own_norm, bf16_optimizer

    def hand_over(self) -> None:
        """Move the gathered gradients where the optimizer reads them (at the batch boundary, unless they wait)."""
        if self.bf16_optimizer is not None:
            bf16.hand_over(self.bf16_optimizer)

    def norm_grads(self) -> list[torch.Tensor] | None:
        """This stage's gradients for the pipeline's norm, in the module's parameter order (the order the emulation
        sums them in), or ``None`` where the optimizer computes its own."""
        return None if self.own_norm else [p.grad for p in self.module.parameters() if p.grad is not None]

    def bind(self, sq: torch.Tensor | None, slot: list[torch.Tensor] | None) -> Callable | None:
        """The step to run with the pipeline's squared norm ``sq`` and the new version's ``slot``; ``None``:
        DeepSpeed's step as it is (fp32: the engine's ``clip_fp32_gradients`` takes ``sq``)."""
        return None


class DeepSpeedBF16Step(StepPlan):
    """DeepSpeed's bf16 optimizer (swapped to :class:`~ds_async.pipe.bf16.PrecomputedNormBF16Optimizer`).

    With one replica and no ZeRO nothing reads DeepSpeed's gradient buffers between the batch boundary and the
    step, so the bf16 gradients can wait on the parameters (``can_wait``): the norm is read from them (half the
    bytes), and the hand-over writes g * clip factor in one pass instead of a copy, a norm read and a clip
    (``clip_at_hand_over``); further, ``fused`` takes the AdamW step from them in one pass per tensor, writing the new
    version's slot (``slot_order``: per parameter group, each bf16 parameter's index in a slot).
    """

    def __init__(self, optimizer: bf16.PrecomputedNormBF16Optimizer, clip: float, can_wait: bool, fused: bool,
                 slot_order: list[list[int]] | None):
        super().__init__(module=None, own_norm=False, bf16_optimizer=optimizer)
        if fused and not (can_wait and bf16.PrecomputedNormBF16Optimizer.supports_one_pass(optimizer.optimizer)):
            raise ValueError(FUSED_NEEDS)
        self.optimizer, self.clip, self.fused, self.slot_order = optimizer, clip, fused, slot_order
        self.clip_at_hand_over = can_wait and clip > 0.0

    @property
    def grads_wait(self) -> bool:
        return self.clip_at_hand_over or self.fused

    @property
    def writes_slot(self) -> bool:
        return self.fused

    def norm_grads(self) -> list[torch.Tensor]:
        if self.grads_wait:
            return bf16.bf16_grads(self.optimizer)
        return self.optimizer.get_grads_for_norm(for_clipping=True)

    def bind(self, sq, slot):
        opt = self.optimizer
        if not self.grads_wait:
            return partial(opt.step_with, squared_norm=sq)
        norm, coef = clip_factor(sq, self.clip)
        if slot is None:
            bf16.hand_over(opt, scale=coef)
            return partial(opt.step_with, clipped_norm=norm)
        outs = [[slot[k] for k in order] for order in self.slot_order]
        scale = torch.ones((), device=opt.fp32_groups_flat_partition[0].device) if coef is None else coef
        return partial(opt.step_in_one_pass, bf16.take_bf16_grads(opt), scale, [outs], clipped_norm=norm)


class MasterWeightsStep(StepPlan):
    """:class:`~ds_async.optim.master.MasterWeights`: its step reads the bf16 gradients where they wait, applies
    the clip factor as it reads them, and writes the new weights into the module and the new version's slot
    (``slot_order``: each of its weights' index in a slot; ``None`` under a synchronous rule)."""

    grads_wait = True
    writes_slot = True

    def __init__(self, optimizer, module: nn.Module, clip: float, slot_order: list[int] | None):
        super().__init__(module, own_norm=False)
        self.optimizer, self.clip, self.slot_order = optimizer, clip, slot_order

    def bind(self, sq, slot):
        norm, coef = clip_factor(sq, self.clip)
        outs = [] if slot is None else [[slot[k] for k in self.slot_order]]
        return partial(self.optimizer.step_with, scale=coef, outs=outs, clipped_norm=norm)
