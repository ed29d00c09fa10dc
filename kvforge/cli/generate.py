"""kvforge generate: complete one prompt, streamed as text, or printed as JSON with KV cache statistics.

A model with a chat template gets the prompt as a user message (as Ollama and llama.cpp's conversation
mode do); --raw sends the text as it is. The prompt comes from the argument, --prompt, --prompt-file,
or standard input when none is given.
"""
from __future__ import annotations

import argparse
import json
import sys

from kvforge.cli.common import add_engine_options, engine_kwargs
from kvforge.cli.sampling import add_sampling_options, cli_defaults, describe, sampling_params
from kvforge.cli.startup import add_chat_template_option, apply_chat_template, say_loading, startup_line, template_note
from kvforge.errors import ConfigError
from kvforge.version import package_version

MAX_TOKENS = 256


def register(sub) -> None:
    p = sub.add_parser("generate", help="complete one prompt (chat template applied when the model has one)",
                       description=__doc__)
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: --prompt, --prompt-file or stdin)")
    p.add_argument("-p", "--prompt", dest="prompt_option", default=None, metavar="TEXT",
                   help="the prompt, as an option (default: none)")
    p.add_argument("-f", "--prompt-file", default=None, metavar="FILE", help="read the prompt from FILE; - = stdin "
                                                                           "(default: none)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--raw", "--no-chat", dest="raw", action="store_true",
                      help="send the prompt as plain text, without the chat template")
    mode.add_argument("--chat", action="store_true", help="require the chat template (error if the model has none)")
    p.add_argument("--system", default=None, help="system prompt (chat template only; default: none)")
    add_chat_template_option(p)
    p.add_argument("-n", "--n", dest="n", type=int, default=1, help="completions to generate for the prompt")
    p.add_argument("--no-stream", action="store_true", help="print the answer when it is complete, not token by token")
    p.add_argument("--json", action="store_true", help="print JSON: text, token_ids, KV statistics (implies --no-stream)")
    add_sampling_options(p, MAX_TOKENS, "most tokens to generate")
    add_engine_options(p)
    p.set_defaults(func=run)


def read_prompt(args: argparse.Namespace) -> str:
    given = [x for x in (args.prompt, args.prompt_option, args.prompt_file) if x is not None]
    if len(given) > 1:
        raise ConfigError("give the prompt once: as the argument, --prompt or --prompt-file")
    if args.prompt_file not in (None, "-"):
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"cannot read --prompt-file {args.prompt_file!r}: {e.strerror}") from None
    if given and args.prompt_file is None:
        return given[0]
    if args.prompt_file is None and sys.stdin.isatty():
        raise ConfigError('no prompt: give one as an argument (kvforge generate "Why is the sky blue?"), '
                          "with --prompt-file FILE, or on standard input")
    return sys.stdin.read()


def prompt_ids(llm, text: str, args: argparse.Namespace) -> list[int]:
    tok = llm.get_tokenizer()
    if tok is None:
        raise ConfigError("this model has no tokenizer; kvforge generate needs one (use the Python API with token ids)")
    templated = not args.raw and bool(tok.chat_template)
    if args.chat and not tok.chat_template:
        raise ConfigError("--chat: this model has no chat template; leave --chat out to send the text as is")
    if args.system and not templated:
        raise ConfigError("--system needs the chat template; leave out --raw, or put the system text in the prompt")
    if not templated:
        return tok.encode(text)
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": text}]
    return llm.render_chat(messages)


def run(args: argparse.Namespace) -> int:
    from kvforge import LLM

    text = read_prompt(args)
    if not text.strip():
        raise ConfigError("the prompt is empty")
    if args.n < 1:
        raise ConfigError(f"-n must be >= 1, got {args.n}")
    sampling_params(args, args.max_tokens, args.n)  # bad flags fail before the model loads
    say_loading(args.model)
    with LLM(**engine_kwargs(args)) as llm:  # closing keeps the KV cache in KV tiers for the next run
        apply_chat_template(llm.get_tokenizer(), args.chat_template, llm.engine.model_config.eos_token_ids)
        defaults = cli_defaults(llm)
        ids = prompt_ids(llm, text, args)
        templated = not args.raw and bool(llm.get_tokenizer().chat_template)
        print(startup_line(llm, template_note(llm.get_tokenizer(), raw=not templated), describe(args, defaults)),
              file=sys.stderr, flush=True)
        return complete(llm, ids, sampling_params(args, args.max_tokens, args.n, defaults), args)


def complete(llm, ids: list[int], params, args: argparse.Namespace) -> int:
    from kvforge.cli.streaming import stream_request

    if args.json or args.no_stream or args.n > 1:
        outs = llm.generate(ids, params)[0].outputs
        if args.json:
            samples = [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in outs]
            body = {**samples[0], **({"samples": samples} if args.n > 1 else {}), "stats": kv_stats(llm.engine, ids, outs)}
            json.dump(body, sys.stdout, indent=2)
            print()
            return 0
        for i, o in enumerate(outs):
            if len(outs) > 1:
                print(f"--- sample {i + 1} of {len(outs)} ---")
            print(o.text)
    else:
        streamed = stream_request(llm.engine, ids, params)
        print(flush=True)
        if streamed.interrupted:
            print("[interrupted]", file=sys.stderr)
            return 130
        outs = streamed.output.outputs
    print(summary(kv_stats(llm.engine, ids, outs)), file=sys.stderr)
    return 0


def kv_stats(engine, ids: list[int], outs) -> dict:
    s = engine.stats()
    return {
        "kv_blocks_total": s["kv_blocks_total"],
        "kv_blocks_used_peak": s["kv_blocks_used_peak"],
        "kv_blocks_used_now": s["kv_blocks_used"],
        "kv_block_size": s["kv_block_size"],
        "kv_bytes_per_token": engine.kv.block_bytes / engine.kv.block_size,
        "kv_bytes_peak": s["kv_blocks_used_peak"] * engine.kv.block_bytes,
        "kv_bytes_total": s["kv_bytes_total"],
        "kv_cache_dtype": s["kv_cache_dtype"],
        **{k: s[k] for k in ("kv_budget_bytes", "kv_block_bytes_total", "kv_staging_bytes", "kv_staging_sequences",
                             "kv_state_slot_bytes", "kv_state_checkpoint_bytes", "kv_other_bytes", "max_num_seqs", "max_num_seqs_asked")},
        "prompt_tokens": len(ids),
        "generated_tokens": sum(len(o.token_ids) for o in outs),
        "finish_reason": outs[0].finish_reason,
        **{k: v for k, v in s.items() if k.startswith(("spec_", "tier_", "kv_tiers", "swap", "compressed_prefix", "kv_compactions"))},
        "kvforge_version": package_version(),
    }


def summary(st: dict) -> str:
    return (f"[kv cache] {st['kv_cache_dtype']}, {st['kv_bytes_per_token']:.0f} bytes/token, peak "
            f"{st['kv_blocks_used_peak']}/{st['kv_blocks_total']} blocks of {st['kv_block_size']} tokens = "
            f"{st['kv_bytes_peak'] / 2**20:.2f} MiB of {st['kv_bytes_total'] / 2**20:.0f} MiB; {st['prompt_tokens']} prompt + "
            f"{st['generated_tokens']} generated tokens, finish: {st['finish_reason']}")
