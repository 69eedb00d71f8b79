"""The weight versions of one stage: which tensors a forward runs on, where its gradients land, what is freed.

The optimizer owns the stage's parameters (the *master*, newest weights ``W(t)``). Forwards never touch them:
each runs on a *slot*, a set of leaf tensors holding one older or current version, swapped into the module just
for that forward. Autograd keeps references to the slot it ran on, so the backward uses exactly the weights of
its forward (weight stashing) and accumulates into that slot's ``.grad``, and optimizer steps on the master can
happen while micro-batches are in flight without touching any tensor autograd saved.

The slot count is fixed by the schedule (two for 2BW); a slot is recycled, by an in-place copy of the master,
only when no in-flight micro-batch refers to it. No DeepSpeed in here: the module is any ``nn.Module``.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn


class WeightVersions:
    def __init__(self, module: nn.Module, num_slots: int, first_version: int = 0):
        # (owner module, attribute name, master parameter) for every trainable parameter, in a fixed order.
        self.entries = [(owner, name, p) for owner in module.modules()
                        for name, p in owner.named_parameters(recurse=False) if p.requires_grad]
        self.names = [f"{prefix}.{name}" if prefix else name for prefix, owner in module.named_modules()
                      for name, p in owner.named_parameters(recurse=False) if p.requires_grad]
        self.slots: list[list[nn.Parameter]] = [
            [nn.Parameter(p.detach().clone()) for _, _, p in self.entries] for _ in range(num_slots)]
        self.version_of_slot: list[int | None] = [first_version] + [None] * (num_slots - 1)
        self.in_flight: Counter[int] = Counter()  # version -> micro-batches forwarded but not yet backwarded

    def _slot(self, version: int) -> int:
        try:
            return self.version_of_slot.index(version)
        except ValueError:
            raise RuntimeError(f"weight version {version} is not held (held: {self.version_of_slot})") from None

    def activate(self, version: int) -> None:
        """Point the module's parameters at ``version``'s slot for the next forward."""
        self.point_at(version)
        self.in_flight[version] += 1

    def point_at(self, version: int) -> None:
        """Point the module's parameters at ``version``'s slot, e.g. for a backward that recomputes its forward
        (activation checkpointing), which must run on the weights of the original forward."""
        slot = self.slots[self._slot(version)]
        for (owner, name, _), tensor in zip(self.entries, slot):
            owner._parameters[name] = tensor

    def backward_done(self, version: int) -> None:
        self.in_flight[version] -= 1
        if not self.in_flight[version]:
            del self.in_flight[version]

    def restore_master(self) -> None:
        """Put the optimizer's parameters back into the module (before reductions, steps, evals, saves)."""
        for owner, name, master in self.entries:
            owner._parameters[name] = master

    def slot_grads(self) -> list[torch.Tensor]:
        """The gradients the slots hold (the finished batch's, before :meth:`gather_grads` moves them)."""
        return [t.grad for slot in self.slots for t in slot if t.grad is not None]

    def gather_grads(self) -> None:
        """Move the gradients of a finished batch from the slots onto the master parameters.

        Called after the batch's last backward and before any backward of the next batch, so every gradient
        held by a slot belongs to that batch (under PipeDream's rule it may span two versions: they are summed).
        """
        for k, (_, _, master) in enumerate(self.entries):
            grads = [slot[k].grad for slot in self.slots if slot[k].grad is not None]
            for slot in self.slots:
                slot[k].grad = None
            if not grads:
                continue
            total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
            master.grad = total if master.grad is None else master.grad.add_(total)

    def distance_sq(self, version: int) -> torch.Tensor:
        """``||W(version) - master||^2`` over this stage: how stale the weights a gradient was computed on are."""
        slot = self.slots[self._slot(version)]
        # One tensor's difference at a time: all of them at once would hold an fp32 copy of the stage.
        return torch.stack([torch.linalg.vector_norm((s.detach() - master.detach()).float()).square()
                            for s, (_, _, master) in zip(slot, self.entries)]).sum()

    def publish(self, version: int, needed_from: int) -> None:
        """Copy the master (now ``W(version)``) into a slot that neither an in-flight micro-batch nor a future
        forward (whose versions are all ``>= needed_from``) will use."""
        slot = self.claim(version, needed_from)
        with torch.no_grad():
            torch._foreach_copy_(slot, [master for _, _, master in self.entries])

    def claim(self, version: int, needed_from: int) -> list[nn.Parameter]:
        """The slot :meth:`publish` would copy ``W(version)`` into, labelled ``version``, for the caller to fill
        (in entry order) before any forward on ``version`` runs."""
        free = [i for i, v in enumerate(self.version_of_slot)
                if v is None or (v not in self.in_flight and v < needed_from)]
        if not free:
            raise RuntimeError(f"no free weight slot for version {version}: held {self.version_of_slot}, "
                               f"in flight {dict(self.in_flight)}")
        i = min(free, key=lambda j: -1 if self.version_of_slot[j] is None else self.version_of_slot[j])
        self.version_of_slot[i] = version
        return self.slots[i]

    def state_dict(self) -> dict:
        """The held versions by parameter name, for a checkpoint of a drained pipeline. The newest version is the
        master's copy (published right after each step) and is not stored twice: its slot is ``None``, as is an
        empty one."""
        if self.in_flight:
            raise RuntimeError("cannot save weight versions with micro-batches in flight: drain the pipeline first")
        newest = max(v for v in self.version_of_slot if v is not None)
        slots = [None if v is None or v == newest else
                 {name: t.detach().cpu().clone() for name, t in zip(self.names, slot)}
                 for slot, v in zip(self.slots, self.version_of_slot)]
        return {"version_of_slot": list(self.version_of_slot), "slots": slots}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s versions; the master parameters must already hold the newest weights."""
        if len(state["slots"]) != len(self.slots):
            raise ValueError(f"{len(state['slots'])} weight slots saved, this schedule keeps {len(self.slots)}")
        with torch.no_grad():
            for slot, tensors in zip(self.slots, state["slots"]):
                for t, name, (_, _, master) in zip(slot, self.names, self.entries):
                    t.copy_(master if tensors is None else tensors[name])
        self.version_of_slot = list(state["version_of_slot"])
        self.in_flight.clear()
