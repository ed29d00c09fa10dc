"""Speculative decoding: a drafter proposes tokens, one forward pass verifies them, the KV cache rolls back."""
from kvforge.engine.speculative.config import SpeculativeConfig
from kvforge.engine.speculative.decoder import SpeculativeDecoder

__all__ = ["SpeculativeConfig", "SpeculativeDecoder"]
