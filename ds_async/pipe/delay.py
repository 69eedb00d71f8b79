"""Which weights each micro-batch runs on: the version rule of every schedule, as pure functions.

Weights are numbered by the optimizer steps applied: ``W(0)`` is the initial model, ``W(t+1)`` is ``W(t)`` after
the update of batch ``t``. Micro-batches are numbered globally, ``j = t * m + i`` (batch ``t``, ``i < m``).
A micro-batch runs forward and backward on the same version (weight stashing), and its gradient is applied at the
end of its batch to the newest weights, so the delay of batch ``t`` on a stage is ``t - version``.

- ``1f1b``: synchronous, ``W(t)``; no delay.
- ``2bw`` (PipeDream-2BW): every micro-batch of batch ``t`` on every stage runs on ``W(t-1)`` (``W(0)`` for
  ``t = 0``): ``W(t+1) = W(t) - U(grad f(W(t-1)))``, a constant delay of one step and two live versions.
- ``pipedream`` (original PipeDream, newest weights at forward time): stage ``s`` starts the forward of
  micro-batch ``j`` after ``w_s = p - 1 - s`` more forwards than backwards, so it sees ``floor((j - w_s) / m)``
  updates. With ``m = 1`` (an update per micro-batch) the delay is ``p - 1 - s`` steps: deepest on the first
  stage, none on the last, ``p - s`` live versions.
"""
from __future__ import annotations


def warmup(stage: int, stages: int) -> int:
    """Forwards stage ``stage`` runs ahead of its backwards in 1F1B."""
    return stages - 1 - stage


def weight_version(schedule: str, micro_batch: int, stage: int, stages: int, micro_batches: int) -> int:
    """The version ``t`` of ``W(t)`` that global micro-batch ``micro_batch`` uses on ``stage``."""
    batch = micro_batch // micro_batches
    if schedule == "1f1b":
        return batch
    if schedule == "2bw":
        return max(0, batch - 1)
    if schedule == "pipedream":
        return max(0, (micro_batch - warmup(stage, stages)) // micro_batches)
    raise ValueError(f"unknown schedule {schedule!r}")


def max_versions(schedule: str, stage: int, stages: int, micro_batches: int) -> int:
    """How many weight versions ``stage`` must hold at once (the newest included)."""
    if schedule == "1f1b":
        return 1
    if schedule == "2bw":
        return 2
    return 1 + -(-warmup(stage, stages) // micro_batches)
