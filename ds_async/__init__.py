"""ds_async: asynchronous (PipeDream-2BW) pipeline-parallel LLM pretraining on DeepSpeed."""
__version__ = "0.1.0"

__all__ = ["initialize", "AsyncPipelineEngine", "__version__"]


def __getattr__(name):
    # Importing deepspeed is slow and picks an accelerator; defer it until the engine is needed.
    if name == "initialize":
        from .initialize import initialize
        return initialize
    if name == "AsyncPipelineEngine":
        from .pipe.engine import AsyncPipelineEngine
        return AsyncPipelineEngine
    raise AttributeError(name)
