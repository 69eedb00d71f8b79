"""Dry run of a schedule over all stages, with no processes.

Every stage's instruction stream is executed against the others with blocking point-to-point semantics: a send
completes only together with the matching receive on the neighbour (the worst case for NCCL and gloo). The run
proves the schedule cannot deadlock, pairs every send with its receive, and checks the weight-version invariants:

- each micro-batch's backward uses the version its forward used (weight stashing);
- a forward only uses weights that exist on its stage (``W(v)`` needs ``v`` optimizer steps done there);
- at most ``max_versions`` versions are alive per stage (in-flight ones plus the newest): 2 for 2BW;
- the update of batch ``t`` uses gradients computed at the rule's version on every stage (2BW: exactly ``t - 1``).

It also measures the bubble on DeepSpeed's step grid: a step in which a stage has no forward or backward is idle.
"""
from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field

from deepspeed.runtime.pipe import schedule as ds

from . import schedule as fs
from . import version_rule

_SENDS = {ds.SendActivation: (+1, ds.RecvActivation), ds.SendGrad: (-1, ds.RecvGrad)}


class ScheduleError(AssertionError):
    """The schedule deadlocks or breaks a weight-version invariant."""


@dataclass
class SimResult:
    stages: int
    micro_batches: int
    batches: int
    grid: list[list[str]]  # grid[step][stage]: "F12v2", "B7v1", "." (idle); "+S3" marks optimizer step 3
    idle_steps: list[int]  # per stage, over the whole segment (warm-up and drain included)
    busy_steps: list[int]
    messages: int
    max_alive: list[int] = field(default_factory=list)
    delays: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # (stage, batch) -> {t - version}

    @property
    def bubble(self) -> list[float]:
        return [i / (i + b) for i, b in zip(self.idle_steps, self.busy_steps)]

    def render(self) -> str:
        width = max(len(c) for row in self.grid for c in row) + 1
        head = "step  " + "".join(f"s{s}".ljust(width) for s in range(self.stages))
        lines = [head] + [f"{k:<6d}" + "".join(c.ljust(width) for c in row) for k, row in enumerate(self.grid)]
        lines.append("bubble " + " ".join(f"s{s}={b:.3f}" for s, b in enumerate(self.bubble)))
        return "\n".join(lines)


def simulate(rule: str | version_rule.VersionRule, stages: int, micro_batches: int, batches: int,
             schedule_cls: type[fs.FlushFreeSchedule] = fs.FlushFreeSchedule) -> SimResult:
    """Run ``batches`` batches of a flush-free schedule (its rule or name: ``2bw``, ``pipedream``, ``delay<d>``) on
    every stage. An emulation-only rule runs too: the 1F1B grid either gives every forward the version the rule
    asks for (a constant delay ``d >= p - 1`` at ``m = 1``) or the run stops at the first forward whose version does
    not exist yet."""
    rule = version_rule.get(rule)
    scheds = [schedule_cls(micro_batches, stages, s, rule, end_batch=batches) for s in range(stages)]
    per_stage = [list(sch.steps()) for sch in scheds]
    nsteps = len(per_stage[0])
    if any(len(x) != nsteps for x in per_stage):
        raise ScheduleError("stages disagree on the number of steps")
    grid, idle, busy = _grid(per_stage, stages, nsteps)
    run = _Run(rule, stages, micro_batches)
    messages = run.execute([[c for cmds in steps for c in cmds] for steps in per_stage])
    run.check_end(batches)
    return SimResult(stages, micro_batches, batches, grid, idle, busy, messages, run.alive_max, dict(run.delays))


def _grid(per_stage: list, stages: int, nsteps: int) -> tuple[list[list[str]], list[int], list[int]]:
    """The step x stage grid of labels (``F<mb>v<version>``, ``B...``, ``+S<batch>``, ``.``), and per stage the
    schedule steps without and with a pass."""
    grid = [["." for _ in range(stages)] for _ in range(nsteps)]
    idle, busy = [0] * stages, [0] * stages
    for s, steps in enumerate(per_stage):
        for k, cmds in enumerate(steps):
            labels = []
            for c in cmds:
                if isinstance(c, fs.ForwardPass):
                    labels.append(f"F{c.micro_batch}v{c.version}")
                elif isinstance(c, fs.BackwardPass):
                    labels.append(f"B{c.micro_batch}v{c.version}")
                elif isinstance(c, fs.OptimizerStep):
                    labels.append(f"+S{c.batch}")
            work = any(isinstance(c, (fs.ForwardPass, fs.BackwardPass)) for c in cmds)
            busy[s] += work
            idle[s] += not work
            grid[k][s] = "".join(labels) or "."
    return grid, idle, busy


class _Run:
    """Every stage's flattened instruction stream executed with rendezvous p2p, checking each local instruction
    against the rule: versions exist and match, buffers are free, steps come in order with none of their
    micro-batches in flight."""

    def __init__(self, rule: version_rule.VersionRule, stages: int, micro_batches: int):
        self.rule, self.stages, self.m = rule, stages, micro_batches
        self.steps_done = [0] * stages
        self.in_flight: list[dict[int, int]] = [dict() for _ in range(stages)]  # micro-batch -> version
        self.alive_max = [0] * stages
        self.delays: dict[tuple[int, int], set[int]] = defaultdict(set)
        self.buffer_owner: list[dict[int, int]] = [dict() for _ in range(stages)]

    def execute(self, streams: list[list]) -> int:
        """Run the streams to their ends; returns the number of p2p messages. ScheduleError on a deadlock."""
        stages, pos, messages = self.stages, [0] * self.stages, 0
        while True:
            progressed = False
            for s in range(stages):
                while pos[s] < len(streams[s]):
                    c = streams[s][pos[s]]
                    if type(c) in _SENDS:
                        direction, recv_type = _SENDS[type(c)]
                        peer = s + direction
                        if not 0 <= peer < stages:
                            raise ScheduleError(f"stage {s}: {c} has no peer")
                        if pos[peer] < len(streams[peer]) and type(streams[peer][pos[peer]]) is recv_type:
                            pos[peer] += 1
                            pos[s] += 1
                            messages += 1
                            progressed = True
                            continue
                        break
                    if type(c) in (ds.RecvActivation, ds.RecvGrad):
                        break  # completes when the sender reaches its send
                    self.local(s, c)
                    pos[s] += 1
                    progressed = True
            if all(p == len(x) for p, x in zip(pos, streams)):
                return messages
            if not progressed:
                blocked = {s: repr(streams[s][pos[s]]) for s in range(stages) if pos[s] < len(streams[s])}
                raise ScheduleError(f"deadlock: {blocked}")

    def local(self, s: int, c) -> None:
        if isinstance(c, fs.ForwardPass):
            self._forward(s, c)
        elif isinstance(c, fs.BackwardPass):
            if self.in_flight[s].get(c.micro_batch) != c.version:
                raise ScheduleError(f"stage {s}: backward of micro-batch {c.micro_batch} on v{c.version}, forward "
                                    f"used v{self.in_flight[s].get(c.micro_batch)}")
            del self.in_flight[s][c.micro_batch]
            self.buffer_owner[s][c.buffer_id] = None
            self.delays[(s, c.micro_batch // self.m)].add(c.micro_batch // self.m - c.version)
        elif isinstance(c, fs.OptimizerStep):
            if c.batch != self.steps_done[s]:
                raise ScheduleError(f"stage {s}: optimizer step {c.batch} out of order")
            if any(mb // self.m <= c.batch for mb in self.in_flight[s]):
                raise ScheduleError(f"stage {s}: step {c.batch} while its micro-batches are in flight")
            self.steps_done[s] += 1

    def _forward(self, s: int, c: fs.ForwardPass) -> None:
        if c.version > self.steps_done[s]:
            raise ScheduleError(f"stage {s}: forward of micro-batch {c.micro_batch} on W({c.version}) before "
                                f"it exists ({self.steps_done[s]} steps done)")
        want = self.rule.weight_version(c.micro_batch, s, self.stages, self.m)
        if c.version != want:
            raise ScheduleError(f"stage {s}: micro-batch {c.micro_batch} tagged v{c.version}, rule says v{want}")
        if self.buffer_owner[s].get(c.buffer_id) is not None:
            raise ScheduleError(f"stage {s}: buffer {c.buffer_id} still holds micro-batch "
                                f"{self.buffer_owner[s][c.buffer_id]} when {c.micro_batch} is forwarded")
        self.buffer_owner[s][c.buffer_id] = c.micro_batch
        self.in_flight[s][c.micro_batch] = c.version
        alive = set(self.in_flight[s].values()) | {self.steps_done[s]}
        self.alive_max[s] = max(self.alive_max[s], len(alive))

    def check_end(self, batches: int) -> None:
        """Every stage took every step, finished every micro-batch and stayed within the rule's version budget."""
        for s in range(self.stages):
            if self.steps_done[s] != batches:
                raise ScheduleError(f"stage {s}: {self.steps_done[s]} optimizer steps, expected {batches}")
            if self.in_flight[s]:
                raise ScheduleError(f"stage {s}: micro-batches {sorted(self.in_flight[s])} never finished")
            budget = self.rule.max_versions(s, self.stages, self.m)
            if self.alive_max[s] > budget:
                raise ScheduleError(f"stage {s}: {self.alive_max[s]} versions alive, budget {budget}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Print the step x stage grid of a flush-free schedule.")
    def flush_free(name: str) -> version_rule.VersionRule:
        try:
            rule = version_rule.get(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if not rule.flush_free:
            raise argparse.ArgumentTypeError(f"'{name}' is synchronous: DeepSpeed's TrainSchedule runs it")
        return rule

    parser.add_argument("--schedule", default="2bw", type=flush_free,
                        help="a flush-free rule: 2bw, pipedream, or delay<d> (emulation only; here it shows where "
                             "the pipeline grid can hold a constant delay of d steps)")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    a = parser.parse_args(argv)
    print(simulate(a.schedule, a.stages, a.micro_batches, a.batches).render())


if __name__ == "__main__":
    main()
