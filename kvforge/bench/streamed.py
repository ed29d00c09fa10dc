"""One streamed completion against an OpenAI-compatible server, timed: what `kvforge bench serve` and its
shared-prefix workload (bench/prefix_routing.py) send."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field


@dataclass
class Result:
    ok: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    replica: str = ""  # the x-kvforge-replica header (kvforge serve --ray)
    cached_tokens: int = 0


async def stream_one(client, body: dict, prompt_tokens: int = 0) -> Result:
    """POST a streaming completion and time it; errors are recorded in the Result, not raised."""
    r = Result(prompt_tokens=prompt_tokens)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            r.replica = resp.headers.get("x-kvforge-replica", "")
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.error = chunk["error"].get("message", "error")
                    return r
                if chunk.get("usage"):
                    r.output_tokens = chunk["usage"]["completion_tokens"]
                    r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    r.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if r.ttft == 0.0:
                        r.ttft = now - start
                    else:
                        r.itl.append(now - last)
                    last = now
        r.e2e = time.perf_counter() - start
        r.ok = r.output_tokens > 0
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        r.error = f"{type(e).__name__}: {e}"
    return r
