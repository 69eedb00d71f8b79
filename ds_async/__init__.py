"""ds_async: asynchronous (PipeDream-2BW) pipeline-parallel LLM pretraining on DeepSpeed."""
__version__ = "0.1.0"

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
