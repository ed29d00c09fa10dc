// kvforge::int8_linear: y = (x @ Wq^T) * scale (+ bias) for weight-only int8 linear layers, Wq [N, K] int8 with
// one fp32 scale per output row. For the few rows of a decode step: each 32-column block of each row of x is
// rounded to int8 with its own fp32 scale (as llama.cpp's Q8_0 activations); Wq is streamed once per tile of
// output rows with plain loads, flipped to unsigned (w + 128) in registers and multiplied with every row of x by
// AVX-512 VNNI (vpdpbusd: 64 products per instruction, exact int32 sums per 4 columns), the +128 undone by a
// correction that depends on x alone. Each of the 16 int32 lanes of a 64-column chunk is converted to fp32, scaled
// by its block's scale and added into an fp32 lane; the lanes are summed in a fixed tree, then times Wq's scale.
// The torch reference (ops/int8.py) repeats the same integer sums and fp32 operations in the same order, so the two
// agree bit for bit. On CPUs without AVX-512 VNNI no kernel registers and the engine dequantizes instead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "int8_matmul.h"

#if KVFORGE_INT8_VNNI
#include <immintrin.h>
#endif

namespace kvforge {

#if KVFORGE_INT8_VNNI
namespace {

constexpr int64_t kBlock = 32;  // columns of x per int8 scale
constexpr int64_t kChunk = 64;  // columns per vpdpbusd: 16 lanes of 4
constexpr int64_t kLanes = 16;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;  // explicit rounding: never fused into an FMA

}  // namespace

// As ops/int8.py's quantize_blocks: d = amax / 127, q = round_half_even(x * (127 / amax)), zero blocks give zeros.
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantizedRows out;
  out.chunks = (K + kChunk - 1) / kChunk;
  const int64_t width = out.chunks * kChunk, lanes = out.chunks * kLanes;
  out.q.assign(M * width, 0);
  out.fix.assign(M * lanes, 0);
  out.d.assign(M * lanes, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    int8_t* q = out.q.data() + m * width;
    for (int64_t k0 = 0; k0 < K; k0 += kBlock) {
      const int64_t k1 = std::min(K, k0 + kBlock);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(row[k]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      for (int64_t k = k0; k < k1; ++k) q[k] = static_cast<int8_t>(std::nearbyint(row[k] * inv));
      const float d = amax > 0.0f ? amax / 127.0f : 0.0f;
      for (int64_t l = 0; l < kBlock / 4; ++l) out.d[m * lanes + k0 / 4 + l] = d;
    }
    for (int64_t l = 0; l < lanes; ++l)
      out.fix[m * lanes + l] = -128 * (q[4 * l] + q[4 * l + 1] + q[4 * l + 2] + q[4 * l + 3]);
  }
  return out;
}

namespace {

constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of the loads the packed weights are prefetched (into L2)

// Tile t of the packed Wq ([tiles, chunks, 4, 64], one linear stream) against rows [m0, m0 + MR) of x. The first
// row group of a tile prefetches ahead; rows of Wq past N (zeros) are computed, not stored.
template <int MR>
inline void tile(const QuantizedRows& xq, const int8_t* w, const float* scale, float* y, int64_t N, int64_t m0,
                 int64_t t, bool prefetch) {
  const int64_t width = xq.chunks * kChunk, lanes = xq.chunks * kLanes;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* wt = w + t * xq.chunks * kTile * kChunk;
  __m512 acc[kTile][MR];
  for (int r = 0; r < kTile; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < xq.chunks; ++c) {
    const int8_t* p = wt + c * kTile * kChunk;
    __m512i wv[kTile];
    for (int r = 0; r < kTile; ++r) wv[r] = _mm512_xor_si512(_mm512_loadu_si512(p + r * kChunk), flip);
    if (prefetch)
      for (int r = 0; r < kTile; ++r) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + r * kChunk),
                                                   _MM_HINT_T1);
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      const __m512i xv = _mm512_loadu_si512(xq.q.data() + row * width + c * kChunk);
      const __m512i fix = _mm512_loadu_si512(xq.fix.data() + row * lanes + c * kLanes);
      const __m512 d = _mm512_loadu_ps(xq.d.data() + row * lanes + c * kLanes);
      for (int r = 0; r < kTile; ++r) {
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(fix, wv[r], xv));
        acc[r][m] = _mm512_add_round_ps(acc[r][m], _mm512_mul_round_ps(dots, d, kRound), kRound);
      }
    }
  }
  const int64_t n0 = t * kTile, rows = std::min<int64_t>(kTile, N - n0);
  for (int r = 0; r < rows; ++r)
    for (int m = 0; m < MR; ++m) y[(m0 + m) * N + n0 + r] = lane_sum(acc[r][m]) * scale[n0 + r];
}

}  // namespace

void tiles(const QuantizedRows& xq, const int8_t* w, const float* s, float* y, int64_t N, int64_t M, int64_t t0,
           int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m0 = 0; m0 < M; m0 += 4) {  // later row groups find the tile in L1
      switch (std::min<int64_t>(4, M - m0)) {
        case 1: tile<1>(xq, w, s, y, N, m0, t, m0 == 0); break;
        case 2: tile<2>(xq, w, s, y, N, m0, t, m0 == 0); break;
        case 3: tile<3>(xq, w, s, y, N, m0, t, m0 == 0); break;
        default: tile<4>(xq, w, s, y, N, m0, t, m0 == 0); break;
      }
    }
}

namespace {

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in,
                           const c10::optional<at::Tensor>& bias) {
  const int64_t M = x_in.size(0), K = x_in.size(1), N = scale_in.numel();
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 4 && w_in.size(0) == (N + kTile - 1) / kTile &&
                  w_in.size(1) == (K + kChunk - 1) / kChunk && w_in.size(2) == kTile && w_in.size(3) == kChunk,
              "int8_linear: x [M, K] and qweight packed by ops/int8.py's pack, [ceil(N / 4), ceil(K / 64), 4, 64]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kChar &&
                  scale_in.scalar_type() == at::kFloat,
              "int8_linear: fp32 x, int8 qweight and one fp32 scale per output expected");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  const QuantizedRows xq = quantize_rows(x.data_ptr<float>(), M, K);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* sp = scale.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kTilesPerTask = 16;
  at::parallel_for(0, w.size(0), kTilesPerTask,
                   [&](int64_t begin, int64_t end) { tiles(xq, wp, sp, yp, N, M, begin, end); });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

}  // namespace
#endif

}  // namespace kvforge

#if KVFORGE_INT8_VNNI
TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("int8_linear", &kvforge::int8_linear_cpu); }
#endif
