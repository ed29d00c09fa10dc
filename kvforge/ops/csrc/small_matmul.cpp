// kvforge::small_linear: y = x @ W^T (+ bias) for the few rows of a decode step (x [M, K], M small), where a
// BLAS tuned for large products leaves most of the memory bandwidth unused. Each row of W is read from memory
// once per 8 rows of x (kept in cache) and multiplied by each of them in AVX-512 registers; parallel over W's
// rows. Without AVX-512 it calls at::linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "small_matmul.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvforge {
namespace {

#if defined(__AVX512F__)
// One row of x against rows [n0, n1) of W: each W row is read front to back with four independent sums, so the
// memory sees one sequential stream (tiles of 8 rows, i.e. 8 interleaved streams, ran at ~60% of a plain read's
// bandwidth on 2 MB pages), and asked for 4 KB ahead into L3 (+5-10% over the hardware prefetcher alone).
constexpr int64_t kAhead = 1024;  // floats
constexpr int64_t kL1Floats = 6144;  // 24 KB of rows of x per pass

inline void one_row(const float* x, const float* w, float* y, int64_t K, int64_t n0, int64_t n1) {
  const int64_t k64 = K / 64 * 64, k16 = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - k16)) - 1u);
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int64_t k = 0;
    for (; k < k64; k += 64) {
      for (int line = 0; line < 64; line += 16)
        _mm_prefetch(reinterpret_cast<const char*>(wr + k + kAhead + line), _MM_HINT_T2);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k), _mm512_loadu_ps(x + k), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 16), _mm512_loadu_ps(x + k + 16), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 32), _mm512_loadu_ps(x + k + 32), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k + 48), _mm512_loadu_ps(x + k + 48), a3);
    }
    for (; k < k16; k += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(wr + k), _mm512_loadu_ps(x + k), a0);
    if (k16 < K) a1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, wr + k16), _mm512_maskz_loadu_ps(tail, x + k16), a1);
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  }
}

// MR rows of x (in L1) against rows [n0, n1) of W, each W row read front to back once as in one_row: every
// 16 weights loaded feed MR FMAs, two sums per x row for independent chains. A few-row step (speculative
// verification, small batches) then streams the weights like a one-row step instead of NR interleaved streams.
template <int MR>
void rows_of_w(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t n1) {
  const int64_t k32 = K / 32 * 32, k16 = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - k16)) - 1u);
  const float* xm = x + m0 * K;
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m512 a[MR], b[MR];
    for (int m = 0; m < MR; ++m) a[m] = b[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k < k32; k += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + k + kAhead), _MM_HINT_T2);
      _mm_prefetch(reinterpret_cast<const char*>(wr + k + kAhead + 16), _MM_HINT_T2);
      const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
      for (int m = 0; m < MR; ++m) {
        a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm + m * K + k), a[m]);
        b[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xm + m * K + k + 16), b[m]);
      }
    }
    for (; k < k16; k += 16) {
      const __m512 w0 = _mm512_loadu_ps(wr + k);
      for (int m = 0; m < MR; ++m) a[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xm + m * K + k), a[m]);
    }
    if (k16 < K) {
      const __m512 w0 = _mm512_maskz_loadu_ps(tail, wr + k16);
      for (int m = 0; m < MR; ++m) b[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(tail, xm + m * K + k16), b[m]);
    }
    for (int m = 0; m < MR; ++m) y[(m0 + m) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
  }
}

void rows_chunk(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t mr, int64_t n0,
                int64_t n1) {
  switch (mr) {
    case 1: return one_row(x + m0 * K, w, y + m0 * N, K, n0, n1);
    case 2: return rows_of_w<2>(x, w, y, K, N, m0, n0, n1);
    case 3: return rows_of_w<3>(x, w, y, K, N, m0, n0, n1);
    case 4: return rows_of_w<4>(x, w, y, K, N, m0, n0, n1);
    case 5: return rows_of_w<5>(x, w, y, K, N, m0, n0, n1);
    case 6: return rows_of_w<6>(x, w, y, K, N, m0, n0, n1);
    case 7: return rows_of_w<7>(x, w, y, K, N, m0, n0, n1);
    default: return rows_of_w<8>(x, w, y, K, N, m0, n0, n1);
  }
}
#endif

}  // namespace

#if defined(__AVX512F__)
void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t r0, int64_t r1) {
  // rows of x per pass: up to 8 while they fit in L1 with room for the weights (K = 1536: 4), in even groups; each
  // unit of W is read from memory by the first pass and from L2 by the others
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(8, kL1Floats / K));
  const int64_t passes = (M + most - 1) / most, group = (M + passes - 1) / passes;
  for (int64_t n0 = r0; n0 < r1; n0 += kLinearUnit) {
    const int64_t n1 = std::min(r1, n0 + kLinearUnit);
    for (int64_t m0 = 0; m0 < M; m0 += group) rows_chunk(x, w, y, K, N, m0, std::min(group, M - m0), n0, n1);
  }
}
#endif

namespace {

at::Tensor small_linear_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "small_linear: x [M, K] and weight [N, K] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kFloat, "small_linear: fp32 only");
#if defined(__AVX512F__)
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, linear_units(N), 1,
                   [&](int64_t begin, int64_t end) {
    linear_rows(xp, wp, yp, M, K, N, begin * kLinearUnit, std::min(N, end * kLinearUnit));
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
#else
  return at::linear(x_in, w_in, bias);
#endif
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("small_linear", &kvforge::small_linear_cpu); }
