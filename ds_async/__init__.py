"""ds_async: asynchronous (PipeDream-2BW) pipeline-parallel LLM pretraining on DeepSpeed."""
import sys

__version__ = "0.1.0"

if sys.argv[:1] == ["-m"]:
    # ``python -m ds_async.<command>`` imports this package while it looks for the command, sys.argv[0] being "-m"
    # until it is found: the command's imports of DeepSpeed and transformers are then quieted as launch/train.py's
    # are. ``import ds_async`` anywhere else changes nothing.
    from . import console
    console.quiet_imports()

__all__ = ["initialize", "init_distributed", "AsyncPipelineEngine", "__version__"]


def __getattr__(name):
    # Importing deepspeed is slow and picks an accelerator; defer it until the engine is needed.
    if name in ("initialize", "init_distributed"):
        from . import builder
        return getattr(builder, name)
    if name == "AsyncPipelineEngine":
        from .pipe.engine import AsyncPipelineEngine
        return AsyncPipelineEngine
    raise AttributeError(name)
