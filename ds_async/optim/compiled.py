"""Pointwise passes over lists of tensors: compiled on GPUs, eager torch ops elsewhere."""
from __future__ import annotations

import functools

import torch

# Compiled entries a pass may keep: one per shape and list length it is called with (the Muon passes run over
# chunks of one shape, ds_async.optim.muon_pass.same_shape_chunks: a Mixtral stage has ~5 shapes, each with up
# to two chunk lengths). Past Dynamo's default of 8 a new entry would silently run eagerly.
RECOMPILE_LIMIT = 64


def compiled_on_gpus(fn):
    """``fn`` compiled by Inductor (one kernel per tensor) when its first argument, a list of tensors, is on a GPU;
    the eager ops elsewhere, so CPU runs round exactly as the torch ops the tests compare against. ``.compiled`` is
    the compiled function, for tests that check it on CPU. ``torch.compile`` is called at the first compiled use,
    not at import: importing the compiler costs every process about a second, and CPU jobs never use it."""

    @functools.cache
    def build():
        return torch.compile(fn, dynamic=False)

    def compiled(*args, **kwargs):
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            return build()(*args, **kwargs)

    @functools.wraps(fn)
    def run(tensors, *args):
        return (compiled if tensors[0].is_cuda else fn)(tensors, *args)
    run.compiled = compiled
    return run
