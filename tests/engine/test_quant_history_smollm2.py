"""Issue 30 item 2 as it was reproduced: kivi2 on the embedded SmolLM2, six documents, the same greedy tokens and
logprobs on a fresh engine and after unrelated traffic (aborts, ends mid-block) ran on it."""
import pytest

from kvforge.config import EngineConfig
from kvforge.engine.engine import LLMEngine
from kvforge.eval.texts import HELD_OUT, PANEL, load_text
from kvforge.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)


def engine(loaded):
    """Prompts in chunks of 256 tokens, so the documents' blocks claim staging entries over several steps."""
    return LLMEngine(EngineConfig(kv_cache_dtype="kivi2", max_num_seqs=6, max_model_len=1024,
                                  max_num_batched_tokens=256, kv_cache_memory=64 << 20,
                                  kv_staging_share=1.0), loaded)  # six windows, as reproduced (20 of the 64 MiB)


def run(e, prompts: list[list[int]], params: list[SamplingParams], abort_after: dict[int, int]) -> list:
    ids = [e.add_request(p, q) for p, q in zip(prompts, params)]
    done, steps = {}, 0
    while e.has_unfinished_requests():
        done.update({o.request_id: o for o in e.step() if o.finished})
        steps += 1
        for i in [i for i, at in abort_after.items() if at == steps]:
            e.abort(ids[i])
    assert not e.kv.requests
    return [done.get(i) for i in ids]  # aborted requests may end without an output


def test_kivi2_documents_same_after_unrelated_traffic(smol_loaded):
    tok = smol_loaded.tokenizer
    texts = [tok.encode(load_text(name)) for name in [*PANEL, HELD_OUT]]
    documents = [t[:300] for t in texts]
    traffic = [t[1000 + 37 * i: 1000 + 37 * i + 40 + 53 * i] for i, t in enumerate(texts * 2)]
    ends = [SamplingParams(temperature=0, max_tokens=3 + 7 * i, ignore_eos=True) for i in range(len(traffic))]

    fresh = run(engine(smol_loaded), documents, [PARAMS] * 6, {})
    e = engine(smol_loaded)
    run(e, traffic, ends, {i: 2 + i for i in range(0, len(traffic), 3)})
    after = run(e, documents, [PARAMS] * 6, {})
    for a, b in zip(fresh, after):
        assert a.token_ids == b.token_ids
        assert [d["logprob"] for d in a.logprobs] == [d["logprob"] for d in b.logprobs]
