// The weight-only int8 linear of int8_matmul.cpp in two parts, for callers that split W's rows over threads
// themselves (layer_bridge.cpp): quantize_rows rounds x to int8 blocks once, tiles multiplies tiles [t0, t1) of
// the packed weight (kTile output rows each) with it. AVX-512 VNNI only (KVFORGE_INT8_VNNI).
#pragma once

#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define KVFORGE_INT8_VNNI 1
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
QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K);
// y [M, N] rows of tiles [t0, t1) of the packed Wq times per-row scale s.
void tiles(const QuantizedRows& xq, const int8_t* w, const float* s, float* y, int64_t N, int64_t M, int64_t t0,
           int64_t t1);
#endif

}  // namespace kvforge
