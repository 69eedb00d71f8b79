"""NaN or inf loss: ``ds_async.train.on_nonfinite``.

``stop`` (every schedule): every rank learns that a step's loss was not finite and training stops there with
:class:`NonFiniteLoss` (the launcher exits non-zero) without saving anything after that step, so the newest
checkpoint is the last good one. The loss exists only on the last stage; :class:`LossMonitor` shares a flag over
all ranks with one scalar all-reduce per step. Under ``1f1b`` it is read at once. Under ``2bw``/``pipedream``,
where stages must not wait for each other between steps, it is read one step later (every rank runs at most one
more step, whose state is discarded just the same) and always before an evaluation, a save or the end.

``skip`` (fp32 or torch_autocast weights; ds_async's optimizers or torch's at ZeRO-0, or ds_async's ZeRO-1;
every schedule): the update of a step whose gradient is not finite anywhere in the model (which a NaN/inf loss
makes it) is dropped on every stage and replica: :class:`SkipNonFinite` asks all ranks before each optimizer
step (one scalar all-reduce and a host sync there) and reports the skip to DeepSpeed as its ``overflow``, which
counts it in ``engine.skipped_steps`` and leaves the LR schedule where it was. Under 2BW the step still publishes
the (unchanged) weights as the next version. DeepSpeed's own ZeRO and bf16 optimizer wrappers clip and step
inside, so ``skip`` is refused with them at start. At the end of a run that skipped steps the trainer prints a
warning with their count and steps, and if the last step's update was skipped (its loss or gradient was not finite,
so the run ends on a non-finite loss) it ends with :class:`NonFiniteLoss` instead of a final evaluation and save.

Either way, a checkpoint is written only when :func:`weights_nonfinite` finds this step's weights finite on every
rank: the loss a step reports was computed before its update, and an update can overflow the weights while that
loss is finite (:class:`NonFiniteWeights`). So every checkpoint of a run is a good one.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as tdist

from .config import ConfigError
from .optim.master import MasterWeights


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf and ``on_nonfinite`` is ``stop``."""


class NonFiniteWeights(NonFiniteLoss):
    """The weights about to be saved are NaN or inf (the update of a step whose loss was still finite)."""


@torch.no_grad()
def weights_nonfinite(params, group=None) -> str | None:
    """``"NaN"`` or ``"inf"`` if any of ``params`` holds one on any rank (NaN wins), else None; the same answer on
    every rank (one all-reduce of two flags over ``group`` and a host sync: for drained pipelines, before a save)."""
    tensors = [p.detach() for p in params if p.numel()]
    flags = torch.zeros(2)
    if tensors:
        bad = torch.stack([t.isfinite().all() for t in tensors]).logical_not()
        if bad.any():
            flags[0] = 1.0
            flags[1] = float(any(t.isnan().any() for t, b in zip(tensors, bad.tolist()) if b))
    if tdist.is_initialized() and tdist.get_world_size(group) > 1:
        tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=group)
    return None if not flags[0] else "NaN" if flags[1] else "inf"


class LossMonitor:
    """Whether each step's loss was finite, agreed on by all ranks.

    ``submit(step, loss)`` after every ``train_batch`` (``loss`` None on ranks that have none); ``check(upto)``
    returns ``(step, kind)`` for the first non-finite step ``<= upto`` whose flag has arrived (waiting for the
    flags of steps ``<= upto``), else None. ``lag=True`` leaves the newest flag in flight until the next call.
    """

    def __init__(self, group, lag: bool):
        self.group, self.lag = group, lag
        self.pending: list[tuple[int, torch.Tensor, object]] = []

    def submit(self, step: int, loss: torch.Tensor | float | None) -> None:
        flags = torch.zeros(2)
        if loss is not None:
            value = float(loss)
            flags[0], flags[1] = float(math.isnan(value)), float(math.isinf(value))
        work = None
        if tdist.is_initialized() and tdist.get_world_size(self.group) > 1:
            work = tdist.all_reduce(flags, op=tdist.ReduceOp.MAX, group=self.group, async_op=True)
        self.pending.append((step, flags, work))

    def check(self, upto: int | None = None) -> tuple[int, str] | None:
        """The first non-finite step among the resolved flags; ``upto``: resolve every flag up to this step
        (default: all but the newest under ``lag``, all otherwise)."""
        if upto is None:
            upto = self.pending[-1][0] - (1 if self.lag else 0) if self.pending else -1
        while self.pending and self.pending[0][0] <= upto:
            step, flags, work = self.pending.pop(0)
            if work is not None:
                work.wait()
            if flags.any():
                self.pending.clear()
                return step, "NaN" if flags[0] else "inf"
        return None


class SkipNonFinite:
    """Wrap the optimizer DeepSpeed steps so that a step with a non-finite gradient on any rank is skipped on all.

    Everything but ``step`` is the wrapped optimizer's (``param_groups``, ``state_dict``, ``zero_grad``, ...), and
    ``optimizer`` is the wrapped one (as DeepSpeed's wrappers name it). See the module docstring.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, group=None):
        self.optimizer, self.group = optimizer, group
        self.overflow = False
        self.skipped = 0
        self.calls = 0
        self.skipped_calls: list[int] = []  # which of this process's steps (1, 2, ...) were skipped

    def __getattr__(self, name):
        if name == "optimizer":  # not set yet (unpickling, copy): do not recurse
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def _local_nonfinite(self) -> torch.Tensor:
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return torch.zeros(())
        return torch.stack([g.isfinite().all() for g in grads]).logical_not().any().float().cpu()

    @torch.no_grad()
    def step(self, closure=None):
        flag = self._local_nonfinite().reshape(1)
        if tdist.is_initialized() and tdist.get_world_size(self.group) > 1:
            tdist.all_reduce(flag, op=tdist.ReduceOp.MAX, group=self.group)
        self.overflow = bool(flag.item())
        self.calls += 1
        if self.overflow:
            self.skipped += 1
            self.skipped_calls.append(self.calls)
            return None
        return self.optimizer.step(closure)


def check_skip_supported(optimizer) -> None:
    """Raise ConfigError unless ``skip`` can wrap ``optimizer`` (a torch optimizer DeepSpeed steps as is)."""
    if isinstance(optimizer, MasterWeights):
        raise ConfigError("ds_async.train.on_nonfinite: 'skip' is not implemented with bf16 weights and ds_async's "
                          "fp32 masters (its step reads the gradients itself); use 'stop' or fp32/torch_autocast")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"ds_async.train.on_nonfinite: 'skip' needs an optimizer DeepSpeed steps directly (fp32 or "
            f"torch_autocast weights, ZeRO stage 0, or a ds_async optimizer with ZeRO-1); this run's is DeepSpeed's "
            f"{type(optimizer).__name__}, which clips and steps inside. Use 'stop'.")
