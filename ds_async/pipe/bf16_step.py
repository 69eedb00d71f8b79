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

from ..optim.adamw_pass import adamw_hyper, adamw_pass_
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

    one_pass: tuple[list[list[torch.Tensor]], torch.Tensor, list[list[list[torch.Tensor]]]] | None = None
    """Set by the engine instead of handing the gradients over, for :meth:`step_in_one_pass`'s next call: (the bf16
    gradients, the clip factor, the extra bf16 outputs), the tensors as one list per parameter group, in order."""

    @staticmethod
    def supports_one_pass(optimizer) -> bool:
        """Whether :meth:`step_in_one_pass` reproduces ``optimizer``'s update (torch's AdamW as DeepSpeed builds it
        for ``"torch_adam": true``)."""
        return type(optimizer) is torch.optim.AdamW and all(
            not g["amsgrad"] and not g["maximize"] and not g["differentiable"] and not torch.is_tensor(g["lr"])
            for g in optimizer.param_groups)

    @torch.no_grad()
    def step(self, closure=None):
        sq, self.squared_norm = self.squared_norm, None
        clipped, self.clipped_norm = self.clipped_norm, None
        if self.one_pass is not None:
            (grads, scale, outs), self.one_pass = self.one_pass, None
            if clipped is not None:
                self._global_grad_norm = clipped
            return self.step_in_one_pass(grads, scale, outs)
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

    def step_in_one_pass(self, grads, scale: torch.Tensor, outs) -> None:
        """The AdamW step straight from the bf16 gradients (times ``scale``) to the fp32 master, the moments, the
        module's bf16 weights and ``outs``, in one pass per tensor (:mod:`ds_async.optim.adamw_pass`): the same
        update as the hand-over, torch's AdamW and ``update_lp_params``, without DeepSpeed's gradient buffers (the
        scaled gradient is rounded to their dtype all the same).
        One replica, so this rank's partition is the whole group; the padding DeepSpeed appends to a group is
        zero in every buffer and would stay zero, so it is skipped."""
        for i, group in enumerate(self.optimizer.param_groups):
            flat = self.fp32_groups_flat_partition[i]
            state = self.optimizer.state[flat]
            if not state:  # as torch's AdamW initialises it
                on_device = group["capturable"] or group["fused"]
                state["step"] = torch.zeros((), dtype=torch.float32, device=flat.device if on_device else "cpu")
                state["exp_avg"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(flat, memory_format=torch.preserve_format)
            views = self._views(i, flat, state)
            hyper = adamw_hyper(group, self._count_step(state["step"]), flat.device)
            adamw_pass_(views[0], grads[i], views[1], views[2], [self.bf16_groups[i], *(o[i] for o in outs)],
                        hyper, scale, self.grad_acc_dtype)
        self._lazy_init_hp_params_optimizer_state()

    def _views(self, i: int, flat: torch.Tensor, state: dict) -> tuple[list[torch.Tensor], ...]:
        """Per-parameter views of group ``i``'s fp32 master and moments (cached: they are the same every step)."""
        cache = self.__dict__.setdefault("_one_pass_views", {})
        key = (flat.data_ptr(), state["exp_avg"].data_ptr(), state["exp_avg_sq"].data_ptr())
        if cache.get(i, (None,))[0] != key:
            base = self.bf16_groups_flat[i].storage_offset()
            spans = [(lp.storage_offset() - base, lp) for lp in self.bf16_groups[i]]
            cache[i] = (key, tuple([t.narrow(0, off, lp.numel()).view_as(lp) for off, lp in spans]
                                   for t in (flat, state["exp_avg"], state["exp_avg_sq"])))
        return cache[i][1]

    def _count_step(self, step: torch.Tensor) -> int:
        """Increment torch's step count and return it, reading it from the GPU (fused or capturable AdamW keep it
        there) only the first time: afterwards the host mirrors it, so the step never waits for the GPU."""
        mirror = self.__dict__.setdefault("_one_pass_steps", {})
        known = mirror.get(id(step))
        step += 1
        count = known[1] + 1 if known is not None and known[0] is step else int(step.item())
        mirror[id(step)] = (step, count)
        return count

    def zero_grad(self, set_to_none=True):
        """The bf16 gradients only; the fp32 ones are overwritten by the next hand-over (DeepSpeed's engine calls
        this after every step, which would zero the fp32 buffers a second time)."""
        self.clear_lp_grads(set_to_none)
