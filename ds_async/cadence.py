"""When a run evaluates, saves and drains its pipeline: one plan shared by the trainer and the emulation.

Steps are numbered from 1 (step ``s`` applies batch ``s - 1``'s update). Evaluations and periodic saves happen
after every ``eval_every`` / ``save_every`` steps, and once more at the end (the final evaluation always, the
final save when ``final_save``). A flush-free pipeline must be empty for each of them, so it drains after the
batch of the next such step; a synchronous one drains every step anyway.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Cadence:
    total_steps: int
    eval_every: int = 0
    """Evaluate after every this many steps (0: only at the end, if ``evaluate``)."""
    save_every: int = 0
    """Save after every this many steps (0: only at the end, if ``final_save``)."""
    evaluate: bool = True
    """Whether there is a validation set at all."""
    final_save: bool = True

    def evaluates(self, step: int) -> bool:
        """Whether an evaluation follows step ``step`` (the final one included)."""
        if not self.evaluate:
            return False
        return step == self.total_steps or bool(self.eval_every) and step % self.eval_every == 0

    def saves(self, step: int) -> bool:
        """Whether a checkpoint is saved after step ``step`` (the final one included)."""
        periodic = bool(self.save_every) and step % self.save_every == 0
        return periodic or (step == self.total_steps and self.final_save)

    def next_drain(self, step: int) -> int:
        """The first step ``>= step`` after which the pipeline must be empty: an evaluation, a save or the end."""
        candidates = [self.total_steps]
        for every in (self.eval_every if self.evaluate else 0, self.save_every):
            if every:
                candidates.append(-(-step // every) * every)
        return min(candidates)
