"""KV tiers below the pool: host memory, local disk and Redis, under the prefix cache (see docs/architecture.md)."""
