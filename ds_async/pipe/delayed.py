"""The delayed-update reference: a whole pipeline's training under a version rule, in one process.

:class:`DelayedTrainer` runs each micro-batch forward and backward with every stage's layers set to the weights the
schedule's version rule (:mod:`ds_async.pipe.version_rule`) assigns; gradients accumulate over the batch and the
optimizer then updates the newest weights, exactly as the pipeline engine (:mod:`ds_async.pipe.engine`) does,
without any of its communication. The engine is tested equal to it; the emulation job (:mod:`ds_async.emulate`)
trains with it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from ..optim.clip import clip_, clip_coefficient, squared_norm, sum_in_stage_order
from ..optim.master import MasterWeights
from . import version_rule

class DelayedTrainer:
    """Train ``layers`` (applied in order; the last returns logits) under a schedule's weight-version rule.

    Args:
        layers: the model as a sequence of modules, the same ones the pipeline stages hold.
        stage_of_layer: the pipeline stage of each layer (only ``pipedream`` delays depend on it).
        loss_fn: ``loss_fn(logits, labels)``, averaged over the micro-batches of a batch.
        optimizer: built over ``layers``' parameters; it always updates the newest weights.
        schedule: a :class:`~ds_async.pipe.version_rule.VersionRule` or its name (``1f1b``, ``2bw``,
            ``pipedream``, or ``delay<d>``, a constant delay of ``d`` steps that only the emulation runs).
        micro_batches: ``m``, micro-batches per optimizer step on each data-parallel replica.
        stages: pipeline depth ``p``.
        data_parallel: replicas; each batch is given as all replicas' micro-batches, replica by replica.
        clip: ``gradient_clipping``: the whole model's gradient norm is clipped, 0 for none.
        after_step: called after each optimizer step (e.g. an LR scheduler's ``step``).
        compile: ``torch.compile`` the whole model's forward and loss as one region (the layers' weights change in
            place between micro-batches, so one graph serves every version); a dict: with these keyword arguments
            (e.g. ``backend``).
    """

    def __init__(self, layers: Sequence[nn.Module], stage_of_layer: Sequence[int], loss_fn: Callable,
                 optimizer: torch.optim.Optimizer, schedule: str | version_rule.VersionRule, micro_batches: int,
                 stages: int, data_parallel: int = 1, clip: float = 0.0, after_step: Callable[[], None] | None = None,
                 compile: bool | dict = False):
        self.layers, self.loss_fn, self.optimizer = list(layers), loss_fn, optimizer
        self.rule = version_rule.get(schedule)
        self.schedule, self.m, self.p, self.dp = self.rule.name, micro_batches, stages, data_parallel
        self.clip, self.after_step = clip, after_step
        self.stage_params = [[q for layer, s in zip(self.layers, stage_of_layer) if s == stage
                              for q in layer.parameters()] for stage in range(stages)]
        self.depth = max(self.rule.max_versions(s, stages, micro_batches) for s in range(stages))
        self.history: list[list[torch.Tensor]] = []  # history[k] = all parameters at W(step - k), newest first
        self.step_count = 0
        self.loaded = [0] * stages  # the version each stage's parameters hold now
        self._compiled = None
        if compile:
            self._compiled = torch.compile(lambda inputs, labels: self.loss_fn(self.forward(inputs), labels),
                                           **(compile if isinstance(compile, dict) else {}))

    def state_dict(self) -> dict:
        """The step count and the older weight versions a next step reads (the newest are the layers' own)."""
        return {"step": self.step_count,
                "history": [[q.detach().cpu() for q in v] for v in self.history[:max(0, self.depth - 1)]]}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into a trainer whose layers hold the newest weights already."""
        self.step_count = state["step"]
        self.loaded = [self.step_count] * self.p
        device = self._params()[0].device
        self.history = [[q.to(device) for q in v] for v in state["history"]]

    def _params(self) -> list[torch.Tensor]:
        return [q for group in self.stage_params for q in group]

    @torch.no_grad()
    def _snapshot(self) -> None:
        if self.depth <= 1:  # a rule that only ever reads the newest weights keeps no copies
            return
        params = [q.detach() for q in self._params()]
        if len(self.history) < self.depth:
            self.history.insert(0, [q.clone() for q in params])
        else:  # reuse the oldest version's buffers: no allocation per step
            oldest = self.history.pop()
            torch._foreach_copy_(oldest, params)
            self.history.insert(0, oldest)

    @torch.no_grad()
    def _load(self, stage: int, version: int) -> None:
        """Set ``stage``'s parameters to ``W(version)`` (no copy when they hold it already)."""
        if self.loaded[stage] != version:
            offset = sum(len(g) for g in self.stage_params[:stage])
            group = self.stage_params[stage]
            if group:
                torch._foreach_copy_([q.detach() for q in group],
                                     self.history[self.step_count - version][offset:offset + len(group)])
            self.loaded[stage] = version

    def _load_versions(self, micro_batch: int) -> None:
        """Set each stage's parameters to the version the schedule assigns to ``micro_batch``."""
        for stage in range(self.p):
            self._load(stage, self.rule.weight_version(micro_batch, stage, self.p, self.m))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        x = inputs
        for layer in self.layers:
            x = layer(x)
        return x

    def loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch on the weights the layers hold now (compiled once when ``compile``)."""
        if self._compiled is None:
            return self.loss_fn(self.forward(inputs), labels)
        return self._compiled(inputs, labels)

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """:meth:`loss` for evaluation: detached, no gradient kept. Compiled, it runs with gradients enabled and
        drops them, so that it reuses training's graph, where under ``no_grad`` Dynamo would trace and compile an
        inference graph at the first evaluation (as the pipeline's stages do: ``models.loss_as_in_training``)."""
        if self._compiled is None:
            with torch.no_grad():
                return self.loss(inputs, labels)
        with torch.enable_grad():
            return self._compiled(inputs, labels).detach()

    def train_batch(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over ``m x data_parallel`` micro-batches; returns their mean loss, averaged as the
        engine averages it: each replica's micro-batch losses summed in the loss dtype and divided by ``m``, then
        the replicas' means summed and divided by ``data_parallel``."""
        return self.step_batch(micro_batches)[0].item()

    def step_batch(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`train_batch` without waiting for the device: the mean loss and, with clipping, the gradient norm,
        as 0-dim tensors where they were computed (``None``: no clipping, no norm)."""
        self._snapshot()
        replica_losses, total, count, replicas = [], None, 0, []
        for k, (inputs, labels) in enumerate(micro_batches):
            self._load_versions(self.step_count * self.m + k % self.m)
            loss = self.loss(inputs, labels)
            (loss / self.m).backward()
            total = loss.detach().clone() if total is None else total + loss.detach()
            count += 1
            if count % self.m == 0:
                replica_losses.append(total / self.m)
                total = None
                if self.dp > 1:
                    replicas.append(self._take_grads())
        if count != self.m * self.dp:
            raise ValueError(f"train_batch needs {self.m * self.dp} micro-batches, got {count}")
        if replicas:
            # As the engine: each replica sums its own micro-batches, then the replicas' sums are averaged.
            for i, q in enumerate(self._params()):
                grads = [r[i] for r in replicas if r[i] is not None]
                if grads:
                    q.grad = sum(grads[1:], grads[0])
                    q.grad.mul_(1.0 / self.dp)
        self._restore_newest()
        scale = norm = None
        if self.clip:
            # Per-stage partial sums added in stage order, as the engine adds the norms it gathers over the pipeline.
            per_stage = [[q.grad for q in group if q.grad is not None] for group in self.stage_params]
            sq = sum_in_stage_order([squared_norm(g) for g in per_stage])
            norm = sq.sqrt()
            if isinstance(self.optimizer, MasterWeights):
                scale = clip_coefficient(sq, self.clip)[1]  # applied as the step reads the bf16 gradients
            else:
                clip_([g for group in per_stage for g in group], sq, self.clip)
        if isinstance(self.optimizer, MasterWeights):
            self.optimizer.step_with(scale=scale)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.after_step is not None:
            self.after_step()
        self.step_count += 1
        self.loaded = [self.step_count] * self.p
        mean = sum(replica_losses[1:], replica_losses[0])
        return (mean / self.dp if self.dp > 1 else mean), norm

    def _take_grads(self) -> list[torch.Tensor | None]:
        grads = [q.grad for q in self._params()]
        for q in self._params():
            q.grad = None
        return grads

    def _restore_newest(self) -> None:
        for stage in range(self.p):
            self._load(stage, self.step_count)
