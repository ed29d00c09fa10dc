"""kvforge: a KV-cache-centred LLM inference engine."""
