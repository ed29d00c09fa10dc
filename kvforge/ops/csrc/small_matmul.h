// The few-row fp32 linear of small_matmul.cpp on a range of W's rows, for callers that split the rows over
// threads themselves (layer_bridge.cpp): columns [r0, r1) of y [M, N] = x [M, K] @ W [N, K]^T, W's rows taken
// kLinearUnit at a time from r0, each unit streamed once per 8 rows of x. AVX-512 only.
#pragma once

#include <cstdint>

namespace kvforge {

constexpr int64_t kLinearUnit = 64;  // W rows per unit: 64 * K floats streamed, then the next

inline int64_t linear_units(int64_t N) { return (N + kLinearUnit - 1) / kLinearUnit; }

#if defined(__AVX512F__)
void linear_rows(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t r0, int64_t r1);
#endif

}  // namespace kvforge
