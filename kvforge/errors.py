"""Typed errors raised at kvforge's boundaries (API, CLI, server, loaders).

Each message says what was wrong and what is allowed.
"""
from __future__ import annotations


class KVForgeError(Exception):
    """Base class of every error kvforge raises on purpose."""


class InvalidRequestError(KVForgeError, ValueError):
    """A request or its sampling parameters are invalid."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus what it asks to generate) does not fit the model or the cache."""


class ConfigError(KVForgeError, ValueError):
    """An engine or cache option is invalid or options contradict each other."""


class ModelLoadError(KVForgeError):
    """A model path is missing, unsupported, truncated or corrupt."""


class OutOfKVMemoryError(KVForgeError):
    """The KV budget cannot hold even one request of the given size."""


class TokenizerMismatchError(ConfigError):
    """A draft model's tokenizer differs from the target's, so its token ids would mean other text."""
