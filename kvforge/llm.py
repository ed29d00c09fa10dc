"""LLM: the offline, vLLM-shaped Python API."""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from collections.abc import Sequence as Seq
from dataclasses import fields, replace
from functools import cached_property

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import ConfigError, InvalidRequestError
from kvforge.models.recommended_sampling import RecommendedSampling, recommended_sampling
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams


class LLM:
    """LLM(model=None, **engine_options); model=None loads the embedded SmolLM2-135M-Instruct.

    engine_options are EngineConfig's fields; kv_cache_memory takes bytes or a size string ("512MiB"), and
    vLLM's gpu_memory_utilization is accepted as kv_cache_memory_fraction (the share of free memory for KV); giving
    a budget and a fraction at once is refused, as on the command line.

    Sampling: `generate` / `chat` without params use `get_default_sampling_params()`, the model's recommended
    sampling (as vLLM applies generation_config.json) over SamplingParams' defaults; params given are used as they are.

    `close()` (also on leaving `with LLM(...) as llm:`, when the LLM is garbage-collected, and at interpreter exit)
    writes the KV blocks that KV tiers would otherwise lose to them, so the next process finds them.
    """

    def __init__(self, model: str | None = None, **engine_options):
        if "gpu_memory_utilization" in engine_options:
            if "kv_cache_memory_fraction" in engine_options:
                raise ConfigError("give gpu_memory_utilization or kv_cache_memory_fraction, not both (the same setting)")
            engine_options["kv_cache_memory_fraction"] = engine_options.pop("gpu_memory_utilization")
        if engine_options.get("kv_cache_memory") is not None and "kv_cache_memory_fraction" in engine_options:
            raise ConfigError("give kv_cache_memory (a KV budget) or gpu_memory_utilization (a share of free memory), "
                              "not both")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._closer = weakref.finalize(self, self.engine.close)  # runs once: close(), collection or exit

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built over already loaded weights); its owner closes it, or `close()`."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._closer = None
        return llm

    def close(self) -> None:
        """Keep the KV cache for the next process and close the KV tiers (engine.close); the LLM serves nothing after."""
        if self._closer is not None:
            self._closer()
        else:
            self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    @cached_property
    def recommended_sampling(self) -> RecommendedSampling:
        """The model's recommended sampling and where it comes from; empty when the model recommends none."""
        return recommended_sampling(self.engine.loaded.path)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's recommended sampling applied (vLLM's name)."""
        return SamplingParams(**self.recommended_sampling.values)

    def generate(self, prompts, params: SamplingParams | dict | list[SamplingParams | dict] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a str or a list of token ids; with n > 1 its
        `outputs` holds the n samples. params: SamplingParams, a dict of its fields (over the model's defaults),
        one per prompt, or None (the model's defaults)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, Seq) and not isinstance(params, SamplingParams):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
            params_list = [self._params(p) for p in params]
        else:
            params_list = [self._params(params)] * len(prompts)
        ids: list[list[str]] = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append([])
                for sample in one_per_sample(p):
                    ids[-1].append(self.engine.add_request(prompt, sample, cache_salt=cache_salt))
        except Exception:
            for rid in (r for group in ids for r in group):
                self.engine.abort(rid)
            raise
        done = self._run([r for group in ids for r in group])
        outputs = []
        for group in ids:
            first = done[group[0]]
            first.extra_samples = [done[r] for r in group[1:]]
            outputs.append(first)
        return outputs

    def _params(self, params) -> SamplingParams:
        """SamplingParams as given; a dict becomes one over the model's defaults; None is the model's defaults."""
        if params is None:
            return self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return params
        if isinstance(params, Mapping):
            unknown = sorted(set(params) - {f.name for f in fields(SamplingParams)})
            if unknown:
                raise InvalidRequestError(f"unknown sampling field(s) {', '.join(map(str, unknown))}; SamplingParams "
                                          f"takes {', '.join(f.name for f in fields(SamplingParams))}")
            return SamplingParams(**{**self.recommended_sampling.values, **params})
        raise TypeError(f"params must be a SamplingParams, a dict of its fields, or a list of them; got "
                        f"{type(params).__name__}")

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | dict | list | None = None
             ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c) for c in conversations]
        return self.generate(prompts, params)

    def render_chat(self, messages: list[dict]) -> list[int]:
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise InvalidRequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        text = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.engine.tokenizer.encode(text, add_special_tokens=False)

    def _run(self, ids: list[str]) -> dict[str, RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return done


def one_per_sample(params: SamplingParams) -> list[SamplingParams]:
    """n requests of one sample each; a seeded request's samples take seeds seed, seed+1, ..."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + j) for j in range(params.n)]
