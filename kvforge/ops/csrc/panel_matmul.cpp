// kvforge::panel_linear: y = x @ W^T (+ bias) for steps of tens of rows (batched decode, speculative verification),
// where oneDNN reaches about half of its large-product rate. W is packed once into panels of 16 output columns,
// [P, K, 16] (ops/panels.py), so that for each k the 16 weights of a panel are one vector load. A tile of up to
// 8 rows of x and 3 panels keeps its 24 sums in registers over the whole of K: per k, 3 loads of W, 8
// broadcasts of x and 24 FMAs. x is taken in blocks of rows that fit L2 (512 KB); for each block the threads
// split the panel triples, and each triple (K * 48 floats) is read from memory once and from L2 by the following
// row tiles, which meanwhile prefetch the next triple into L2. Every output is one sum over k in order whatever the
// row count, so a row's result does not depend on the rows beside it. Without AVX-512 it unpacks W and calls
// at::linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "panel_matmul.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvforge {
namespace {

constexpr int64_t kRowsPerTile = 8;
constexpr int64_t kL2Floats = 131072;  // rows of x per block: 512 KB, so that every panel triple finds them in L2

#if defined(__AVX512F__)
// Rows [0, MR) of x (row stride K) against panels [p0, p0 + NP) of W: y[:, 16 * p0 ...] for columns below N.
// While a triple's row tiles run (all but the first from L2), the next triple is prefetched into L2, a share of
// it per tile: `ahead` describes that share, so that memory streams under the arithmetic instead of between it.
struct Ahead {
  const float* next = nullptr;  // the next triple's first panel (nullptr: none)
  int64_t panels = 0, tile = 0, tiles = 1;  // its panels; this tile of the current triple and how many there are
};

template <int MR, int NP>
void tile(const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N, int64_t p0,
          const Ahead& ahead) {
  __m512 c[MR][NP];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < NP; ++p) c[m][p] = _mm512_setzero_ps();
  int64_t countdown = 1, line = ahead.tile * K / ahead.tiles;  // a panel's row k is one cache line
  const int64_t end = (ahead.tile + 1) * K / ahead.tiles;
  for (int64_t k = 0; k < K; ++k) {
    __m512 wk[NP];
    for (int p = 0; p < NP; ++p) wk[p] = _mm512_loadu_ps(w + (p * K + k) * kPanel);
    for (int m = 0; m < MR; ++m) {
      const __m512 xm = _mm512_set1_ps(x[m * K + k]);
      for (int p = 0; p < NP; ++p) c[m][p] = _mm512_fmadd_ps(xm, wk[p], c[m][p]);
    }
    if (ahead.next && --countdown == 0 && line < end) {
      countdown = ahead.tiles;
      for (int64_t q = 0; q < ahead.panels; ++q)
        _mm_prefetch(reinterpret_cast<const char*>(ahead.next + (q * K + line) * kPanel), _MM_HINT_T1);
      ++line;
    }
  }
  for (int p = 0; p < NP; ++p) {
    const int64_t n0 = (p0 + p) * kPanel, width = std::min<int64_t>(kPanel, N - n0);
    const __mmask16 keep = static_cast<__mmask16>((1u << width) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * N + n0, keep, _mm512_add_ps(c[m][p], b));
  }
}

// w: the first of the tile's panels (panel p0 of the weight, or a dequantized copy of it)
template <int NP>
void rows_tile(int64_t mr, const float* x, const float* w, const float* bias, float* y, int64_t K, int64_t N,
               int64_t p0, const Ahead& a) {
  switch (mr) {
    case 1: return tile<1, NP>(x, w, bias, y, K, N, p0, a);
    case 2: return tile<2, NP>(x, w, bias, y, K, N, p0, a);
    case 3: return tile<3, NP>(x, w, bias, y, K, N, p0, a);
    case 4: return tile<4, NP>(x, w, bias, y, K, N, p0, a);
    case 5: return tile<5, NP>(x, w, bias, y, K, N, p0, a);
    case 6: return tile<6, NP>(x, w, bias, y, K, N, p0, a);
    case 7: return tile<7, NP>(x, w, bias, y, K, N, p0, a);
    default: return tile<8, NP>(x, w, bias, y, K, N, p0, a);
  }
}

// Rows [0, M) of x against panels [p, p + np) held as w (the weight's own panels or their dequantized copy).
void triple_rows(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p, int64_t np, Ahead ahead) {
  for (int64_t m = 0; m < M; m += kRowsPerTile, ++ahead.tile) {
    const int64_t mr = std::min(kRowsPerTile, M - m);
    const float* xm = x + m * K;
    float* ym = y + m * N;
    if (np == 3) rows_tile<3>(mr, xm, w, bias, ym, K, N, p, ahead);
    else if (np == 2) rows_tile<2>(mr, xm, w, bias, ym, K, N, p, ahead);
    else rows_tile<1>(mr, xm, w, bias, ym, K, N, p, ahead);
  }
}

}  // namespace

void panel_range(const float* x, const float* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p0, int64_t p1) {
  const int64_t tiles = (M + kRowsPerTile - 1) / kRowsPerTile;
  for (int64_t p = p0; p < p1; p += kPanelsPerTile) {
    const int64_t np = std::min(kPanelsPerTile, p1 - p), next = p + np;
    Ahead ahead;
    if (next < p1) ahead = {panels + next * K * kPanel, std::min(kPanelsPerTile, p1 - next), 0, tiles};
    triple_rows(x, panels + p * K * kPanel, bias, y, M, K, N, p, np, ahead);
  }
}

void panel_tiles(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p, int64_t np) {
  triple_rows(x, w, bias, y, M, K, N, p, np, Ahead{});
}

// int8 panels: each triple dequantized (float(q) * the column's scale, as ops/int8.py's dequantize) into `buffer`
// (K * 48 floats, in L2), then the fp32 tiles above on it, so the result is panel_range's on the dequantized weight,
// bit for bit, while memory carries a quarter of the bytes.
void int8_panel_range(const float* x, const int8_t* q, const float* scale, const float* bias, float* y, int64_t M,
                      int64_t K, int64_t N, int64_t p0, int64_t p1, float* buffer) {
  for (int64_t p = p0; p < p1; p += kPanelsPerTile) {
    const int64_t np = std::min(kPanelsPerTile, p1 - p);
    for (int64_t j = 0; j < np; ++j) {
      const __m512 s = _mm512_loadu_ps(scale + (p + j) * kPanel);
      const int8_t* qp = q + (p + j) * K * kPanel;
      float* out = buffer + j * K * kPanel;
      for (int64_t k = 0; k < K; ++k) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qp + k * kPanel));
        _mm512_storeu_ps(out + k * kPanel, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), s));
      }
    }
    triple_rows(x, buffer, bias, y, M, K, N, p, np, Ahead{});
  }
}

namespace {
#endif

at::Tensor panel_linear_cpu(const at::Tensor& x_in, const at::Tensor& panels_in, int64_t n,
                            const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && panels_in.dim() == 3 && panels_in.size(2) == kPanel && x_in.size(1) == panels_in.size(1),
              "panel_linear: x [M, K] and panels [P, K, 16] expected");
  TORCH_CHECK(n > (panels_in.size(0) - 1) * kPanel && n <= panels_in.size(0) * kPanel,
              "panel_linear: ", panels_in.size(0), " panels hold ", panels_in.size(0) * kPanel, " columns at most, not ", n);
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && panels_in.scalar_type() == at::kFloat, "panel_linear: fp32 only");
  const bool has_bias = bias_in.has_value() && bias_in->defined();
#if defined(__AVX512F__)
  const at::Tensor x = x_in.contiguous(), panels = panels_in.contiguous();
  const at::Tensor bias = has_bias ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0);
  at::Tensor y = at::empty({M, n}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = panels.data_ptr<float>(), *bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t triples = (P + kPanelsPerTile - 1) / kPanelsPerTile;
  const int64_t block = std::max<int64_t>(kRowsPerTile, kL2Floats / K / kRowsPerTile * kRowsPerTile);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    at::parallel_for(0, triples, 1, [&](int64_t begin, int64_t end) {
      panel_range(xp + m0 * K, wp, bp, yp + m0 * n, rows, K, n, begin * kPanelsPerTile,
                  std::min(P, end * kPanelsPerTile));
    });
  }
  return y;
#else
  const at::Tensor w = panels_in.transpose(1, 2).reshape({-1, panels_in.size(1)}).narrow(0, 0, n);
  return at::linear(x_in, w, has_bias ? *bias_in : at::Tensor());
#endif
}

at::Tensor int8_panel_linear_cpu(const at::Tensor& x_in, const at::Tensor& q_in, const at::Tensor& scale_in, int64_t n,
                                 const c10::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(x_in.dim() == 2 && q_in.dim() == 3 && q_in.size(2) == kPanel && x_in.size(1) == q_in.size(1),
              "int8_panel_linear: x [M, K] and int8 panels [P, K, 16] expected");
  TORCH_CHECK(n > (q_in.size(0) - 1) * kPanel && n <= q_in.size(0) * kPanel && scale_in.dim() == 1 && scale_in.size(0) == n,
              "int8_panel_linear: ", q_in.size(0), " panels and ", scale_in.numel(), " scales do not hold ", n, " columns");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && q_in.scalar_type() == at::kChar && scale_in.scalar_type() == at::kFloat,
              "int8_panel_linear: fp32 x, int8 panels, fp32 scales");
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  const int64_t P = q_in.size(0);
  const at::Tensor scale = at::constant_pad_nd(scale_in.contiguous(), {0, P * kPanel - n}, 0);
#if defined(__AVX512F__)
  const at::Tensor x = x_in.contiguous(), q = q_in.contiguous();
  const at::Tensor bias = has_bias ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, n}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = scale.data_ptr<float>(), *bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const int8_t* qp = q.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t triples = (P + kPanelsPerTile - 1) / kPanelsPerTile;
  const int64_t block = std::max<int64_t>(kRowsPerTile, kL2Floats / K / kRowsPerTile * kRowsPerTile);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    at::parallel_for(0, triples, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> storage(K * kPanel * kPanelsPerTile + kPanel);  // 64-byte aligned, as torch allocates:
      const auto at = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63};  // a panel row per line
      int8_panel_range(xp + m0 * K, qp, sp, bp, yp + m0 * n, rows, K, n, begin * kPanelsPerTile,
                       std::min(P, end * kPanelsPerTile), reinterpret_cast<float*>(at));
    });
  }
  return y;
#else
  const at::Tensor w = q_in.transpose(1, 2).reshape({-1, q_in.size(1)}).narrow(0, 0, n).to(at::kFloat) * scale_in.unsqueeze(1);
  return at::linear(x_in, w, has_bias ? *bias_in : at::Tensor());
#endif
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) {
  m.impl("panel_linear", &kvforge::panel_linear_cpu);
  m.impl("int8_panel_linear", &kvforge::int8_panel_linear_cpu);
}
