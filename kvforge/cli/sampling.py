"""Sampling options shared by `generate` and `chat`; their defaults are SamplingParams' own."""
from __future__ import annotations

import argparse

from kvforge.sampling_params import SamplingParams

DEFAULTS = SamplingParams()


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int | None, max_tokens_help: str) -> None:
    g = p.add_argument_group("sampling (defaults as in SamplingParams and the server)")
    g.add_argument("--max-tokens", "--n-predict", type=int, default=max_tokens, metavar="N", help=max_tokens_help)
    g.add_argument("--temperature", "--temp", type=float, default=DEFAULTS.temperature, metavar="T",
                   help="sampling temperature; 0 = greedy")
    g.add_argument("--top-p", type=float, default=DEFAULTS.top_p, metavar="P", help="nucleus sampling; 1 = off")
    g.add_argument("--top-k", type=int, default=DEFAULTS.top_k, metavar="K", help="keep the K most likely tokens; -1 = off")
    g.add_argument("--seed", type=int, default=None,
                   help="seed for reproducible sampling (default: none, fresh randomness every run)")
    g.add_argument("--presence-penalty", type=float, default=DEFAULTS.presence_penalty, metavar="X",
                   help="subtract X from tokens already generated (-2..2)")
    g.add_argument("--frequency-penalty", type=float, default=DEFAULTS.frequency_penalty, metavar="X",
                   help="subtract X per earlier occurrence in the output (-2..2)")
    g.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=DEFAULTS.repetition_penalty,
                   metavar="X", help="scale down tokens of the prompt and output (> 0; 1 = off)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when TEXT is generated (not shown); repeat for several (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def sampling_params(args: argparse.Namespace, max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=max_tokens,
                          seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          repetition_penalty=args.repetition_penalty)
