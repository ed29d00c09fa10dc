"""LLM: the offline, vLLM-shaped Python API."""
from __future__ import annotations

import weakref
from collections.abc import Sequence as Seq
from dataclasses import replace

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import InvalidRequestError
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams


class LLM:
    """LLM(model=None, **engine_options); model=None loads the embedded SmolLM2-135M-Instruct.

    engine_options are EngineConfig's fields; kv_cache_memory takes bytes or a size string ("512MiB"), and
    vLLM's gpu_memory_utilization is accepted as kv_cache_memory_fraction (the share of free memory for KV).

    `close()` (also on leaving `with LLM(...) as llm:`, when the LLM is garbage-collected, and at interpreter exit)
    writes the KV blocks that KV tiers would otherwise lose to them, so the next process finds them.
    """

    def __init__(self, model: str | None = None, **engine_options):
        if "gpu_memory_utilization" in engine_options:
            engine_options["kv_cache_memory_fraction"] = engine_options.pop("gpu_memory_utilization")
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

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a str or a list of token ids; with n > 1 its
        `outputs` holds the n samples."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, Seq) and not isinstance(params, SamplingParams):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
            params_list = list(params)
        else:
            params_list = [params or SamplingParams()] * len(prompts)
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

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None
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
