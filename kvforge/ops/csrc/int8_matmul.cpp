// kvforge::int8_linear: y = (x @ Wq^T) * scale (+ bias) for weight-only int8 linear layers, Wq [N, K] int8 with
// one fp32 scale per output row. For the few rows of a decode step: each row of x is rounded to int16 with its
// own scale (error <= max|x| / 65534), each tile of Wq is read once (a quarter of fp32's bytes), widened to int16
// in registers and multiplied with every row of x by AVX-512 VNNI (vpdpwssd: 32 products per instruction, exact
// int32 sums); both scales are applied once per output. Parallel over Wq's rows. The torch reference
// (ops/int8.py) computes the same integers; on CPUs without AVX-512 VNNI no kernel registers and it runs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVFORGE_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace kvforge {
namespace {

constexpr float kInt16Max = 32767.0f;

#if KVFORGE_INT8_VNNI
constexpr int64_t kSegment = 8192;  // columns per int32 accumulation: 8192 / 32 * 2 * 127 * 32767 < 2^31

// acc[r][m] += Wq[n0 + r, k:k+32] . xq[m0 + m, k:k+32] (masked for the tail of K).
template <int NR, int MR, bool TAIL>
inline void step(__m512i (&acc)[NR][MR], const int16_t* x, const int8_t* w, int64_t K, int64_t m0, int64_t n0,
                 int64_t k, __mmask32 mask) {
  __m512i wv[NR];
  for (int r = 0; r < NR; ++r) {
    const int8_t* p = w + (n0 + r) * K + k;
    const __m256i raw = TAIL ? _mm256_maskz_loadu_epi8(mask, p) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    wv[r] = _mm512_cvtepi8_epi16(raw);
  }
  for (int m = 0; m < MR; ++m) {
    const int16_t* xp = x + (m0 + m) * K + k;
    const __m512i xv = TAIL ? _mm512_maskz_loadu_epi16(mask, xp) : _mm512_loadu_si512(xp);
    for (int r = 0; r < NR; ++r) acc[r][m] = _mm512_dpwssd_epi32(acc[r][m], wv[r], xv);
  }
}

inline int64_t reduce_exact(__m512i acc) {
  const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc));
  const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1));
  return _mm512_reduce_add_epi64(_mm512_add_epi64(lo, hi));
}

// Rows [n0, n0 + NR) of Wq against rows [m0, m0 + MR) of xq: exact integer dot products, then the two scales.
template <int NR, int MR>
inline void tile(const int16_t* x, const float* x_scale, const int8_t* w, const float* scale, float* y, int64_t K,
                 int64_t N, int64_t m0, int64_t n0) {
  int64_t total[NR][MR] = {};
  const int64_t full = K / 32 * 32;
  for (int64_t s0 = 0; s0 < K; s0 += kSegment) {
    const int64_t s1 = std::min(K, s0 + kSegment), s_full = std::min(full, s1);
    __m512i acc[NR][MR];
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_si512();
    int64_t k = s0;
    for (; k < s_full; k += 32) step<NR, MR, false>(acc, x, w, K, m0, n0, k, 0);
    if (k < s1) step<NR, MR, true>(acc, x, w, K, m0, n0, k, static_cast<__mmask32>((1ull << (s1 - k)) - 1ull));
    for (int r = 0; r < NR; ++r)
      for (int m = 0; m < MR; ++m) total[r][m] += reduce_exact(acc[r][m]);
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m)
      y[(m0 + m) * N + n0 + r] = static_cast<float>(total[r][m]) * (x_scale[m0 + m] * scale[n0 + r]);
}

template <int MR>
void rows_of_w(const int16_t* x, const float* xs, const int8_t* w, const float* s, float* y, int64_t K, int64_t N,
               int64_t m0, int64_t n0, int64_t n1) {
  constexpr int NR = MR == 1 ? 8 : (MR <= 4 ? 4 : 2);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<NR, MR>(x, xs, w, s, y, K, N, m0, n);
  for (; n < n1; ++n) tile<1, MR>(x, xs, w, s, y, K, N, m0, n);
}

void rows_chunk(const int16_t* x, const float* xs, const int8_t* w, const float* s, float* y, int64_t K, int64_t N,
                int64_t m0, int64_t mr, int64_t n0, int64_t n1) {
  switch (mr) {
    case 1: return rows_of_w<1>(x, xs, w, s, y, K, N, m0, n0, n1);
    case 2: return rows_of_w<2>(x, xs, w, s, y, K, N, m0, n0, n1);
    case 3: return rows_of_w<3>(x, xs, w, s, y, K, N, m0, n0, n1);
    case 4: return rows_of_w<4>(x, xs, w, s, y, K, N, m0, n0, n1);
    case 5: return rows_of_w<5>(x, xs, w, s, y, K, N, m0, n0, n1);
    case 6: return rows_of_w<6>(x, xs, w, s, y, K, N, m0, n0, n1);
    case 7: return rows_of_w<7>(x, xs, w, s, y, K, N, m0, n0, n1);
    default: return rows_of_w<8>(x, xs, w, s, y, K, N, m0, n0, n1);
  }
}

// Each row of x as int16 with its scale: x ~= xq * x_scale (as ops/int8.py's quantize_rows_int16).
void quantize_rows(const float* x, int64_t M, int64_t K, std::vector<int16_t>& xq, std::vector<float>& x_scale) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float inv = amax > 0.0f ? kInt16Max / amax : 0.0f;
    x_scale[m] = amax > 0.0f ? amax / kInt16Max : 0.0f;
    for (int64_t k = 0; k < K; ++k) xq[m * K + k] = static_cast<int16_t>(std::nearbyint(row[k] * inv));
  }
}
#endif

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& scale_in,
                           const c10::optional<at::Tensor>& bias) {
#if KVFORGE_INT8_VNNI
  TORCH_CHECK(x_in.dim() == 2 && w_in.dim() == 2 && x_in.size(1) == w_in.size(1),
              "int8_linear: x [M, K] and qweight [N, K] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w_in.scalar_type() == at::kChar &&
                  scale_in.scalar_type() == at::kFloat && scale_in.numel() == w_in.size(0),
              "int8_linear: fp32 x, int8 qweight and one fp32 scale per qweight row expected");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), scale = scale_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  std::vector<int16_t> xq(M * K);
  std::vector<float> xs(M);
  quantize_rows(x.data_ptr<float>(), M, K, xq, xs);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* sp = scale.data_ptr<float>();
  const int8_t* wp = w.data_ptr<int8_t>();
  const int16_t* xp = xq.data();
  const float* xsp = xs.data();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kRowsPerTask = 64;
  at::parallel_for(0, (N + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n0 = task * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
      for (int64_t m0 = 0; m0 < M; m0 += 8)
        rows_chunk(xp, xsp, wp, sp, yp, K, N, m0, std::min<int64_t>(8, M - m0), n0, n1);
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}
#endif

}  // namespace
}  // namespace kvforge

#if KVFORGE_INT8_VNNI
TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("int8_linear", &kvforge::int8_linear_cpu); }
#endif
