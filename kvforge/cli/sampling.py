"""Sampling options shared by `generate` and `chat`.

A flag the user gives wins; every other field comes from the model's recommended sampling
(generation_config.json, GGUF metadata, or the packaged-model registry), else from an Ollama-like default.
"""
from __future__ import annotations

import argparse

from kvforge.models.recommended_sampling import RecommendedSampling
from kvforge.sampling_params import SamplingParams

OLLAMA_LIKE = RecommendedSampling({"temperature": 0.8, "top_k": 40, "top_p": 0.9},
                                  "kvforge's default for a model that recommends none, as Ollama's")
FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
GROUP_HELP = ("A flag you give wins. Every other field takes the model's recommended sampling: its "
              "generation_config.json (Hugging Face directory), its general.sampling.* metadata (GGUF), or "
              "kvforge's per-model table (the embedded SmolLM2-135M-Instruct: temperature 0.2, top_p 0.9, from its "
              "model card); a model with none gets temperature 0.8, top_k 40, top_p 0.9 (as Ollama). Fields neither "
              "sets are off. The start-up line says which apply.")
_MODEL = "default: the model's recommended, see above"


def add_sampling_options(p: argparse.ArgumentParser, max_tokens: int | None, max_tokens_help: str) -> None:
    g = p.add_argument_group("sampling", GROUP_HELP)
    g.add_argument("--max-tokens", "--n-predict", type=int, default=max_tokens, metavar="N", help=max_tokens_help)
    g.add_argument("--temperature", "--temp", type=float, default=None, metavar="T",
                   help=f"sampling temperature; 0 = greedy ({_MODEL})")
    g.add_argument("--top-p", type=float, default=None, metavar="P", help=f"nucleus sampling; 1 = off ({_MODEL})")
    g.add_argument("--top-k", type=int, default=None, metavar="K",
                   help=f"keep the K most likely tokens; -1 = off ({_MODEL})")
    g.add_argument("--min-p", type=float, default=None, metavar="P",
                   help=f"drop tokens less likely than P times the most likely; 0 = off ({_MODEL})")
    g.add_argument("--seed", type=int, default=None,
                   help="seed for reproducible sampling (default: none, fresh randomness every run)")
    g.add_argument("--presence-penalty", type=float, default=None, metavar="X",
                   help=f"subtract X from tokens already generated (-2..2; {_MODEL}, else 0)")
    g.add_argument("--frequency-penalty", type=float, default=None, metavar="X",
                   help=f"subtract X per earlier occurrence in the output (-2..2; {_MODEL}, else 0)")
    g.add_argument("--repetition-penalty", "--repeat-penalty", type=float, default=None, metavar="X",
                   help=f"scale down tokens of the prompt and output (> 0; 1 = off; {_MODEL}, else 1)")
    g.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop when TEXT is generated (not shown); repeat for several (default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def cli_defaults(llm) -> RecommendedSampling:
    """What fills the sampling fields no flag set: the model's recommendation, else OLLAMA_LIKE."""
    return llm.recommended_sampling or OLLAMA_LIKE


def given(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in FIELDS if getattr(args, name, None) is not None}


def sampling_params(args: argparse.Namespace, max_tokens: int, n: int = 1,
                    defaults: RecommendedSampling = OLLAMA_LIKE) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          **{**defaults.values, **given(args)})


def describe(args: argparse.Namespace, defaults: RecommendedSampling) -> str:
    """'sampling temperature 0.2, top_p 0.9 (source)': the values that apply, and which flags set some."""
    flags = given(args)
    applied = {**defaults.values, **flags}
    shown = ", ".join(f"{k} {v:g}" for k, v in applied.items())
    set_by_flags = f"; set by your flags: {', '.join(flags)}" if flags else ""
    return f"sampling {shown} ({defaults.source}{set_by_flags})"
