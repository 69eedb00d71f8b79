"""Optimizers from the DeepSpeed JSON ``"optimizer"`` block."""
from __future__ import annotations

import torch


def build_optimizer(block: dict, params) -> torch.optim.Optimizer:
    """The optimizer DeepSpeed builds for ``{"type": ..., "params": {...}}`` when no fused kernel is involved.

    Used by the single-process emulation so that it steps exactly like the engine's optimizer.
    """
    kind, kwargs = block["type"], dict(block.get("params", {}))
    if kind.lower() in ("adam", "adamw"):
        if not kwargs.pop("torch_adam", False):
            raise ValueError("the emulation mirrors DeepSpeed's torch Adam path: set \"torch_adam\": true")
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        cls = torch.optim.AdamW if kind.lower() == "adamw" or adam_w_mode else torch.optim.Adam
        return cls(params, **kwargs)
    return getattr(torch.optim, kind)(params, **kwargs)
