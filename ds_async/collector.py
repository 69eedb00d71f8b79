"""Python's cyclic garbage collector at step boundaries instead of wherever allocations trigger it.

A flush-free pipeline keeps every GPU busy only while each stage's host issues work about as fast as its GPU runs
it (``launch/bench_stage.py``). The automatic collector pauses the host at an arbitrary allocation, and in a
pipeline a pause on one stage idles its neighbours too. With ``performance.gc_every = N`` the automatic collector
is off and the young generations are collected every ``N`` steps on every rank, at the same point of the step.
Objects in reference cycles then live up to ``N`` steps longer; objects that survive to the oldest generation are
only collected by an explicit full ``gc.collect()`` (as in torchtitan's and Megatron's manual GC).
"""
from __future__ import annotations

import gc


class StepCollector:
    def __init__(self, every: int):
        if every < 0:
            raise ValueError(f"gc_every must be >= 0, got {every}")
        self.every = every
        self._was_enabled = gc.isenabled()
        if every:
            gc.collect()
            gc.disable()

    def step(self, step: int) -> None:
        """Call after training step ``step``; collects on every ``every``-th."""
        if self.every and step % self.every == 0:
            gc.collect(1)

    def close(self) -> None:
        """Give the process its automatic collector back."""
        if self.every and self._was_enabled:
            gc.enable()
