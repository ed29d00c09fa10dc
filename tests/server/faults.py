"""Fault injection for server tests: a tiny random model with a character tokenizer, and an injector that makes
the model forward (mid-model, after the first layer wrote its K/V: the last decoder layer's module, or the layer
bridge's call after the last layer where the bridge serves the step), the sampler or the tokenizer raise on chosen
or seeded-random calls."""
from __future__ import annotations

import json
import random
import threading
from contextlib import contextmanager
from pathlib import Path

import kvforge.engine.runner as runner_module
import kvforge.models.bridged as bridged_module

SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2 (the tiny config's bos/eos are 1/2)
CHARS = [chr(c) for c in range(32, 127) if chr(c) not in "`~"]  # 93 printable characters: ids 3..95


def write_tiny_char_model(directory) -> None:
    """The tiny llama-gqa of tests/tiny_models.py plus a tokenizer.json with one token per character."""
    from tiny_models import write_tiny_model
    from tokenizers import Tokenizer, decoders, models

    write_tiny_model("llama-gqa", directory)
    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(SPECIAL)
    tok.decoder = decoders.Fuse()
    tok.save(str(Path(directory) / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config))


class InjectedFault(RuntimeError):
    """Raised by the injector; its message names the site and call, so every error a client sees can be traced."""


class FaultInjector:
    """Counts calls per site ('forward', 'sample', 'decode', 'encode') and raises on the chosen call numbers
    or with a seeded probability. `failed_batches` holds the prompt ids of each step whose forward or sampler raised."""

    def __init__(self, seed: int, at: dict[str, set[int]] | None = None, rate: dict[str, float] | None = None):
        self.rng = random.Random(seed)
        self.at = at or {}
        self.rate = rate or {}
        self.calls: dict[str, int] = {}
        self.injected: dict[str, int] = {}
        self.failed_batches: list[list[tuple[int, ...]]] = []
        self.enabled = True
        self._batch: list[tuple[int, ...]] = []
        self._lock = threading.Lock()

    def check(self, site: str) -> None:
        with self._lock:
            n = self.calls[site] = self.calls.get(site, 0) + 1
            fire = self.enabled and (n in self.at.get(site, ()) or self.rng.random() < self.rate.get(site, 0.0))
            if not fire:
                return
            self.injected[site] = self.injected.get(site, 0) + 1
            if site in ("forward", "sample"):
                self.failed_batches.append(list(self._batch))
        raise InjectedFault(f"injected {site} fault (call {n})")

    @contextmanager
    def installed(self, engine):
        """Patch engine's model (its last decoder layer), the runner's sampler and the tokenizer; undo on exit."""
        layer = engine.loaded.model.model.layers[-1]
        tokenizer = engine.tokenizer
        execute, sample, layer_forward = engine.runner.execute, runner_module.sample, layer.forward
        decode, encode = tokenizer.decode, tokenizer.encode
        bridge = bridged_module.layer_bridge

        def bridge_checked(attn, residual, cos, sin, post, pre, *rest):
            if len(pre) == 1:  # the call after the last layer: every layer has written its K/V
                self.check("forward")
            return bridge(attn, residual, cos, sin, post, pre, *rest)

        def execute_noting_batch(batch):
            self._batch = [tuple(s.prompt_token_ids) for s in batch.seqs]
            return execute(batch)

        forward, sample_, decode_, encode_ = (self._raising(site, fn) for site, fn in
                                              (("forward", layer_forward), ("sample", sample), ("decode", decode),
                                               ("encode", encode)))
        engine.runner.execute, runner_module.sample, layer.forward = execute_noting_batch, sample_, forward
        tokenizer.decode, tokenizer.encode = decode_, encode_
        bridged_module.layer_bridge = bridge_checked
        try:
            yield self
        finally:
            engine.runner.execute, runner_module.sample, layer.forward = execute, sample, layer_forward
            tokenizer.decode, tokenizer.encode = decode, encode
            bridged_module.layer_bridge = bridge

    def _raising(self, site: str, fn):
        def wrapper(*args, **kwargs):
            self.check(site)
            return fn(*args, **kwargs)

        return wrapper
