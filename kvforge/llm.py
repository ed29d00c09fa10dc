"""LLM: the offline, vLLM-shaped Python API."""
from __future__ import annotations

from collections.abc import Sequence as Seq

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.errors import InvalidRequestError
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams


class LLM:
    """LLM(model=None, **engine_options); model=None loads the embedded SmolLM2-135M-Instruct."""

    def __init__(self, model: str | None = None, **engine_options):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an existing engine (e.g. one built over already loaded weights)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """One output per prompt, in order. A prompt is a str or a list of token ids."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(params, Seq) and not isinstance(params, SamplingParams):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one or one per prompt")
            params_list = list(params)
        else:
            params_list = [params or SamplingParams()] * len(prompts)
        ids = []
        try:
            for prompt, p in zip(prompts, params_list):
                ids.append(self.engine.add_request(prompt, p, cache_salt=cache_salt))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return self._run(ids)

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

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return [done[i] for i in ids]
