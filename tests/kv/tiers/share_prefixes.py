"""Run by test_redis_tier in another process: compute the documents, push every cached block to Redis, print outputs."""
import json
import sys

from tier_helpers import ask_each, docs, engine

from kvforge.models.loader import load_model

model_dir, url = sys.argv[1], sys.argv[2]
e = engine(load_model(model_dir), tiers=[url])
outs = ask_each(e, docs(), salt="shared")
assert all(o.metrics.cached_tokens == 0 for o in outs)
e.kv.reset_prefix_cache()
e.close()
print(json.dumps([o.token_ids for o in outs]))
