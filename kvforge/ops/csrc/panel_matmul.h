// panel_matmul.cpp's tiles on a range of panels, for callers that split the panels over threads themselves
// (layer_bridge.cpp). W packed as ops/panels.py packs it: [P, K, 16], panel p holding output columns 16p..16p+15.
#pragma once

#include <cstdint>

namespace kvforge {

constexpr int64_t kPanel = 16;  // output columns per panel
constexpr int64_t kPanelsPerTile = 3;

#if defined(__AVX512F__)
// y[:, 16 p0 : 16 p1] (columns below N; y's row stride N) = x [M, K] @ the panels' columns (+ bias), triple by triple,
// 8 rows of x at a time; each output one in-order sum over k, whatever M.
void panel_range(const float* x, const float* panels, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p0, int64_t p1);
// The same tiles on np <= 3 panels [np, K, 16] at w (a dequantized copy of panels p..p+np-1 of W), no prefetching.
void panel_tiles(const float* x, const float* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p, int64_t np);
#endif

}  // namespace kvforge
