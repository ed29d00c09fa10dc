"""One /metrics for the whole deployment: every replica's Prometheus text with a replica label, plus the router."""
from __future__ import annotations

from collections import Counter


def labelled(text: str, replica: str) -> tuple[dict[str, list[str]], list[str]]:
    """(family -> its HELP/TYPE lines, samples with replica="...") of one replica's exposition text."""
    heads: dict[str, list[str]] = {}
    samples = []
    for line in text.splitlines():
        if line.startswith("# "):
            family = line.split()[2]
            heads.setdefault(family, []).append(line)
        elif line:
            name, value = line.rsplit(" ", 1)
            if "{" in name:
                name = name.replace("{", f'{{replica="{replica}",', 1)
            else:
                name = f'{name}{{replica="{replica}"}}'
            samples.append(f"{name} {value}")
    return heads, samples


def merge(replica_texts: dict[str, str], choices: Counter) -> str:
    heads: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in sorted(replica_texts.items()):
        h, s = labelled(text, replica)
        for family, lines in h.items():
            heads.setdefault(family, lines)
        for line in s:
            samples.setdefault(_family(line, heads), []).append(line)
    out: list[str] = []
    for family, lines in heads.items():
        out += lines + samples.get(family, [])
    name = "kvforge_router_decisions_total"
    out += [f"# HELP {name} requests routed, by routing policy and the reason for the replica picked",
            f"# TYPE {name} counter"]
    out += [f'{name}{{policy="{p}",decision="{d}"}} {n}' for (p, d), n in sorted(choices.items())]
    name = "kvforge_replicas"
    out += [f"# HELP {name} replicas reporting to the router", f"# TYPE {name} gauge", f"{name} {len(replica_texts)}"]
    return "\n".join(out) + "\n"


def _family(sample: str, heads: dict) -> str:
    name = sample.split("{", 1)[0]
    for suffix in ("_bucket", "_sum", "_count"):
        if name not in heads and name.endswith(suffix):
            name = name[: -len(suffix)]
    return name
