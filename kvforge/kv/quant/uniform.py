"""Asymmetric uniform b-bit quantization in groups, per token (along dim) or per channel (along a block's tokens).

x ~= zero + code * scale with zero = min and scale = (max - min) / (2**bits - 1) over each group;
codes are bit-packed, scale and zero are fp16. Optional dense-and-sparse outliers (KVQuant,
Hooper et al. 2024): per block the `outlier_frac` values farthest from their group mean are kept
in fp16 (with their flat index) and excluded from the group's range.
With `param_bits=8` the scale is stored as a uint8 code on a log2 grid (9 steps per octave, rounded
up so the group's range stays covered; steps grow by at most 8%). Per-channel zeros are uint8 codes
too, rounded down on a linear grid spanning the block's zeros of that head (the grid's two ends are
fp16): 2 bytes per group instead of 4. Per-token zeros stay fp16 (one group per row has no grid to share).
"""
from __future__ import annotations

import math

import torch

from kvforge.kv.layer_format import RawSide
from kvforge.kv.quant.codec import Codec, Layout
from kvforge.kv.quant.library import define
from kvforge.kv.quant.packing import byte_table, pack, unpack

PARAM_DTYPE = torch.float16
MIN_SCALE = 1e-6
LOG_MIN, LOG_STEPS = -18.0, 9.0  # 8-bit scales: 2**-18 .. 2**10.3


def index_dtype(block_values: int) -> torch.dtype:
    """Outlier indices (flat, within a block) as int16 where they fit."""
    return torch.int16 if block_values <= 2**15 else torch.int32


def head_major(flat: torch.Tensor, block_size: int, heads: int, dim: int) -> torch.Tensor:
    """Flat indices into [block_size, heads, dim] as positions in [heads, block_size, dim]: outliers are stored in
    this order (head, then row, then channel), the order attention reads them in."""
    rh, c = flat // dim, flat % dim
    return ((rh % heads) * block_size + rh // heads) * dim + c


class UniformCodec(Codec):
    def __init__(self, bits: int, axis: str, group_size: int = 32, outlier_frac: float = 0.0, param_bits: int = 16):
        self.bits, self.axis, self.group_size, self.outlier_frac = bits, axis, group_size, outlier_frac
        self.param_bits = param_bits
        self.levels = (1 << bits) - 1
        self.per_token = axis == "token" and outlier_frac == 0.0

    def num_outliers(self, block_size: int, heads: int, dim: int) -> int:
        return math.ceil(self.outlier_frac * block_size * heads * dim) if self.outlier_frac > 0 else 0

    def layout(self, block_size: int, heads: int, dim: int) -> Layout:
        codes = ((block_size, heads, dim * self.bits // 8), torch.uint8)
        if self.axis == "token":
            param = (block_size, heads, dim // self.group_size)
        else:
            param = (heads, dim)
        if self.param_bits == 16:
            parts = [codes, (param, PARAM_DTYPE), (param, PARAM_DTYPE)]
        elif self.axis == "token":
            parts = [codes, (param, torch.uint8), (param, PARAM_DTYPE)]
        else:
            parts = [codes, (param, torch.uint8), (param, torch.uint8), ((heads, 2), PARAM_DTYPE)]
        n_out = self.num_outliers(block_size, heads, dim)
        if n_out:
            parts += [((n_out,), index_dtype(block_size * heads * dim)), ((n_out,), PARAM_DTYPE)]
        return parts

    def head_axes(self) -> list[int] | None:
        if self.outlier_frac > 0:
            return None
        return [1] + [1 if self.axis == "token" else 0] * self.num_params  # codes [rows, heads, ...]

    def _groups(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A view whose axis `red` runs over one group's members."""
        if self.axis == "token":
            return x.unflatten(-1, (x.shape[-1] // self.group_size, self.group_size)), -1
        return x, 1

    def _outliers(self, x: torch.Tensor, n_out: int) -> tuple[torch.Tensor, torch.Tensor]:
        g, red = self._groups(x)
        score = (g - g.mean(red, keepdim=True)).abs().reshape(x.shape[0], -1)
        index = score.topk(n_out, dim=1).indices
        index = index.gather(1, head_major(index, *x.shape[1:]).argsort(1))
        mask = torch.zeros_like(score, dtype=torch.bool).scatter_(1, index, True).view(x.shape)
        return index, mask

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[blocks, block_size, heads, dim] -> the parts of layout(), through kvforge::uniform_encode."""
        table = self._scale_table(x.device) if self.param_bits == 8 else None
        return list(uniform_encode(x.float(), self.bits, self.axis == "channel", self.group_size,
                                   self.num_outliers(*x.shape[1:]), self.param_bits, table))

    def encode_reference(self, x: torch.Tensor, n_out: int) -> list[torch.Tensor]:
        x = x.float()
        index, mask = self._outliers(x, n_out) if n_out else (None, None)
        lo_src = x if mask is None else x.masked_fill(mask, float("inf"))
        hi_src = x if mask is None else x.masked_fill(mask, float("-inf"))
        lo_g, red = self._groups(lo_src)
        lo = lo_g.amin(red, keepdim=True)
        hi = self._groups(hi_src)[0].amax(red, keepdim=True)
        lo, hi = lo.nan_to_num(0.0, 0.0, 0.0), hi.nan_to_num(0.0, 0.0, 0.0)
        zero_parts = self._encode_zero(lo.squeeze(red))
        zero = self._decode_zero(zero_parts).unsqueeze(red)
        scale_part = self._encode_scale((hi - zero) / self.levels).squeeze(red)
        scale = self._decode_scale(scale_part).unsqueeze(red)
        q = ((self._groups(x)[0] - zero) / scale).round_().clamp_(0, self.levels).view(x.shape)
        parts = [pack(q, self.bits), scale_part] + zero_parts
        if n_out:
            values = x.reshape(x.shape[0], -1).gather(1, index)
            parts += [index.to(index_dtype(x[0].numel())), values.to(PARAM_DTYPE)]
        return parts

    @property
    def coded_zero(self) -> bool:
        return self.param_bits == 8 and self.axis == "channel"

    def _encode_zero(self, lo: torch.Tensor) -> list[torch.Tensor]:
        """Zero parts from each group's minimum; the decoded zero never exceeds it by more than fp16 rounding."""
        if not self.coded_zero:
            return [lo.to(PARAM_DTYPE)]
        ends = torch.stack([lo.amin(-1), lo.amax(-1)], -1).to(PARAM_DTYPE)  # [n, heads, 2]
        base, step = self._zero_grid(ends)
        code = ((lo - base) / step).floor_().clamp_(0, 255)
        return [code.to(torch.uint8), ends]

    @staticmethod
    def _zero_grid(ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ends = ends.float()
        base = ends[..., :1]
        return base, ((ends[..., 1:] - base) / 255).clamp_min(MIN_SCALE)

    def _decode_zero(self, zero_parts: list[torch.Tensor]) -> torch.Tensor:
        if not self.coded_zero:
            return zero_parts[0].float()
        base, step = self._zero_grid(zero_parts[1])
        return base + zero_parts[0].float() * step

    @property
    def num_params(self) -> int:
        return 3 if self.coded_zero else 2

    def _encode_scale(self, scale: torch.Tensor) -> torch.Tensor:
        if self.param_bits == 8:  # log2 grid, rounded up so the group's range stays covered
            return ((scale.clamp_min(2.0 ** LOG_MIN).log2() - LOG_MIN) * LOG_STEPS).ceil_().clamp_(0, 255).to(torch.uint8)
        return scale.clamp_min(MIN_SCALE).to(PARAM_DTYPE)

    def _scale_table(self, device: torch.device) -> torch.Tensor:
        """The 256 decoded 8-bit scales."""
        return byte_table(("scale", 8), device, self._decode_scale)

    def _decode_scale(self, part: torch.Tensor) -> torch.Tensor:
        if self.param_bits == 8:
            return torch.exp2(part.float() / LOG_STEPS + LOG_MIN)
        return part.float()

    def _scale_zero(self, params: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 scale and zero per group from the stored parameter parts."""
        return self._decode_scale(params[0]), self._decode_zero(params[1:])

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        q = unpack(parts[0], self.bits)
        scale, zero = self._scale_zero(parts[1: 1 + self.num_params])
        g, red = self._groups(q)
        x = (g * scale.unsqueeze(red) + zero.unsqueeze(red)).view(q.shape)
        if len(parts) > 1 + self.num_params:
            x.view(x.shape[0], -1).scatter_(1, parts[-2].long(), parts[-1].float())
        return x

    def raw_side(self, parts: list[torch.Tensor]) -> RawSide:
        """[codes, scale, zero, ends, outlier index, outlier value, scale table], absent parts empty."""
        empty = parts[0].new_empty(0)
        params = parts[1: 1 + self.num_params]
        ends = params[2] if self.coded_zero else empty
        outliers = parts[1 + self.num_params:] or [empty, empty]
        table = self._scale_table(parts[0].device) if self.param_bits == 8 else empty
        return RawSide(f"uniform_{self.axis}", [parts[0], params[0], params[1], ends, *outliers, table],
                       self.bits, self.group_size)


def encode_reference(x: torch.Tensor, bits: int, per_channel: bool, group_size: int, num_outliers: int,
                     param_bits: int, scale_table: torch.Tensor | None) -> list[torch.Tensor]:
    """kvforge::uniform_encode in torch (scale_table, the decoded 8-bit scales, is what _decode_scale computes)."""
    codec = UniformCodec(bits, "channel" if per_channel else "token", group_size, param_bits=param_bits)
    return codec.encode_reference(x, num_outliers)


uniform_encode = define(
    "uniform_encode", "uniform_encode(Tensor x, int bits, bool per_channel, int group_size, int num_outliers, "
    "int param_bits, Tensor? scale_table) -> Tensor[]", encode_reference)
