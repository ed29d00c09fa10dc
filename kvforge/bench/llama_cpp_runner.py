"""llama.cpp's batched-bench loop through llama-cpp-python's C API: one context per batch size,
the prompts prefilled in one `llama_decode` per `n_batch` tokens, then one decode call per step."""
from __future__ import annotations

import ctypes

import numpy as np

from kvforge.bench.timing import Clock, Timing
from kvforge.errors import ModelLoadError

N_BATCH = 2048  # llama.cpp's default logical batch


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level, text, user_data) -> None:
    return None


class LlamaCppRunner:
    def __init__(self, gguf_path: str, threads: int, extra_bufts: bool = True):
        """extra_bufts=False: no repacked weight buffers (AMX, CPU repack), for builds where they fail."""
        import llama_cpp as ll

        self.ll, self.threads = ll, threads
        ll.llama_log_set(_quiet, None)
        ll.llama_backend_init()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = 0
        if not extra_bufts:
            params.use_extra_bufts = False
        self.model = ll.llama_model_load_from_file(gguf_path.encode(), params)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {gguf_path!r}")
        self.vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def close(self) -> None:
        self.ll.llama_model_free(self.model)

    def _context(self, seqs: int, tokens: int):
        ll = self.ll
        params = ll.llama_context_default_params()
        params.n_ctx = tokens
        params.n_batch = N_BATCH
        params.n_seq_max = seqs
        params.n_threads = params.n_threads_batch = self.threads
        ctx = ll.llama_init_from_model(self.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {tokens} tokens for {seqs} sequences")
        return ctx

    def round(self, prompts: list[list[int]], ntg: int, n_ctx: int | None = None) -> Timing:
        """Prefill and decode times for the prompts, then ntg greedy decode steps each; the context holds n_ctx
        tokens (default: exactly what the round needs)."""
        ll, pl, npp = self.ll, len(prompts), len(prompts[0])
        ctx = self._context(pl, n_ctx or pl * (npp + ntg))
        batch = ll.llama_batch_init(max(N_BATCH, pl), 0, 1)
        try:
            flat = [(s, i, t) for s, p in enumerate(prompts) for i, t in enumerate(p)]
            clock = Clock()
            tokens = [0] * pl
            for first in range(0, len(flat), N_BATCH):
                rows = [(s, i, t, i == npp - 1) for s, i, t in flat[first: first + N_BATCH]]
                self._decode(ctx, batch, rows)
                last = [r for r, row in enumerate(rows) if row[3]]
                for r, token in zip(last, self._argmax(ctx, last)):
                    tokens[rows[r][0]] = token
            prefilled = clock.split()
            for step in range(ntg):
                self._decode(ctx, batch, [(s, npp + step, tokens[s], True) for s in range(pl)])
                tokens = self._argmax(ctx, range(pl))
            return Timing(prefilled, clock.split())
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)

    def _decode(self, ctx, batch, rows: list[tuple[int, int, int, bool]]) -> None:
        for r, (seq, pos, token, logits) in enumerate(rows):
            batch.token[r], batch.pos[r], batch.n_seq_id[r] = token, pos, 1
            batch.seq_id[r][0], batch.logits[r] = seq, logits
        batch.n_tokens = len(rows)
        if self.ll.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, ctx, rows) -> list[int]:
        return [int(np.ctypeslib.as_array(self.ll.llama_get_logits_ith(ctx, r), shape=(self.vocab,)).argmax())
                for r in rows]
