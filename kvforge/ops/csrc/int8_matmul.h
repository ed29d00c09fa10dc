// The weight-only int8 linear of int8_matmul.cpp in two parts, for callers that split W's rows over threads
// themselves (layer_bridge.cpp): quantize_rows rounds x to int8 blocks once, tiles multiplies tiles [t0, t1) of
// the packed weight (kTile output rows each) with it. AVX-512 VNNI only (KVFORGE_INT8_VNNI).
#pragma once

#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define KVFORGE_INT8_VNNI 1
#include <immintrin.h>
#endif

namespace kvforge {

constexpr int kTile = 4;  // rows of Wq per tile, interleaved per 64-column chunk in the packed layout

// Rows of x in the kernel's form: int8 per block, and per lane of each chunk its correction and its block's scale.
struct QuantizedRows {
  int64_t chunks;
  std::vector<int8_t> q;       // [M, chunks * 64], zero past K
  std::vector<int32_t> fix;    // [M, chunks * 16]: -128 * (sum of the lane's 4 values of q)
  std::vector<float> d;        // [M, chunks * 16]: the lane's block scale
};

#if KVFORGE_INT8_VNNI
// The 16 lanes summed as ops/int8.py's lane_sum: halves, then quarters, eighths, the last pair.
inline float lane_sum(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K);
// y [M, N] rows of tiles [t0, t1) of the packed Wq times per-row scale s.
void tiles(const QuantizedRows& xq, const int8_t* w, const float* s, float* y, int64_t N, int64_t M, int64_t t0,
           int64_t t1);
#endif

}  // namespace kvforge
