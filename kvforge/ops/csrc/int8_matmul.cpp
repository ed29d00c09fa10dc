// kvforge::int8_linear: y = (x @ Wq^T) * scale (+ bias) for weight-only int8 linear layers, Wq [N, K] int8 with
// one fp32 scale per output row. For the few rows of a decode step: each tile of Wq is read once (a quarter of
// fp32's bytes), widened to fp32 in AVX-512 registers and multiplied by every row of x (kept in cache); the
// scale is applied once per output. Parallel over Wq's rows. Without AVX-512 it dequantizes and calls at::linear.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvforge {
namespace {

#if defined(__AVX512F__)
inline __m512 widen(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 widen(const int8_t* p, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, p)));
}

// acc[r][m] += Wq[n0 + r, k:k+16] * x[m0 + m, k:k+16] (masked for the tail of K).
template <int NR, int MR, bool TAIL>
inline void step(__m512 (&acc)[NR][MR], const float* x, const int8_t* w, int64_t K, int64_t m0, int64_t n0, int64_t k,
                 __mmask16 mask) {
  __m512 wv[NR];
  for (int r = 0; r < NR; ++r) wv[r] = TAIL ? widen(w + (n0 + r) * K + k, mask) : widen(w + (n0 + r) * K + k);
  for (int m = 0; m < MR; ++m) {
    const float* xp = x + (m0 + m) * K + k;
    const __m512 xv = TAIL ? _mm512_maskz_loadu_ps(mask, xp) : _mm512_loadu_ps(xp);
    for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
  }
}

// Rows [n0, n0 + NR) of Wq against rows [m0, m0 + MR) of x.
template <int NR, int MR>
inline void tile(const float* x, const int8_t* w, const float* scale, float* y, int64_t K, int64_t N, int64_t m0,
                 int64_t n0) {
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  const int64_t full = K / 16 * 16;
  int64_t k = 0;
  for (; k < full; k += 16) step<NR, MR, false>(acc, x, w, K, m0, n0, k, 0);
  if (k < K) step<NR, MR, true>(acc, x, w, K, m0, n0, k, static_cast<__mmask16>((1u << (K - full)) - 1u));
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) y[(m0 + m) * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]) * scale[n0 + r];
}

template <int MR>
void rows_of_w(const float* x, const int8_t* w, const float* s, float* y, int64_t K, int64_t N, int64_t m0,
               int64_t n0, int64_t n1) {
  constexpr int NR = MR == 1 ? 8 : (MR <= 4 ? 4 : 2);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<NR, MR>(x, w, s, y, K, N, m0, n);
  for (; n < n1; ++n) tile<1, MR>(x, w, s, y, K, N, m0, n);
}

void rows_chunk(const float* x, const int8_t* w, const float* s, float* y, int64_t K, int64_t N, int64_t m0,
                int64_t mr, int64_t n0, int64_t n1) {
  switch (mr) {
    case 1: return rows_of_w<1>(x, w, s, y, K, N, m0, n0, n1);
    case 2: return rows_of_w<2>(x, w, s, y, K, N, m0, n0, n1);
    case 3: return rows_of_w<3>(x, w, s, y, K, N, m0, n0, n1);
    case 4: return rows_of_w<4>(x, w, s, y, K, N, m0, n0, n1);
    case 5: return rows_of_w<5>(x, w, s, y, K, N, m0, n0, n1);
    case 6: return rows_of_w<6>(x, w, s, y, K, N, m0, n0, n1);
    case 7: return rows_of_w<7>(x, w, s, y, K, N, m0, n0, n1);
    default: return rows_of_w<8>(x, w, s, y, K, N, m0, n0, n1);
  }
}
#endif

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "int8_linear: x [M, K] and qweight [N, K] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kChar &&
                  scale_in.scalar_type() == at::kFloat && scale_in.numel() == w_in.size(0),
              "int8_linear: fp32 x, int8 qweight and one fp32 scale per qweight row expected");
#if defined(__AVX512F__)
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float *xp = x.data_ptr<float>(), *sp = scale.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kRowsPerTask = 64;
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_chunk(xp, wp, sp, yp, K, N, m0, std::min<int64_t>(8, M - m0), n0, n1);
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
#else
  return at::linear(x_in, w_in.to(at::kFloat) * scale_in.unsqueeze(1), bias);
#endif
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("int8_linear", &kvforge::int8_linear_cpu); }
