"""DeepSpeed's bf16 optimizer under a flush-free schedule: the gradient hand-over and a step that neither syncs the
host nor waits for the other stages.

``BF16_Optimizer`` collects gradients from hooks on the bf16 parameters and, at step time, all-reduces the gradient
norm over the whole pipeline and checks it on the host. Under a flush-free schedule forwards run on weight-version
slots, so those hooks never fire, and the stages reach their batch boundaries at different times, so a step-time
all-reduce is a barrier that puts a flush-sized bubble back into every step. The engine therefore hands the
gathered gradients over itself (:func:`hand_over`), computes the pipeline's norm ahead of the step, and calls one of
:class:`PrecomputedNormBF16Optimizer`'s steps with it as an explicit argument.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

from ..optim.adamw_pass import adamw_hyper, adamw_pass_
from ..optim.clip import clip_, copy_scaled_


class PrecomputedNormBF16Optimizer(BF16_Optimizer):
    """``BF16_Optimizer`` whose step takes the pipeline's gradient norm as an argument.

    DeepSpeed constructs the optimizer; the engine swaps the instance's class to this one (no state is added).
    A non-finite norm is not detected here (that needs the host): it reaches the weights, and the loss shows it.
    """

    @staticmethod
    def supports_one_pass(optimizer) -> bool:
        """Whether :meth:`step_in_one_pass` reproduces ``optimizer``'s update (torch's AdamW as DeepSpeed builds it
        for ``"torch_adam": true``)."""
        return type(optimizer) is torch.optim.AdamW and all(
            not g["amsgrad"] and not g["maximize"] and not g["differentiable"] and not torch.is_tensor(g["lr"])
            for g in optimizer.param_groups)

    def step(self, closure=None):
        return self.step_with(closure=closure)

    @torch.no_grad()
    def step_with(self, squared_norm: torch.Tensor | None = None, clipped_norm: torch.Tensor | None = None,
                  closure=None):
        """The step with the pipeline's ``squared_norm`` (clipped here), or on gradients the hand-over already
        clipped (``clipped_norm``: their norm, for the report only). With clipping on and neither given it is
        DeepSpeed's step unchanged; with clipping off no norm is needed (DeepSpeed's step would still all-reduce
        one over the pipeline)."""
        if (squared_norm is None and clipped_norm is None and self.clip_grad > 0.0) or self.has_moe_layers:
            return super().step(closure)
        if closure is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support closure")
        self.overflow = False
        if clipped_norm is not None:
            self._global_grad_norm = clipped_norm
        elif self.clip_grad > 0.0:
            self._global_grad_norm = clip_(self.get_grads_for_norm(for_clipping=True), squared_norm, self.clip_grad)
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
        # No clear_hp_grads(): the next hand-over overwrites the fp32 gradients, so zeroing them is a wasted pass.

    @torch.no_grad()
    def step_in_one_pass(self, grads, scale: torch.Tensor, outs, clipped_norm: torch.Tensor | None = None) -> None:
        """The AdamW step straight from the bf16 ``grads`` (one list per parameter group, times ``scale``) to the
        fp32 master, the moments, the module's bf16 weights and ``outs`` (lists of extra bf16 outputs, each one list
        per group), in one pass per tensor (:mod:`ds_async.optim.adamw_pass`): the same update as the hand-over,
        torch's AdamW and ``update_lp_params``, without DeepSpeed's gradient buffers (the scaled gradient is rounded
        to their dtype all the same). One replica, so this rank's partition is the whole group; the padding
        DeepSpeed appends to a group is zero in every buffer and would stay zero, so it is skipped."""
        if clipped_norm is not None:
            self._global_grad_norm = clipped_norm
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
        BF16_Optimizer.clear_lp_grads(self, set_to_none)

    # The bf16 parameters' gradients are the engine's under a flush-free schedule: the version slots collect every
    # backward's gradients, a finished batch's are gathered onto the parameters at its boundary, and there they may
    # wait for the step while the next batch's backward passes run (from the third stage of a 4-stage 2BW pipeline
    # on). DeepSpeed's bookkeeping around each backward would zero them before it (``clear_lp_grads``) and add them
    # to the fp32 buffers after it (``update_hp_grads``): the step would read zeros. Here both leave them alone.
    def clear_lp_grads(self, set_to_none=False):
        pass

    def update_hp_grads(self, clear_lp_grads=False):
        pass


@contextmanager
def stepping_with(optimizer, step) -> None:
    """Make ``optimizer.step()`` call ``step`` (e.g. a ``functools.partial`` of :meth:`~PrecomputedNormBF16Optimizer.
    step_with` carrying the norm) while DeepSpeed's step bookkeeping around it runs unchanged."""
    optimizer.step = step
    try:
        yield
    finally:
        del optimizer.step


def hand_over(opt: BF16_Optimizer, scale: torch.Tensor | None = None) -> None:
    """Move the bf16 gradients on ``opt``'s parameters into its fp32 gradient buffers (``grad_accum_dtype``).

    DeepSpeed's hooks would add each gradient to a zeroed buffer; here one foreach call copies the bf16 sums
    (exactly what the addition gives), or with ``scale`` (the clip factor) writes g * scale, which equals the copy
    clipped afterwards bit for bit. A :class:`PrecomputedNormBF16Optimizer` does not zero the buffers after its step
    (DeepSpeed zeroes them twice per step, 8 bytes a parameter): the copy overwrites them, and only a buffer written
    last batch but not this one is zeroed here. Other optimizers get DeepSpeed's addition.
    """
    if opt.autoep_folding_tp_group is not None:
        raise NotImplementedError("flush-free schedules do not support DeepSpeed's AutoEP gradient folding")
    overwrite = isinstance(opt, PrecomputedNormBF16Optimizer)
    hp_grads, lp_grads, stale = [], [], []
    for i, group in enumerate(opt.bf16_groups):
        for j, lp in enumerate(group):
            hp = opt.fp32_groups_gradients[i][j]
            if lp.grad is not None:
                hp_grads.append(hp)
                lp_grads.append(lp.grad.view(hp.shape))
                lp._hp_grad = hp
                opt.fp32_groups_has_gradients[i][j] = True
                lp.grad = None
            elif overwrite and opt.fp32_groups_has_gradients[i][j]:  # written last batch, not this one
                stale.append(hp)
                opt.fp32_groups_has_gradients[i][j] = False
    if hp_grads and scale is not None:
        copy_scaled_(hp_grads, lp_grads, scale)
    elif hp_grads:
        (torch._foreach_copy_ if overwrite else torch._foreach_add_)(hp_grads, lp_grads)
    if stale:
        torch._foreach_zero_(stale)


def take_bf16_grads(opt: BF16_Optimizer) -> list[list[torch.Tensor]]:
    """The bf16 gradients by parameter group, taken off the parameters (zeros where a parameter got none: the fp32
    gradient DeepSpeed's step would read there)."""
    grads = []
    for group in opt.bf16_groups:
        grads.append([torch.zeros_like(lp) if lp.grad is None else lp.grad for lp in group])
        for lp in group:
            lp.grad = None
    return grads


def bf16_grads(opt: BF16_Optimizer) -> list[torch.Tensor]:
    """The bf16 gradients still on ``opt``'s parameters (for the norm: half the bytes of the fp32 buffers)."""
    return [lp.grad for group in opt.bf16_groups for lp in group if lp.grad is not None]
