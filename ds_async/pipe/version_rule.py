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
- ``delay<d>`` (``delay0``, ``delay1``, ...; emulation only): every micro-batch of batch ``t`` on every stage runs
  on ``W(t - d)`` (``W(0)`` before that), any ``m``: the control for PipeDream's delay, the same mean without its
  spread over stages (``delay1`` against ``pipedream`` at ``p = 3``, whose delays are 2, 1, 0). A pipeline's delays
  come from where its schedule puts each stage's forwards, and the engine is built and tested for the rules above
  only, so it refuses these (:meth:`VersionRule.check_engine`); the emulation and the simulator run them.

The registry is :data:`RULES` (the fixed rules by name) and :data:`FAMILIES` (parameterised rules, named by a
prefix and an integer). Config, schedule generator, engine, emulation and simulator all take a rule through
:func:`get` (by the config's ``schedule`` name); nothing else compares schedule names.
"""
from __future__ import annotations

import re
from collections.abc import Callable
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
    emulation_only: bool = False
    """Whether only the emulation (and the simulator) runs it: the engine and the trainer refuse it at setup."""

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
        t = stages + self.max_versions(stage, stages, micro_batches)  # far enough that no version is clamped to W(0)
        return t - self.weight_version(t * micro_batches, stage, stages, micro_batches)

    def step_lag(self, stage: int) -> int:
        """Schedule steps from a batch's gradient reduce to its optimizer step on ``stage``."""
        return stage if self.defers_step else 0

    def check_engine(self) -> None:
        """Raise ``ValueError`` naming ``ds_async.schedule`` when the pipeline engine does not run this rule."""
        if self.emulation_only:
            raise ValueError(f"ds_async.schedule: '{self.name}' is emulation only (python -m ds_async.emulate); the "
                             f"pipeline engine runs {list(SCHEDULES)}")

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


@dataclass(frozen=True)
class ConstantDelay(VersionRule):
    """``W(t - steps)`` for every micro-batch of batch ``t`` on every stage (``W(0)`` before that)."""

    steps: int = 1

    def __post_init__(self):
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"a constant delay is a whole number of steps >= 0, got {self.steps!r}")

    def weight_version(self, micro_batch, stage, stages, micro_batches):
        return max(0, micro_batch // micro_batches - self.steps)

    def max_versions(self, stage, stages, micro_batches):
        return self.steps + 1


def constant_delay(steps: int) -> ConstantDelay:
    """The rule ``delay<steps>``."""
    # Not flush-free in the engine's sense (the engine refuses it), but updates overlap the next batches' passes as
    # in the flush-free rules, so the simulator can lay it on the flush-free grid.
    return ConstantDelay(f"delay{steps}", flush_free=True, emulation_only=True, steps=steps)


SYNC = Synchronous("1f1b", flush_free=False)
TWO_BW = TwoBW("2bw", flush_free=True, defers_step=True)
PIPEDREAM = PipeDream("pipedream", flush_free=True)
RULES: dict[str, VersionRule] = {rule.name: rule for rule in (SYNC, TWO_BW, PIPEDREAM)}
FAMILIES: dict[str, tuple[Callable[[int], VersionRule], str]] = {
    "delay": (constant_delay, "'delay<d>' (emulation only: a constant delay of d >= 0 steps on every stage)"),
}
"""Parameterised rules: name prefix -> (the rule for an integer, what its names look like)."""
SCHEDULES = tuple(name for name, rule in RULES.items() if not rule.emulation_only)
"""The schedules the pipeline engine runs."""


def known() -> str:
    """The names :func:`get` takes, in words."""
    return f"{list(RULES)}, or {', or '.join(doc for _, doc in FAMILIES.values())}"


def get(rule: str | VersionRule) -> VersionRule:
    """The rule named ``rule`` (a rule passes through): a name of :data:`RULES`, or a family's prefix followed by an
    integer written without leading zeros (``delay2``), so that each rule has one name."""
    if isinstance(rule, VersionRule):
        return rule
    if rule in RULES:
        return RULES[rule]
    match = re.fullmatch(r"([a-z]+)(0|[1-9][0-9]*)", rule) if isinstance(rule, str) else None
    if match and match[1] in FAMILIES:
        return FAMILIES[match[1]][0](int(match[2]))
    raise ValueError(f"unknown schedule {rule!r}; known: {known()}")
