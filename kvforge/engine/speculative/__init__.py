"""Speculative decoding: a drafter proposes tokens, one forward pass verifies them, the KV cache rolls back."""
from kvforge.engine.speculative.decoder import SpeculativeDecoder
from kvforge.speculative_config import SpeculativeConfig

__all__ = ["SpeculativeConfig", "SpeculativeDecoder"]
