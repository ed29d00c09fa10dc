"""Per-head roles (DuoAttention's split): retrieval heads, streaming heads and the rest, from a calibration file.

`kvforge calibrate heads --model M` scores every (full-attention layer, KV head) of a model by how much attention it
puts on the token it copies from a generated context (kvforge.eval.head_calibration) and stores the scores as JSON
in the user cache, keyed by the model file's identity (`heads_path`). A policy's `heads` option ("auto": that file
for the engine's model; or a path) turns the scores into roles: the `retrieval_heads` share with the highest scores
and the `streaming_heads` share with the lowest. In the engine every head of a layer keeps the same number of rows
(one block table per sequence), so roles decide how a head spends its rows: a streaming head keeps `sinks` + its
newest rows, whatever the policy's scores say; a retrieval head keeps the policy's highest-scoring rows with no
recent window (its `recent` set to 0; it keeps everything only where the budget reaches the whole sequence, since
DuoAttention's memory split needs a block table per head); the rest keep the policy's choice.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kvforge.errors import ConfigError

FORMAT = 1
STREAMING_SINKS = 4


def model_identity(path: str) -> str:
    """A stable id of a model file (or Hugging Face directory): its size and the hash of its first and last MiB
    (of config.json and every weight file of a directory), so a renamed copy has the same id and a changed file not."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.iterdir()
                                           if f.name == "config.json" or f.suffix in (".safetensors", ".bin", ".gguf"))
    if not files:
        raise ConfigError(f"heads: {path!r} is neither a model file nor a directory with config.json and weights")
    h = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name if p.is_dir() else ''}:{size}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:32]


def heads_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvforge" / "heads"


def heads_path(model_path: str) -> Path:
    """Where `kvforge calibrate heads` stores the calibration of this model file."""
    return heads_dir() / f"{model_identity(model_path)}.json"


@dataclass(frozen=True)
class HeadScores:
    """scores[l][h]: the retrieval score of full-attention layer l's KV head h (higher: more retrieval-like)."""

    scores: torch.Tensor  # [layers, kv heads]
    method: str
    model: str  # model_identity of the file it was measured on
    detail: dict

    def to_json(self) -> dict:
        return {"format": FORMAT, "method": self.method, "model": self.model, "detail": self.detail,
                "scores": [[round(float(s), 6) for s in row] for row in self.scores]}

    def save(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)  # a reader never sees half a file
        return path

    @classmethod
    def load(cls, path: str | Path) -> HeadScores:
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            return cls(torch.tensor(data["scores"], dtype=torch.float32), data["method"], data["model"], data["detail"])
        except FileNotFoundError:
            raise ConfigError(f"heads: no calibration at {path}; run `kvforge calibrate heads --model M` first") from None
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"heads: {path} is not a head calibration ({e})") from None

    def roles(self, retrieval: float, streaming: float) -> HeadRoles:
        flat = self.scores.flatten()
        n = flat.numel()
        order = torch.argsort(flat, descending=True, stable=True)
        role = torch.zeros(n, dtype=torch.int8)  # 0 other, 1 retrieval, 2 streaming
        r = round(retrieval * n)
        s = min(round(streaming * n), n - r)
        role[order[:r]] = 1
        if s:
            role[order[n - s:]] = 2
        return HeadRoles(role.view(self.scores.shape))


@dataclass(frozen=True)
class HeadRoles:
    role: torch.Tensor  # [layers, kv heads] int8: 0 other, 1 retrieval, 2 streaming

    @property
    def retrieval(self) -> torch.Tensor:
        return self.role == 1

    @property
    def streaming(self) -> torch.Tensor:
        return self.role == 2

    def apply(self, keep: torch.Tensor, length: int, by_score: torch.Tensor | None = None,
              sinks: int = STREAMING_SINKS) -> torch.Tensor:
        """The policy's kept indices ([m], or [layers, heads or 1, m]) as [layers, heads, m]: retrieval heads' rows
        from `by_score` (the policy's choice without its recent window, same shapes) when given, streaming heads'
        their first `sinks` and newest m - sinks cache indices."""
        layers, heads = self.role.shape
        m = keep.shape[-1]
        keep = _per_head(keep, layers, heads)
        if by_score is not None:
            keep[self.retrieval] = _per_head(by_score, layers, heads)[self.retrieval]
        s = min(sinks, m)
        stream = torch.cat([torch.arange(s), torch.arange(length - (m - s), length)])
        keep[self.streaming] = stream
        return keep


def _per_head(keep: torch.Tensor, layers: int, heads: int) -> torch.Tensor:
    m = keep.shape[-1]
    return keep.reshape(-1, keep.shape[-2] if keep.dim() > 1 else 1, m).expand(layers, heads, m).clone()


def check_heads_option(policy_name: str, heads, retrieval: float, streaming: float) -> None:
    if heads is not None and not isinstance(heads, str):
        raise ConfigError(f"{policy_name}: heads must be 'auto' (the calibration stored for the engine's model) or "
                          f"the path of a `kvforge calibrate heads` file, got {heads!r}")
    for name, share in (("retrieval_heads", retrieval), ("streaming_heads", streaming)):
        if not isinstance(share, (int, float)) or not 0 <= share <= 1:
            raise ConfigError(f"{policy_name}: {name} must be a share of the heads in [0, 1], got {share!r}")
    if retrieval + streaming > 1:
        raise ConfigError(f"{policy_name}: retrieval_heads + streaming_heads must be at most 1, got "
                          f"{retrieval} + {streaming}")


def load_roles(heads: str, model_path: str | None, retrieval: float, streaming: float,
               layers: int, kv_heads: int) -> HeadRoles:
    """The roles of option `heads` ("auto" or a path), checked against the model's full-attention layers and heads."""
    if heads == "auto":
        if model_path is None:
            raise ConfigError("heads 'auto' needs the engine's model file; pass the calibration's path instead")
        path = heads_path(model_path)
    else:
        path = Path(heads)
    scores = HeadScores.load(path)
    if tuple(scores.scores.shape) != (layers, kv_heads):
        raise ConfigError(f"heads: {path} holds {tuple(scores.scores.shape)} (layers, KV heads), this model has "
                          f"({layers}, {kv_heads}) full-attention layers and KV heads; calibrate this model")
    return scores.roles(retrieval, streaming)
