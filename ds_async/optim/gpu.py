"""Where the optimizer's pointwise passes run: Triton kernels (:mod:`ds_async.optim.passes_triton`) for CUDA tensors,
eager torch ops elsewhere, so that CPU runs round exactly as the torch ops the tests compare against."""
from __future__ import annotations

import functools
from collections.abc import Sequence

from torch import Tensor


@functools.cache
def triton_passes():
    """:mod:`ds_async.optim.passes_triton`, imported at the first pass over CUDA tensors: Triton is a slow import,
    and CPU jobs never use it."""
    from . import passes_triton
    return passes_triton


def same_shape_runs(tensors: Sequence[Tensor]) -> list[list[int]]:
    """The indices of ``tensors`` grouped by shape and dtype, in order of first appearance: a pass makes one launch
    per group (one address table, one grid over its tensors); the Muon tail needs one shape per group, whose lr is
    adjusted for that shape."""
    by_shape: dict[tuple, list[int]] = {}
    for k, t in enumerate(tensors):
        by_shape.setdefault((tuple(t.shape), t.dtype), []).append(k)
    return list(by_shape.values())
