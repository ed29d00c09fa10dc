"""Speculative decoding: a drafter proposes tokens, one forward pass verifies them, the KV cache rolls back."""
from kvforge.engine.spec.config import SpeculativeConfig
from kvforge.engine.spec.decoder import SpeculativeDecoder

__all__ = ["SpeculativeConfig", "SpeculativeDecoder"]
