"""LLMEngine: the step-level API (add_request, step, abort) that LLM and the server drive."""
from __future__ import annotations

import itertools
import logging
import random
import time
import traceback

import torch

from kvforge.config import EngineConfig, check_max_model_len
from kvforge.engine.combinations import check_combinations, check_compressed_reuse
from kvforge.engine.grammar import RequestGrammar
from kvforge.engine.host_memory import keep_freed_memory, release_freed_memory
from kvforge.engine.kv_budget import budget_split, size_kv
from kvforge.engine.prefill_order import PrefillOrder
from kvforge.engine.reconstruction import reconstruction_scores
from kvforge.engine.runner import ModelRunner
from kvforge.engine.scheduler import ScheduledBatch, Scheduler
from kvforge.engine.sequence import Sequence
from kvforge.engine.speculative.build import build_speculator, check_speculation, load_draft_model
from kvforge.engine.stop import check_stop
from kvforge.engine.weights_mode import engine_device, weights_for
from kvforge.errors import InvalidRequestError, PromptTooLongError
from kvforge.kv.formats import format_for_model
from kvforge.kv.groups import build_groups, state_bytes_per_sequence
from kvforge.kv.manager import KVCacheManager
from kvforge.kv.policies import Evictor, build_policy, check_policy_groups
from kvforge.kv.policies.stats import AttentionStats
from kvforge.kv.tiers.keys import ModelKey
from kvforge.kv.tiers.persist import CLOSE_TIMEOUT_S
from kvforge.kv.tiers.setup import build_tier_connector, check_tier_groups
from kvforge.models.bridged import prepare_bridge
from kvforge.models.loader import LoadedModel
from kvforge.models.weight_store import prepare_weights, resident_bytes
from kvforge.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams

log = logging.getLogger("kvforge.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        self.config = config
        self.device = engine_device(config, loaded)
        keep_freed_memory()
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self._request_seeds = random.Random(config.seed)  # seed=None: fresh OS entropy every run
        self.loaded, self.weights_mode = weights_for(config, loaded, self.device)
        self.model_config = cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        self.kv_spec = cfg.kv_cache_spec()
        self.format = format_for_model(config.kv_cache_dtype, config.kv_cache_options, cfg)
        self.format.validate(self.kv_spec, config.block_size)
        self.layer_windows = cfg.layer_windows()
        self.groups = build_groups(self.layer_windows, config.kv_cache_groups)
        check_tier_groups(config.kv_tiers, self.groups)
        self.policy = build_policy(config.kv_policy, config.kv_policy_options)
        check_policy_groups(self.policy, self.groups)
        check_max_model_len(self.max_model_len, cfg.max_position_embeddings, self.policy)
        self.state_groups = cfg.state_groups
        self.state_bytes = state_bytes_per_sequence(self.state_groups)  # per running sequence, whatever its length
        check_combinations(config, self.policy, self.state_groups)
        self.speculative_config = config.speculative
        check_speculation(self.speculative_config, self.loaded.model, self.groups, self.policy)
        self.draft = load_draft_model(self.speculative_config, self.loaded, self.device, self.max_model_len,
                                      self.format, config.block_size, self.groups)  # None unless method 'draft'
        for weights in (self.loaded, self.draft):  # every layout made now: no step stalls, free memory counts it
            if weights is not None:
                prepare_weights(weights.model)
                prepare_bridge(weights.model)
        self.weight_bytes = sum(resident_bytes(w.model) for w in (self.loaded, self.draft) if w is not None)
        release_freed_memory()  # loading, quantizing and packing left freed temporaries in the heap
        draft_spec = self.draft.config.kv_cache_spec() if self.draft else None
        self.kv_sizing = size_kv(config, self.kv_spec, self.format, self.groups, draft_spec, self.state_bytes,
                                 self.policy.evicts, self.max_model_len, self.device)
        self.kv_budget_bytes, self.checkpoint_bytes = self.kv_sizing.budget_bytes, self.kv_sizing.checkpoint_bytes
        self.max_num_seqs, num_blocks = self.kv_sizing.max_num_seqs, self.kv_sizing.num_blocks
        self.max_model_len = self.kv_sizing.max_model_len
        self.max_model_len_capped_from = self.kv_sizing.capped_from  # the model's context, when the budget capped it
        # an evicting sequence's blocks no longer hold its token prefix: no prefix sharing under eviction
        prefix = config.enable_prefix_caching and not self.policy.evicts
        self.kv = KVCacheManager(self.kv_spec, self.format, num_blocks, config.block_size, self.device, config.kv_layout,
                                 self.max_model_len, prefix, self.max_num_seqs, self.groups, self.state_groups,
                                 self.checkpoint_bytes, config.state_checkpoint_interval)
        self.preemption_mode = config.resolve_preemption_mode(self.policy.evicts)
        order = None if config.prefill_order == "fcfs" else PrefillOrder(config.prefill_token_cost,
                                                                           config.prefill_overtake_tokens)
        self.scheduler = Scheduler(self.kv, self.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
                                   self.preemption_mode, order)
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        self.runner = ModelRunner(self.loaded.model, self.kv, self.device, self.layer_windows, decode)
        if self.policy.evicts:
            if self.policy.reconstructs:  # kvzip's instruction in this model's tokens (text needs the tokenizer)
                tokenizer = self.tokenizer
                encode = (lambda text: tokenizer.encode(text, add_special_tokens=False)) if tokenizer is not None else None
                self._repeat_ids = self.policy.repeat_ids(encode)
            if self.policy.reuses_prefixes:
                check_compressed_reuse(self.policy, self.groups, self.kv.stage_blocks, config.kv_cache_dtype)
                self.kv.keep_compressed(self.policy.namespace())
            rotary, inv_freq = getattr(self.loaded.model, "rotary", None), None
            if not cfg.extra.get("rope", True):  # no positions in the keys (NoPE: Granite 4.0-H): nothing turns
                rotary, inv_freq = None, torch.zeros(cfg.head_dim // 2)
            self.runner.evictor = Evictor(self.policy, self.kv, rotary,
                                          self._reconstruct if self.policy.reconstructs else None, self.loaded.path,
                                          inv_freq)
        # streaming keeps RoPE positions inside a bounded cache, so a sequence may outgrow the context
        self.length_limit = 2**62 if self.policy.unbounded_context else self.max_model_len
        if self.speculative_config:
            self.runner.speculator = build_speculator(self.speculative_config, self.runner, self.draft,
                                                      self.max_num_seqs, self.length_limit)
        if config.kv_tiers:
            draft_pool = self.runner.speculator.drafter.pool if self.draft is not None else None  # tiers move its K/V too
            self.kv.attach_connector(build_tier_connector(
                config.kv_tiers, self.groups, self.kv.pool, self._model_key(), self.format,
                config.kv_tier_write_through, config.kv_tier_fsync, self.device, draft_pool,
                states=self.state_groups))
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.generated_tokens = 0
        self.jump_forward_tokens = 0  # tokens a grammar forced, appended without a decode step of their own
        if self.tiers is not None:  # the tiers' weights fingerprint read a state dict (int8: dequantized copies)
            release_freed_memory()

    @property
    def tiers(self):
        """The KV tiers' chain (kvforge.kv.tiers.chain.TierChain) when the connector is the tiers', else None."""
        return getattr(self.kv.connector, "tiers", None)

    def _model_key(self) -> ModelKey:
        """Everything about the model(s) that changes the cached K/V, for the tiers' key namespace."""
        draft = ModelKey.of(self.draft.model, self.draft.config) if self.draft is not None else None
        return ModelKey.of(self.loaded.model, self.model_config, self.weights_mode, draft)

    def kv_budget_split(self) -> dict:
        """Where the KV budget went (kvforge.engine.kv_budget.budget_split)."""
        draft = self.draft.config.kv_cache_spec() if self.draft else None
        return budget_split(self.config, self.kv_sizing, self.kv_spec, self.format, self.groups, draft,
                            self.kv.block_bytes, self.kv.allocator.num_blocks, self.state_bytes)

    def capped_note(self) -> str:
        """Why max_model_len is below the model's context, when the KV budget capped it; else empty."""
        if self.max_model_len_capped_from is None:
            return ""
        return (f" (capped from the model's context of {self.max_model_len_capped_from:,} tokens so that one sequence "
                f"fits the KV budget of {self.kv_budget_bytes / 2**20:.0f} MiB; raise kv_cache_memory (--kv-memory) "
                "for longer sequences)")

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be a SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise InvalidRequestError(f"engine.add_request takes one sample (n=1), got n={params.n}; LLM.generate and "
                                      "the server expand n into n requests")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.length_limit:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}{self.capped_note()}, "
                "so the prompt must be shorter than that to leave room for at least one generated token")
        if not self.config.enable_chunked_prefill and len(ids) > self.config.max_num_batched_tokens:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; with enable_chunked_prefill=False a prompt runs in one step, so it may "
                f"have at most max_num_batched_tokens={self.config.max_num_batched_tokens} tokens")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, text, ids, params, time.monotonic(), cache_salt)
        if params.structured_outputs is not None:
            self._start_grammar(seq)
        if seq.generator is None and not params.greedy:
            seq.generator = torch.Generator().manual_seed(self._request_seeds.getrandbits(62))
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def _start_grammar(self, seq: Sequence) -> None:
        """The request's grammar (a 400 when it does not compile); tokens it forces before the first sampled one
        join the prompt's prefill when the request jumps forward."""
        if self.runner.speculator is not None:
            raise InvalidRequestError("structured output is not supported with speculative decoding on this engine")
        seq.grammar = RequestGrammar(seq.params.structured_outputs, self.tokenizer, self.model_config.vocab_size)
        if seq.params.jumps_forward:
            for token in seq.grammar.forced_tokens()[: seq.params.max_tokens - 1]:
                self._force(seq, token)

    def _jump_forward(self, seq: Sequence, now: float) -> str | None:
        """Append the tokens seq's grammar forces now (their K/V come in the next step as one chunk); a stop reason
        when one of them ends the request."""
        for token in seq.grammar.forced_tokens():
            self._force(seq, token)
            reason = self._stop_reason(seq)
            if reason:
                return reason
        return None

    def _force(self, seq: Sequence, token: int) -> None:
        """Append a token seq's grammar forces, without a decode step of its own."""
        seq.grammar.accept(token)
        seq.token_ids.append(token)
        self.generated_tokens += 1
        self.jump_forward_tokens += 1

    def _stop_reason(self, seq: Sequence) -> str | None:
        reason = check_stop(seq, self.tokenizer, self.length_limit, self.model_config.eos_token_ids)
        return reason or ("stop" if seq.grammar is not None and seq.grammar.done else None)

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty; give at least one character or token id")
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass the prompt as a list of token ids")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        elif isinstance(prompt, (list, tuple)):
            ids, text = self.check_token_ids(prompt), None
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidRequestError("prompt is empty; give at least one character or token id")
        return text, ids

    def check_token_ids(self, ids, name: str = "prompt") -> list[int]:
        """ids as a list; InvalidRequestError (naming `name`) unless every one is a token id of this model."""
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"{name}: token ids must be integers in [0, {vocab}), got {bad[0]!r}")
        return list(ids)

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        seq.finish_reason = "abort"
        self.scheduler.finish(seq)
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Keep the KV cache for the next process: cached blocks the shared tiers lack (write-back) and queued stores
        are written within `timeout` seconds (what is left is counted and logged), then tier connections close. The
        engine serves nothing after this; a second call does nothing."""
        self.kv.close(timeout)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one batch; returns outputs of requests that produced a token or finished."""
        drafts = self.runner.speculator.propose(self.scheduler.running) if self.runner.speculator else None
        batch = self.scheduler.schedule(drafts)
        if not batch:
            return []
        now = time.monotonic()
        for seq in batch.seqs:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
        try:
            result = self.runner.execute(batch)
        except Exception as e:  # noqa: BLE001 - the batch's requests fail, the engine keeps serving
            return self._fail(batch.seqs, e)
        now = time.monotonic()
        emitting = [seq for seq in batch.seqs if seq.request_id in result.tokens or seq.request_id in result.errors]
        failed = dict(result.errors)  # its token could not be sampled: this request fails, not the step
        rejected = {seq.request_id: len(batch.drafts(seq)) for seq in emitting if seq.request_id in failed}
        for seq in emitting:
            if seq.request_id in failed:
                continue
            try:
                kept = self._append(seq, result, now)  # its accepted drafts and one token of the target's own
                rejected[seq.request_id] = len(batch.drafts(seq)) - (kept - 1)
            except Exception as e:  # noqa: BLE001 - e.g. the tokenizer failed on this request only
                failed[seq.request_id] = e
                rejected[seq.request_id] = len(batch.drafts(seq))  # commit none of its drafts
        self.commit(batch, result.stats, rejected, uncached=set(result.errors))
        outputs = []
        for seq in emitting:
            error = failed.get(seq.request_id)
            if error is None:
                try:
                    if seq.finish_reason is not None:
                        self.scheduler.finish(seq)
                        self.requests.pop(seq.request_id, None)
                    outputs.append(self._output(seq))
                    continue
                except Exception as e:  # noqa: BLE001 - e.g. detokenizing its text failed
                    error = e
            outputs += self._fail([seq], error)
        return outputs

    def _fail(self, seqs: list[Sequence], error: Exception) -> list[RequestOutput]:
        """Finish seqs with finish_reason 'error' after their step raised. Their blocks are freed without entering
        the prefix cache (the failed step may have half-written them); blocks cached by earlier steps stay."""
        # the traceback as text: a handler that keeps records (tests, memory handlers) must not pin the step's frames
        log.error("step failed for %d request(s): %s", len(seqs), "".join(traceback.format_exception(error)).rstrip())
        now = time.monotonic()
        outputs = []
        for seq in seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, cache=False)
            self.requests.pop(seq.request_id, None)
            seq.finish_reason, seq.metrics.finished_time = "error", now
            outputs.append(RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, "", list(seq.output_token_ids),
                                         True, "error", seq.metrics, [], error=f"{type(error).__name__}: {error}"))
        return outputs

    def _append(self, seq: Sequence, result, now: float) -> int:
        """Append seq's emitted tokens up to the first stop; returns how many it kept."""
        tokens, logprobs = result.tokens[seq.request_id], result.logprobs.get(seq.request_id)
        kept = 0
        reason = None
        for j, token in enumerate(tokens):
            if seq.grammar is not None:
                seq.grammar.accept(token)
            seq.token_ids.append(token)
            kept += 1
            if logprobs is not None:
                seq.logprobs.append(logprobs[j])
            self.generated_tokens += 1
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            reason = self._stop_reason(seq)
            if reason:
                break
        if reason is None and seq.grammar is not None and seq.params.jumps_forward:
            reason = self._jump_forward(seq, now)
        if reason:
            seq.finish_reason = reason
            seq.metrics.finished_time = now
        seq.metrics.generated_tokens = seq.num_output_tokens
        return kept

    def _reconstruct(self, seq: Sequence, policy) -> torch.Tensor:
        """kvzip's scoring pass over seq (kvforge.engine.reconstruction), its instruction in this model's tokens."""
        return reconstruction_scores(self.runner, seq, self._repeat_ids, policy.chunk, policy.scope == "head")

    def commit(self, batch: ScheduledBatch, stats: AttentionStats | None = None,
               rejected: dict[str, int] | None = None, uncached: set[str] = frozenset()) -> None:
        """A forward pass succeeded: its tokens count as computed (rejected drafts rolled back), full blocks
        become shareable (except those of `uncached` requests, whose logits were unusable), the KV policy runs."""
        rejected = {rid: r for rid, r in (rejected or {}).items() if r}
        before = [seq.num_computed_tokens for seq in batch.seqs]
        self.scheduler.update_from_output(batch, rejected)
        for i, seq in enumerate(batch.seqs):
            if seq.request_id in rejected:
                self.kv.rollback(seq)
                self.kv.rollback_state(seq, i, batch.num_new_tokens[i] - rejected[seq.request_id])
                self.runner.speculator.rollback(seq, self.kv)
        bs = self.kv.block_size
        for seq, prev in zip(batch.seqs, before):
            if seq.num_computed_tokens // bs > prev // bs and seq.request_id not in uncached:
                self.kv.cache_full_blocks(seq)
        self.kv.store_checkpoints(batch.seqs, before)
        if self.runner.evictor:
            self.runner.evictor.after_step(batch.seqs, stats, rejected)

    def _output(self, seq: Sequence) -> RequestOutput:
        out_ids = seq.output_token_ids
        new = out_ids[seq.num_returned:]
        seq.num_returned = len(out_ids)
        text = ""
        if self.tokenizer is not None and seq.is_finished:
            text = self.tokenizer.decode(out_ids)
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, text, list(out_ids), seq.is_finished,
                             seq.finish_reason, seq.metrics, new, list(seq.logprobs) if seq.params.logprobs is not None else None)

    def stats(self) -> dict:
        s = self.kv.stats()
        s.update({
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "loading": len(self.scheduler.loading),
            "preemptions": self.scheduler.num_preemptions,
            "preemption_mode": self.preemption_mode,
            "preempted_tokens_recomputed": self.scheduler.recomputed_tokens,
            "generated_tokens": self.generated_tokens,
            "kv_cache_dtype": self.format.name,
            "kv_layout": self.config.kv_layout,
            "weight_bytes": self.weight_bytes,
            "jump_forward_tokens": self.jump_forward_tokens,
            **self.kv_budget_split(),
        })
        if self.runner.evictor:
            s.update(self.runner.evictor.stats())
        if self.runner.speculator:
            s.update(self.runner.speculator.stats())
        return s

