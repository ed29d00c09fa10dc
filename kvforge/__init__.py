"""kvforge: a KV-cache-centred LLM inference engine."""
from kvforge.errors import KVForgeError
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams


def __getattr__(name):
    if name == "LLM":
        from kvforge.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvforge.engine.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from kvforge.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)


__all__ = ["LLM", "EngineConfig", "KVForgeError", "LLMEngine", "RequestOutput", "SamplingParams"]
