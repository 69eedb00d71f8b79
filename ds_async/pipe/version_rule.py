"""Which weights each micro-batch runs on: one :class:`VersionRule` per schedule, in a registry.

Weights are numbered by the optimizer steps applied: ``W(0)`` is the initial model, ``W(t+1)`` is ``W(t)`` after
the update of batch ``t``. Micro-batches are numbered globally, ``j = t * m + i`` (batch ``t``, ``i < m``).
A micro-batch runs forward and backward on the same version (weight stashing), and its gradient is applied at the
end of its batch to the newest weights, so the delay of batch ``t`` on a stage is ``t - version``.

- ``1f1b``: synchronous, ``W(t)``; no delay; DeepSpeed's own schedule with a flush every step.
- ``2bw`` (PipeDream-2BW): every micro-batch of batch ``t`` on every stage runs on ``W(t-1)`` (``W(0)`` for
  ``t = 0``): ``W(t+1) = W(t) - U(grad f(W(t-1)))``, a constant delay of one step and two live versions.
  Needs ``m >= p``: with fewer micro-batches a third version would be in flight.
- ``pipedream`` (original PipeDream, newest weights at forward time): stage ``s`` starts the forward of
  micro-batch ``j`` after ``w_s = p - 1 - s`` more forwards than backwards, so it sees ``floor((j - w_s) / m)``
  updates. With ``m = 1`` (an update per micro-batch) the delay is ``p - 1 - s`` steps: deepest on the first
  stage, none on the last, ``p - s`` live versions.

Config, schedule generator, engine, emulation and simulator all take a rule from :data:`RULES` (by the config's
``schedule`` name, via :func:`get`); nothing else compares schedule names.
"""
from __future__ import annotations

from dataclasses import dataclass


def warmup(stage: int, stages: int) -> int:
    """Forwards stage ``stage`` runs ahead of its backwards in 1F1B."""
    return stages - 1 - stage


@dataclass(frozen=True)
class VersionRule:
    """A schedule's version rule. Subclasses implement :meth:`weight_version` and :meth:`max_versions`."""

    name: str
    flush_free: bool
    """Whether 1F1B runs on across batch boundaries (no flush each step), the optimizer step overlapping passes."""
    defers_step: bool = False
    """Whether a stage's optimizer step may be issued once stage 0 has finished the batch (``stage`` schedule steps
    after its own last backward) rather than at once: the version it publishes is first read a batch later."""

    def weight_version(self, micro_batch: int, stage: int, stages: int, micro_batches: int) -> int:
        """The version ``t`` of ``W(t)`` that global micro-batch ``micro_batch`` uses on ``stage``."""
        raise NotImplementedError

    def max_versions(self, stage: int, stages: int, micro_batches: int) -> int:
        """How many weight versions ``stage`` must hold at once (the newest included)."""
        raise NotImplementedError

    def min_micro_batches(self, stages: int) -> int:
        """The smallest ``m`` (micro-batches per step and replica) the rule allows at depth ``stages``."""
        return 1

    def delay(self, stage: int, stages: int, micro_batches: int) -> int:
        """Steady-state staleness, in steps, of the weights batch ``t``'s first micro-batch runs on at ``stage``."""
        t = stages + 1  # far enough from the start that no version is clamped to W(0)
        return t - self.weight_version(t * micro_batches, stage, stages, micro_batches)

    def step_lag(self, stage: int) -> int:
        """Schedule steps from a batch's gradient reduce to its optimizer step on ``stage``."""
        return stage if self.defers_step else 0

    def check(self, stages: int, micro_batches: int) -> None:
        """Raise ``ValueError`` when ``micro_batches`` is below :meth:`min_micro_batches`."""
        need = self.min_micro_batches(stages)
        if micro_batches >= need:
            return
        if need == stages:
            what, bound = "as many micro-batches as stages", f"p={stages}"
        else:
            what, bound = f"{need} micro-batches per step", str(need)
        raise ValueError(f"schedule '{self.name}' needs at least {what} (m={micro_batches} < {bound}): with fewer, "
                         "more weight versions than it keeps would be in flight")


class Synchronous(VersionRule):
    def weight_version(self, micro_batch, stage, stages, micro_batches):
        return micro_batch // micro_batches

    def max_versions(self, stage, stages, micro_batches):
        return 1


class TwoBW(VersionRule):
    def weight_version(self, micro_batch, stage, stages, micro_batches):
        return max(0, micro_batch // micro_batches - 1)

    def max_versions(self, stage, stages, micro_batches):
        return 2

    def min_micro_batches(self, stages):
        return stages


class PipeDream(VersionRule):
    def weight_version(self, micro_batch, stage, stages, micro_batches):
        return max(0, (micro_batch - warmup(stage, stages)) // micro_batches)

    def max_versions(self, stage, stages, micro_batches):
        return 1 + -(-warmup(stage, stages) // micro_batches)


SYNC = Synchronous("1f1b", flush_free=False)
TWO_BW = TwoBW("2bw", flush_free=True, defers_step=True)
PIPEDREAM = PipeDream("pipedream", flush_free=True)
RULES: dict[str, VersionRule] = {rule.name: rule for rule in (SYNC, TWO_BW, PIPEDREAM)}
SCHEDULES = tuple(RULES)


def get(rule: str | VersionRule) -> VersionRule:
    """The rule named ``rule`` (a rule passes through)."""
    if isinstance(rule, VersionRule):
        return rule
    try:
        return RULES[rule]
    except KeyError:
        raise ValueError(f"unknown schedule {rule!r}; known: {list(RULES)}") from None
