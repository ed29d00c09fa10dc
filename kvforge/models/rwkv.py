"""RWKV-4 (RwkvForCausalLM; Peng et al. 2023, "RWKV: Reinventing RNNs for the Transformer Era"): time mixing with
the WKV recurrence and channel mixing, no attention and no KV rows. Each layer's state per sequence, in the engine's
state pool: the last input of its time mix and of its channel mix (token shift), and the WKV numerator, denominator
and running maximum. A zeroed slot is the empty state (numerator and denominator 0: the first token's output is its
value, as transformers' -1e38 maximum gives). Inference rescaling as transformers does it: the output and value
weights of layer i divided by 2^(i // rescale_every) at load, the residual stream halved after every rescale_every-th
layer. Parameter names follow Hugging Face (`rwkv.*`, `head`).
"""
from __future__ import annotations

import torch
from torch import nn

from kvforge.attention import AttentionMetadata
from kvforge.kv.pool import KVPool
from kvforge.models.config import ModelConfig


def wkv(decay: torch.Tensor, first: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num: torch.Tensor,
        den: torch.Tensor, top: torch.Tensor, cuts: list[int]) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
    """One sequence's WKV over k, v [T, C] from state (num, den, top) [C], updated in place; copies after `cuts`."""
    out, saved = torch.empty_like(k), {}
    w = -torch.exp(decay)
    for t in range(k.shape[0]):
        kt, vt = k[t], v[t]
        m = torch.maximum(top, kt + first)
        e1, e2 = torch.exp(top - m), torch.exp(kt + first - m)
        out[t] = (e1 * num + e2 * vt) / (e1 * den + e2)
        m = torch.maximum(top + w, kt)
        e1, e2 = torch.exp(top + w - m), torch.exp(kt - m)
        num.mul_(e1).add_(e2 * vt)
        den.mul_(e1).add_(e2)
        top.copy_(m)
        if t + 1 in cuts:
            saved[t + 1] = [num.clone(), den.clone(), top.clone()]
    return out, saved


def shifted(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """x [T, C] moved one token later, `last` (the previous step's final input) first."""
    return torch.cat([last[None], x[:-1]])


class TimeMix(nn.Module):
    def __init__(self, hidden: int, attention_hidden: int):
        super().__init__()
        self.time_decay = nn.Parameter(torch.zeros(attention_hidden))
        self.time_first = nn.Parameter(torch.zeros(attention_hidden))
        self.time_mix_key = nn.Parameter(torch.zeros(1, 1, hidden))
        self.time_mix_value = nn.Parameter(torch.zeros(1, 1, hidden))
        self.time_mix_receptance = nn.Parameter(torch.zeros(1, 1, hidden))
        self.key = nn.Linear(hidden, attention_hidden, bias=False)
        self.value = nn.Linear(hidden, attention_hidden, bias=False)
        self.receptance = nn.Linear(hidden, attention_hidden, bias=False)
        self.output = nn.Linear(attention_hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, prev: torch.Tensor, state: dict[str, torch.Tensor], slot: int,
                cuts: list[int]) -> tuple[torch.Tensor, dict[int, dict[str, torch.Tensor]]]:
        mk, mv, mr = (m.view(-1) for m in (self.time_mix_key, self.time_mix_value, self.time_mix_receptance))
        k = self.key(x * mk + prev * (1 - mk))
        v = self.value(x * mv + prev * (1 - mv))
        r = torch.sigmoid(self.receptance(x * mr + prev * (1 - mr)))
        out, saved = wkv(self.time_decay, self.time_first, k, v, state["num"][slot], state["den"][slot],
                         state["max"][slot], cuts)
        copies = {c: {"att_shift": x[c - 1].clone(), "num": s[0], "den": s[1], "max": s[2]} for c, s in saved.items()}
        state["att_shift"][slot].copy_(x[-1])
        return self.output(r * out), copies


class ChannelMix(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.time_mix_key = nn.Parameter(torch.zeros(1, 1, hidden))
        self.time_mix_receptance = nn.Parameter(torch.zeros(1, 1, hidden))
        self.key = nn.Linear(hidden, intermediate, bias=False)
        self.receptance = nn.Linear(hidden, hidden, bias=False)
        self.value = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        mk, mr = self.time_mix_key.view(-1), self.time_mix_receptance.view(-1)
        k = torch.square(torch.relu(self.key(x * mk + prev * (1 - mk))))
        return torch.sigmoid(self.receptance(x * mr + prev * (1 - mr))) * self.value(k)


class RwkvBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer_idx, eps = layer, cfg.rms_norm_eps
        if layer == 0:
            self.pre_ln = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.attention = TimeMix(cfg.hidden_size, cfg.extra["attention_hidden_size"])
        self.feed_forward = ChannelMix(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        if self.layer_idx == 0:
            x = self.pre_ln(x)
        state = kv.state.layer(self.layer_idx)
        out = torch.empty_like(x)
        for i, (start, n, slot) in enumerate(zip(meta.query_start_loc, meta.query_lens, meta.state_slots)):
            h, cuts = x[start:start + n], meta.state_cuts[i] if meta.state_cuts else []
            a = self.ln1(h)
            mixed, copies = self.attention(a, shifted(a, state["att_shift"][slot]), state, slot, cuts)
            h = h + mixed
            f = self.ln2(h)
            for c in cuts:
                copies[c]["ffn_shift"] = f[c - 1].clone()
                kv.state.capture(i, c, self.layer_idx, copies[c])
            out[start:start + n] = h + self.feed_forward(f, shifted(f, state["ffn_shift"][slot]))
            state["ffn_shift"][slot].copy_(f[-1])
        return out


class RwkvModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(RwkvBlock(cfg, i) for i in range(cfg.num_layers))
        self.ln_out = nn.LayerNorm(cfg.hidden_size)


class RwkvForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.rwkv = RwkvModel(cfg)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.head.weight = self.rwkv.embeddings.weight

    def init_buffers(self) -> None:
        """Inference rescaling (transformers' `_rescale_layers`): applied once, to the loaded weights."""
        every = self.config.extra["rescale_every"]
        if every > 0:
            with torch.no_grad():
                for i, block in enumerate(self.rwkv.blocks):
                    block.attention.output.weight.div_(2 ** (i // every))
                    block.feed_forward.value.weight.div_(2 ** (i // every))

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVPool) -> torch.Tensor:
        every = self.config.extra["rescale_every"]
        x = self.rwkv.embeddings(input_ids)
        for i, block in enumerate(self.rwkv.blocks):
            x = block(x, meta, kv)
            if every > 0 and (i + 1) % every == 0:
                x = x / 2
        return self.rwkv.ln_out(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)  # an Int8Linear / QBlockLinear under weights='int8' / 'q8_0'
