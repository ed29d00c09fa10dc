"""kvforge: a KV-cache-centred LLM inference engine."""
import os

if os.environ.get("KVFORGE_HUGE_PAGES", "1") != "0":
    # torch's CPU allocator puts tensors of 2 MB and more on transparent huge pages (it reads this once, before its
    # first allocation, so it applies when kvforge is imported before torch): oneDNN's packed weights, the KV pool
    # and step buffers then stream at the bandwidth the model weights get from ops/huge_pages.py.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from kvforge.errors import KVForgeError
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams


def __getattr__(name):
    if name == "__version__":
        from kvforge.version import package_version

        return package_version()
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
