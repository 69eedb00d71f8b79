"""Single-process delayed-update training: the reference the pipeline engine is tested against, and the cheap way
to study optimizers under delay on one device.

Each micro-batch runs forward and backward with every stage's layers set to the weights the schedule's version
rule (:mod:`ds_async.pipe.delay`) assigns; gradients accumulate over the batch and the optimizer then updates the
newest weights, exactly as the pipeline does, without any of its communication.

:func:`build_layers` and :func:`uniform_stages` give the model and partition a pipeline run of the same
``ds_async.model`` section would hold, so the emulation and the engine train the same network.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from .optim.clip import clip_, squared_norm, sum_in_stage_order
from .pipe.delay import max_versions, weight_version


def build_layers(model: dict, seed: int = 0):
    """The whole model of a ``ds_async.model`` section (``{"family": ..., "config": {...}}`` or ``{"path": ...}``)
    as the pipeline's layer list ``[embedding, decoder x L, head]``, each layer seeded as on its stage.

    Returns ``(layers, loss_fn, hf_config)``: an ``nn.ModuleList``, the family's ``loss_fn(logits, labels)`` and
    the Hugging Face config object.
    """
    from . import config as cfgmod
    from .models import FAMILIES, model_config

    cfg = cfgmod.parse({"model": model, "train": {"steps": 1}})
    hf_config, family = model_config(cfg), FAMILIES[cfg.model.family]
    hf_dir = cfg.model.path if cfg.model.path and cfg.model.load_weights else None
    layers = nn.ModuleList(spec.build() for spec in family.layer_specs(hf_config, seed=seed, hf_dir=hf_dir))
    return layers, family.loss_fn(hf_config), hf_config


def uniform_stages(num_layers: int, stages: int) -> list[int]:
    """The stage of each layer when ``num_layers`` layers are split into ``stages`` by count, as DeepSpeed's
    ``partition_method="uniform"`` splits them."""
    from deepspeed.runtime.utils import partition_uniform

    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} pipeline stages")
    parts = partition_uniform(num_layers, stages)
    return [next(s for s in range(stages) if parts[s] <= i < parts[s + 1]) for i in range(num_layers)]


class DelayedTrainer:
    """Train ``layers`` (applied in order; the last returns logits) under a schedule's weight-version rule.

    Args:
        layers: the model as a sequence of modules, the same ones the pipeline stages hold.
        stage_of_layer: the pipeline stage of each layer (only ``pipedream`` delays depend on it).
        loss_fn: ``loss_fn(logits, labels)``, averaged over the micro-batches of a batch.
        optimizer: built over ``layers``' parameters; it always updates the newest weights.
        schedule: ``1f1b`` (no delay), ``2bw`` or ``pipedream``.
        micro_batches: ``m``, micro-batches per optimizer step on each data-parallel replica.
        stages: pipeline depth ``p``.
        data_parallel: replicas; each batch is given as all replicas' micro-batches, replica by replica.
        clip: ``gradient_clipping``: the whole model's gradient norm is clipped, 0 for none.
        after_step: called after each optimizer step (e.g. an LR scheduler's ``step``).
    """

    def __init__(self, layers: Sequence[nn.Module], stage_of_layer: Sequence[int], loss_fn: Callable,
                 optimizer: torch.optim.Optimizer, schedule: str, micro_batches: int, stages: int,
                 data_parallel: int = 1, clip: float = 0.0, after_step: Callable[[], None] | None = None):
        self.layers, self.loss_fn, self.optimizer = list(layers), loss_fn, optimizer
        self.schedule, self.m, self.p, self.dp = schedule, micro_batches, stages, data_parallel
        self.clip, self.after_step = clip, after_step
        self.stage_params = [[q for layer, s in zip(self.layers, stage_of_layer) if s == stage
                              for q in layer.parameters()] for stage in range(stages)]
        depth = max(max_versions(schedule, s, stages, micro_batches) for s in range(stages))
        self.history: list[list[torch.Tensor]] = []  # history[k] = all parameters at W(step - k), newest first
        self.depth, self.step_count = depth, 0

    def _params(self) -> list[torch.Tensor]:
        return [q for group in self.stage_params for q in group]

    def _snapshot(self) -> None:
        self.history.insert(0, [q.detach().clone() for q in self._params()])
        del self.history[self.depth:]

    def _load_versions(self, micro_batch: int) -> None:
        """Set each stage's parameters to the version the schedule assigns to ``micro_batch``."""
        offset = 0
        for stage, group in enumerate(self.stage_params):
            version = weight_version(self.schedule, micro_batch, stage, self.p, self.m)
            age = self.step_count - version
            with torch.no_grad():
                for k, q in enumerate(group):
                    q.copy_(self.history[age][offset + k])
            offset += len(group)

    def train_batch(self, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """One optimizer step over ``m x data_parallel`` micro-batches; returns their mean loss."""
        self._snapshot()
        total, count, replicas = 0.0, 0, []
        for k, (inputs, labels) in enumerate(micro_batches):
            self._load_versions(self.step_count * self.m + k % self.m)
            x = inputs
            for layer in self.layers:
                x = layer(x)
            loss = self.loss_fn(x, labels)
            (loss / self.m).backward()
            total += (loss / (self.m * self.dp)).item()
            count += 1
            if self.dp > 1 and count % self.m == 0:
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
        if self.clip:
            # Per-stage partial sums added in stage order, as the engine adds the norms it gathers over the pipeline.
            per_stage = [[q.grad for q in group if q.grad is not None] for group in self.stage_params]
            sq = sum_in_stage_order([squared_norm(g) for g in per_stage])
            clip_([g for group in per_stage for g in group], sq, self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.after_step is not None:
            self.after_step()
        self.step_count += 1
        return total

    def _take_grads(self) -> list[torch.Tensor | None]:
        grads = [q.grad for q in self._params()]
        for q in self._params():
            q.grad = None
        return grads

    def _restore_newest(self) -> None:
        with torch.no_grad():
            for q, newest in zip(self._params(), self.history[0]):
                q.copy_(newest)
