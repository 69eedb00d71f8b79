"""DeepSpeed's bf16 optimizer with a step that neither syncs the host nor waits for the other stages.

``BF16_Optimizer.step`` all-reduces the gradient norm over the whole pipeline at step time and checks it on the
host. Under a flush-free schedule the stages reach their batch boundaries at different times (the last stage
first), so that all-reduce is a barrier that puts a flush-sized bubble back into every step, and the host check
stops the host from queueing the next batch's forwards. The flush-free engine instead starts the norm's
all-reduce when a stage's gradients are complete (:meth:`AsyncPipelineEngine._exec_batch_reduce`) and hands the
result to this step, which runs on a side stream that alone waits for it.
"""
from __future__ import annotations

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from ..optim.clip import clip_


class PrecomputedNormBF16Optimizer(BF16_Optimizer):
    """``BF16_Optimizer`` whose ``step`` clips by ``squared_norm``, set by the engine before each step.

    DeepSpeed constructs the optimizer; the engine swaps the instance's class to this one (no state is added
    beyond ``squared_norm``). With clipping off it needs no norm; with clipping on but no norm given it is
    DeepSpeed's step unchanged. A non-finite norm is not detected here (that needs the host): it reaches the
    weights, and the loss shows it.
    """

    squared_norm: torch.Tensor | None = None
    clipped_norm: torch.Tensor | None = None
    """Set instead of ``squared_norm`` when the engine scaled the gradients by the clip factor as it handed them
    over (:meth:`AsyncPipelineEngine._hand_grads_to_bf16_optimizer`): the norm, for the step's report only."""

    @torch.no_grad()
    def step(self, closure=None):
        sq, self.squared_norm = self.squared_norm, None
        clipped, self.clipped_norm = self.clipped_norm, None
        # Without clipping no norm is needed; DeepSpeed's step would still all-reduce one over the pipeline at step
        # time (measured on 4x H200: 2BW 25% slower with gradient_clipping 0 than with 1.0 before this).
        if (sq is None and clipped is None and self.clip_grad > 0.0) or self.has_moe_layers:
            return super().step(closure)
        if closure is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support closure")
        self.overflow = False
        if clipped is not None:
            self._global_grad_norm = clipped
        elif self.clip_grad > 0.0:
            self._global_grad_norm = clip_(self.get_grads_for_norm(for_clipping=True), sq, self.clip_grad)
        for param_partition, grad_partition in zip(self.fp32_groups_flat_partition,
                                                   self.fp32_groups_gradient_flat_partition):
            param_partition.grad = grad_partition.to(param_partition.dtype)
        if self._uses_muon:
            self._prepare_muon_updates()
        self.optimizer.step()
        if self.grad_acc_dtype is not torch.float32:
            for param_partition in self.fp32_groups_flat_partition:
                param_partition.grad = None
        self._lazy_init_hp_params_optimizer_state()
        self.update_lp_params()
        # No clear_hp_grads(): the engine's next hand-over overwrites the fp32 gradients (see
        # AsyncPipelineEngine._hand_grads_to_bf16_optimizer), so zeroing them would be a wasted pass.

    def zero_grad(self, set_to_none=True):
        """The bf16 gradients only; the fp32 ones are overwritten by the next hand-over (DeepSpeed's engine calls
        this after every step, which would zero the fp32 buffers a second time)."""
        self.clear_lp_grads(set_to_none)
