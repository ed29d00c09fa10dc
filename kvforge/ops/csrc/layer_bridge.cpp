// kvforge::layer_bridge: a decoder's work between two attentions, for the few rows of a decode step, in one
// call and one parallel region: o_proj, residual add + norm, gate/up, act(gate) * up, down, residual add + the next
// layer's input norm, its fused q/k/v projection and RoPE on q and k (or, after the last layer, the final norm).
// The family's layer math is a parameter (Family): Llama's plain shape, or Gemma's norms of the attention and MLP
// outputs before their residual adds, RMSNorm of each q and k head before RoPE (also Qwen3's) and GELU-tanh.
// The threads split each matmul's output rows and meet at a barrier between phases, where the per-op path crossed
// Python and forked the threads five times a layer. Each value is computed by the same row functions as the
// per-op kernels (rows.h, small_matmul.h, int8_matmul.h), so the two paths give the same floats. Steps of tens of
// rows (batched decode, speculative verification) pass the weights as panels and take panel_matmul.h's tiles, as
// the per-op path does at those row counts.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <string>

#include "int8_matmul.h"
#include "panel_matmul.h"
#include "qblock_matmul.h"
#include "rows.h"
#include "small_matmul.h"

namespace kvforge {
namespace {

#if defined(__AVX512F__)
// A linear layer's weight: fp32 [N, K], fp32 panels [N / 16, K, 16] (ops/panels.py, for steps of more rows), or
// (int8 weights) packed int8 as ops/int8.py's pack with one scale per row, or GGUF blocks (uint8 [N, K / 32 * block
// bytes], ops/qblocks.py) with their ggml type as the int64 "scale".
struct Linear {
  const float* w = nullptr;
  const float* panels = nullptr;
  const int8_t* q = nullptr;
  const uint8_t* blocks = nullptr;
  int64_t qtype = 0;
  const float* scale = nullptr;
  const float* bias = nullptr;
  int64_t N = 0, K = 0;
};

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

Linear linear_of(const at::Tensor& w, const at::Tensor& scale, const at::Tensor& bias, int64_t K, const char* name) {
  Linear lin;
  lin.K = K;
  TORCH_CHECK(w.is_contiguous(), "layer_bridge: ", name, " weight must be contiguous");
  if (w.scalar_type() == at::kByte) {
#if KVFORGE_INT8_VNNI
    TORCH_CHECK(scale.scalar_type() == at::kLong && scale.numel() == 1 && is_qblock_type(scale.item<int64_t>()) &&
                    w.dim() == 2 && K % qblock_values(scale.item<int64_t>()) == 0 &&
                    w.size(1) == K / qblock_values(scale.item<int64_t>()) * qblock_bytes(scale.item<int64_t>()),
                "layer_bridge: ", name, " GGUF block weight must be uint8 [N, K / block values * block bytes] with its ggml type");
    lin.N = w.size(0);
    lin.qtype = scale.item<int64_t>();
    lin.blocks = w.data_ptr<uint8_t>();
#else
    TORCH_CHECK(false, "layer_bridge: GGUF block weights need AVX-512 VNNI");
#endif
  } else if (scale.numel()) {
#if KVFORGE_INT8_VNNI
    lin.N = scale.numel();
    TORCH_CHECK(w.scalar_type() == at::kChar && w.dim() == 4 && w.size(0) == (lin.N + kTile - 1) / kTile &&
                    w.size(1) == (K + 63) / 64 && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
                "layer_bridge: ", name, " int8 weight must be packed [ceil(N / 4), ceil(K / 64), 4, 64] with N scales");
    lin.q = w.data_ptr<int8_t>();
    lin.scale = scale.data_ptr<float>();
#else
    TORCH_CHECK(false, "layer_bridge: int8 weights need AVX-512 VNNI");
#endif
  } else if (w.dim() == 3) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.size(1) == K && w.size(2) == kPanel,
                "layer_bridge: ", name, " panels must be fp32 [N / 16, ", K, ", 16]");
    lin.N = w.size(0) * kPanel;
    lin.panels = w.data_ptr<float>();
  } else {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(1) == K,
                "layer_bridge: ", name, " weight must be fp32 [N, ", K, "] or panels [N / 16, ", K, ", 16]");
    lin.N = w.size(0);
    lin.w = w.data_ptr<float>();
  }
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == lin.N && bias.is_contiguous()),
              "layer_bridge: ", name, " bias must be empty or one value per output");
  lin.bias = data_or_null(bias);
  return lin;
}

const float* norm_of(const at::Tensor& w, int64_t hidden, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == hidden,
              "layer_bridge: ", name, " weight must be contiguous fp32 with ", hidden, " elements");
  return w.data_ptr<float>();
}

// The layer math a family adds to Llama's (each part absent: null / false).
struct Family {
  const float* post_attn = nullptr;  // RMSNorm weight of o_proj's output, before its residual add [hidden]
  const float* post_mlp = nullptr;   // and of down's output [hidden]
  const float* q_norm = nullptr;     // RMSNorm weight of each q head, then of each k head, before RoPE [dim]
  const float* k_norm = nullptr;
  bool gelu = false;                 // gelu_tanh(gate) * up instead of silu(gate) * up
};

const float* optional_norm(const at::Tensor& w, int64_t n, const char* name) {
  return w.numel() ? norm_of(w, n, name) : nullptr;
}

Family family_of(const c10::optional<std::vector<at::Tensor>>& norms, c10::string_view activation, bool attn,
                 bool last, int64_t hidden, int64_t D) {
  Family f;
  TORCH_CHECK(activation == "silu" || activation == "gelu_tanh",
              "layer_bridge: activation must be 'silu' or 'gelu_tanh', got '", std::string(activation), "'");
  f.gelu = activation == "gelu_tanh";
  if (!norms.has_value() || norms->empty()) return f;
  const auto& n = *norms;
  TORCH_CHECK(n.size() == 4, "layer_bridge: family_norms is [post_attention, post_feedforward, q_norm, k_norm] "
                             "(an empty tensor for each one the family lacks) or empty");
  if (attn) {
    f.post_attn = optional_norm(n[0], hidden, "post-attention output norm");
    f.post_mlp = optional_norm(n[1], hidden, "post-feedforward output norm");
  }
  if (!last) {
    f.q_norm = optional_norm(n[2], D, "q head norm");
    f.k_norm = optional_norm(n[3], D, "k head norm");
  }
  return f;
}

// This thread's share [lo, hi) of n units.
inline void share(int64_t n, int tid, int nt, int64_t* lo, int64_t* hi) {
  *lo = n * tid / nt;
  *hi = n * (tid + 1) / nt;
}

// Columns col + [r0, r1) of y [M, stride] = x [M, K] @ W rows col + [r0, r1) + bias; r0, r1 on unit_of boundaries
// or at the end of the weight (panels: stride == N).
void rows_of(const Linear& lin, const float* x, const BlockRows* xq, int64_t M, float* y, int64_t stride,
             int64_t col, int64_t r0, int64_t r1) {
  if (r0 >= r1) return;
  if (lin.panels) {
    panel_range(x, lin.panels, nullptr, y, M, lin.K, stride, (col + r0) / kPanel, (col + r1 + kPanel - 1) / kPanel);
  } else if (lin.w) {
    linear_rows(x, lin.w + col * lin.K, y + col, M, lin.K, stride, r0, r1);
  } else {
#if KVFORGE_INT8_VNNI
    if (lin.blocks) qblock_rows(*xq, lin.blocks, lin.qtype, y, stride, M, lin.K, col + r0, col + r1);
    else tiles(xq->xq, lin.q, lin.scale, y, stride, M, (col + r0) / kTile, (col + r1 + kTile - 1) / kTile);
#endif
  }
  if (lin.bias)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t r = r0; r < r1; ++r) y[m * stride + col + r] += lin.bias[col + r];
}

int64_t unit_of(const Linear& lin) { return lin.panels ? kPanel * kPanelsPerTile : lin.w ? kLinearUnit : kTile; }

// This thread's unit-aligned share of `rows` output rows.
void row_share(const Linear& lin, int64_t rows, int tid, int nt, int64_t* r0, int64_t* r1) {
  const int64_t unit = unit_of(lin);
  int64_t u0, u1;
  share((rows + unit - 1) / unit, tid, nt, &u0, &u1);
  *r0 = std::min(rows, u0 * unit);
  *r1 = std::min(rows, u1 * unit);
}

BlockRows quantized(const Linear& lin, const float* x, int64_t M) {
#if KVFORGE_INT8_VNNI
  if (lin.blocks) return quantize_block_rows(x, M, lin.K, lin.qtype);
  if (lin.q) return {quantize_rows(x, M, lin.K), {}};
  return {};
#else
  return {};
#endif
}

// y = x @ W^T + b, this thread's share of the rows.
void linear_share(const Linear& lin, const float* x, int64_t M, float* y, int tid, int nt) {
  int64_t r0, r1;
  row_share(lin, lin.N, tid, nt, &r0, &r1);
  const BlockRows xq = quantized(lin, x, M);
  rows_of(lin, x, &xq, M, y, lin.N, 0, r0, r1);
}

// The next layer's new K and V rows into a plain cache (fp32, fp16 or bf16 [blocks, block_size, kv_heads, dim]) at
// their slots, converted as Tensor.to would (round to nearest even).
struct CacheWrite {
  at::Tensor k, v;
  const int64_t* slots = nullptr;
  bool active() const { return slots != nullptr; }
};

CacheWrite cache_write_of(const std::vector<at::Tensor>& parts, int64_t M, int64_t kv_heads, int64_t D) {
  CacheWrite out;
  if (parts.empty()) return out;
  TORCH_CHECK(parts.size() == 3, "layer_bridge: kv_write is [k_cache, v_cache, slots] or empty");
  out.k = parts[0];
  out.v = parts[1];
  const auto dtype = out.k.scalar_type();
  TORCH_CHECK(out.k.is_contiguous() && out.v.is_contiguous() && out.k.sizes() == out.v.sizes() &&
                  out.k.dim() == 4 && out.k.size(2) == kv_heads && out.k.size(3) == D && out.v.scalar_type() == dtype &&
                  (dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16),
              "layer_bridge: caches must be contiguous fp32/fp16/bf16 [blocks, block_size, kv_heads, dim], alike");
  TORCH_CHECK(parts[2].scalar_type() == at::kLong && parts[2].is_contiguous() && parts[2].numel() == M,
              "layer_bridge: one int64 slot per row");
  out.slots = parts[2].data_ptr<int64_t>();
  const int64_t rows = out.k.size(0) * out.k.size(1);
  for (int64_t m = 0; m < M; ++m)
    TORCH_CHECK(out.slots[m] >= 0 && out.slots[m] < rows, "layer_bridge: slot ", out.slots[m], " outside the cache");
  return out;
}

void write_row(const at::Tensor& cache, int64_t row, const float* src, int64_t D) {
  switch (cache.scalar_type()) {
    case at::kHalf: return put_row(src, cache.data_ptr<c10::Half>() + row * D, D);
    case at::kBFloat16: return put_row(src, cache.data_ptr<c10::BFloat16>() + row * D, D);
    default: std::copy_n(src, D, cache.data_ptr<float>() + row * D);
  }
}

at::Tensor layer_bridge_cpu(const c10::optional<at::Tensor>& attn_in, at::Tensor residual, const at::Tensor& cos,
                            const at::Tensor& sin, std::vector<at::Tensor> post, std::vector<at::Tensor> pre,
                            int64_t heads, int64_t kv_heads, double eps_in, std::vector<at::Tensor> kv_write,
                            const c10::optional<std::vector<at::Tensor>>& family_norms, c10::string_view activation) {
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.dim() == 2 && residual.is_contiguous(),
              "layer_bridge: residual must be contiguous fp32 [T, hidden]");
  const int64_t M = residual.size(0), hidden = residual.size(1);
  const float eps = static_cast<float>(eps_in);
  const bool attn = attn_in.has_value() && attn_in->defined();
  TORCH_CHECK(attn == (post.size() == 8) && (attn || post.empty()),
              "layer_bridge: attention output and post weights [o_w, o_scale, o_bias, norm_w, gate_up_w, "
              "gate_up_scale, down_w, down_scale] come together");
  TORCH_CHECK(pre.size() == 4 || pre.size() == 1,
              "layer_bridge: pre is [norm_w, qkv_w, qkv_scale, qkv_bias] or the final [norm_w]");
  at::Tensor a;
  Linear o, gate_up, down;
  const float* ln2 = nullptr;
  int64_t inter = 0;
  if (attn) {
    a = attn_in->contiguous();
    TORCH_CHECK(a.scalar_type() == at::kFloat && a.dim() == 2 && a.size(0) == M,
                "layer_bridge: attention output must be fp32 [T, heads * dim]");
    o = linear_of(post[0], post[1], post[2], a.size(1), "o_proj");
    TORCH_CHECK(o.N == hidden, "layer_bridge: o_proj must give hidden outputs");
    ln2 = norm_of(post[3], hidden, "post-attention norm");
    gate_up = linear_of(post[4], post[5], at::Tensor(), hidden, "gate_up");
    inter = gate_up.N / 2;
    down = linear_of(post[6], post[7], at::Tensor(), inter, "down");
    TORCH_CHECK(gate_up.N == 2 * inter && down.N == hidden && (gate_up.w || inter % kTile == 0) &&
                    (!gate_up.panels || inter % kPanel == 0),
                "layer_bridge: gate_up must be [2 * inter, hidden] and down [hidden, inter], inter a multiple of 4 "
                "for int8 weights and of 16 for panels");
  }
  const float* ln1 = norm_of(pre[0], hidden, "input (or final) norm");
  const bool last = pre.size() == 1;
  Linear qkv;
  const int64_t D = cos.size(-1);
  if (!last) {
    qkv = linear_of(pre[1], pre[2], pre[3], hidden, "qkv");
    TORCH_CHECK(qkv.N == (heads + 2 * kv_heads) * D && cos.sizes() == sin.sizes() && cos.size(0) == M &&
                    cos.is_contiguous() && sin.is_contiguous() && D % 2 == 0 && D <= 1024,
                "layer_bridge: qkv must give (heads + 2 * kv_heads) * dim outputs, cos/sin [T, dim]");
  }
  const CacheWrite cache = last ? CacheWrite() : cache_write_of(kv_write, M, kv_heads, D);
  const Family fam = family_of(family_norms, activation, attn, last, hidden, D);
  at::Tensor out = at::empty({M, last ? hidden : qkv.N}, residual.options());
  at::Tensor scratch = at::empty({M * (3 * hidden + 3 * inter)}, residual.options());
  float* res = residual.data_ptr<float>();
  float *h = scratch.data_ptr<float>(), *o_out = h + M * hidden, *d_out = o_out + M * hidden;
  float *gu = d_out + M * hidden, *act = gu + 2 * M * inter, *y = out.data_ptr<float>();
  const float* ap = attn ? a.data_ptr<float>() : nullptr;
  const float *cp = last ? nullptr : cos.data_ptr<float>(), *sp = last ? nullptr : sin.data_ptr<float>();
  const int nt = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    if (attn) {
      linear_share(o, ap, M, o_out, tid, team);
#pragma omp barrier
      if (tid == 0)
        for (int64_t m = 0; m < M; ++m) {
          float* o_row = o_out + m * hidden;
          if (fam.post_attn) rms_norm_row(o_row, fam.post_attn, o_row, hidden, eps);
          add_rms_norm_row(res + m * hidden, o_row, ln2, h + m * hidden, hidden, eps);
        }
#pragma omp barrier
      int64_t r0, r1;  // gate rows [r0, r1) and the same up rows, then act(gate) * up of them
      row_share(gate_up, inter, tid, team, &r0, &r1);
      const BlockRows hq = quantized(gate_up, h, M);
      rows_of(gate_up, h, &hq, M, gu, 2 * inter, 0, r0, r1);
      rows_of(gate_up, h, &hq, M, gu, 2 * inter, inter, r0, r1);
      const auto gated = fam.gelu ? gelu_tanh_mul_row : silu_mul_row;
      for (int64_t m = 0; m < M && r0 < r1; ++m)
        gated(gu + m * 2 * inter + r0, gu + m * 2 * inter + inter + r0, act + m * inter + r0, r1 - r0);
#pragma omp barrier
      linear_share(down, act, M, d_out, tid, team);
#pragma omp barrier
    }
    float* normed = last ? y : h;
    if (tid == 0)
      for (int64_t m = 0; m < M; ++m) {
        float* d_row = d_out + m * hidden;
        if (attn && fam.post_mlp) rms_norm_row(d_row, fam.post_mlp, d_row, hidden, eps);
        if (attn) add_rms_norm_row(res + m * hidden, d_row, ln1, normed + m * hidden, hidden, eps);
        else rms_norm_row(res + m * hidden, ln1, normed + m * hidden, hidden, eps);
      }
    if (!last) {
#pragma omp barrier
      linear_share(qkv, h, M, y, tid, team);
#pragma omp barrier
      const int64_t per_row = heads + (cache.active() ? 2 : 1) * kv_heads;  // q and k rotated, k and v written
      int64_t t0, t1;
      share(M * per_row, tid, team, &t0, &t1);
      float lo[512];
      for (int64_t task = t0; task < t1; ++task) {
        const int64_t m = task / per_row, head = task % per_row;
        float* row = y + m * qkv.N + head * D;
        if (head < heads + kv_heads) {
          const float* head_norm = head < heads ? fam.q_norm : fam.k_norm;
          if (head_norm) rms_norm_row(row, head_norm, row, D, eps);
          rope_row(row, cp + m * D, sp + m * D, D, lo);
        }
        if (head >= heads && cache.active()) {
          const bool is_k = head < heads + kv_heads;
          const int64_t j = head - heads - (is_k ? 0 : kv_heads);
          write_row(is_k ? cache.k : cache.v, cache.slots[m] * kv_heads + j, row, D);
        }
      }
    }
  }
  return out;
}
#endif

}  // namespace
}  // namespace kvforge

#if defined(__AVX512F__)
TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("layer_bridge", &kvforge::layer_bridge_cpu); }
#endif
