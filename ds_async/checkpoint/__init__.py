"""Checkpoints of a pipeline job: atomic, verified, resumable exactly, and loadable by ``from_pretrained``.

:mod:`.folder` is the folder protocol (atomic write, manifest, verification, pruning; no engines), :mod:`.state`
what a pipeline job puts in it and how an engine is restored from it.
"""
from .folder import (FORMAT, MANIFEST, CheckpointError, complete_checkpoints, describe, latest, load_file,
                     read_manifest, resolve, sha256, step_dir, verify, verifying, write)
from .state import data_position, load, save

__all__ = ["FORMAT", "MANIFEST", "CheckpointError", "complete_checkpoints", "describe", "latest", "load_file",
           "read_manifest", "resolve", "sha256", "step_dir", "verify", "verifying", "write", "data_position", "load",
           "save"]
