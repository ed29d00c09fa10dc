"""kvforge chat: an interactive conversation with streamed output."""
from __future__ import annotations

import sys

from kvforge.cli.common import add_engine_options, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("chat", help="interactive chat, streamed (empty line or /exit quits)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    add_engine_options(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from kvforge import LLM, SamplingParams
    from kvforge.models.tokenizer import IncrementalDetokenizer

    llm = LLM(**engine_kwargs(args))
    engine, tok = llm.engine, llm.get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("", "/exit", "/quit"):
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        rid = engine.add_request(llm.render_chat(messages), params)
        detok = IncrementalDetokenizer(tok)
        print("assistant> ", end="", flush=True)
        final = None
        while final is None:
            for out in engine.step():
                if out.request_id != rid:
                    continue
                for t in out.new_token_ids:
                    if t not in engine.model_config.eos_token_ids:
                        print(detok.add(t), end="", flush=True)
                if out.finished:
                    final = out
        print(flush=True)
        messages.append({"role": "assistant", "content": final.text})
