"""Pagoda: an LLM inference and serving engine. `from pagoda import LLM, SamplingParams`."""

from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.version import __version__  # noqa: F401  (one place for it: pagoda.version)

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # Lazy: importing the engine pulls in torch and transformers.
    if name == "LLM":
        from pagoda.engine.llm import LLM

        return LLM
    if name == "EngineArgs":
        from pagoda.config import EngineArgs

        return EngineArgs
    if name in ("RequestOutput", "CompletionOutput"):
        import pagoda.outputs as outputs

        return getattr(outputs, name)
    raise AttributeError(name)
