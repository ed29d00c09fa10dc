// One row of a decoder's elementwise work (RMSNorm, the residual add fused with it, rotate-half RoPE, SwiGLU's
// silu(gate) * up, GeGLU's gelu_tanh(gate) * up): shared by the per-op kernels (layers.cpp) and the fused layer bridge (layer_bridge.cpp), so
// both compute the same floats in the same order; and a row stored in a narrower type.
#pragma once

#include <cmath>
#include <cstdint>

#include "vmath.h"

namespace kvforge {

// dst = src converted as Tensor.to would (fp16 / bf16: round to nearest even).
template <class T>
inline void put_row(const float* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

inline void rms_norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * inv);
}

// res += x, then out = RMSNorm(res).
inline void add_rms_norm_row(float* res, const float* x, const float* w, float* out, int64_t d, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) {
    res[i] += x[i];
    ss += res[i] * res[i];
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = w[i] * (res[i] * inv);
}

// One head v [d] in place: v * cos + rotate_half(v) * sin; lo: scratch of d / 2 floats.
inline void rope_row(float* v, const float* c, const float* s, int64_t d, float* lo) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) lo[j] = v[j];
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) v[j] = v[j] * c[j] + (-v[j + half]) * s[j];
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) v[j + half] = v[j + half] * c[j + half] + lo[j] * s[j + half];
}

inline void silu_mul_row(const float* g, const float* u, float* o, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float e = exp_nonpositive(-std::fabs(g[i]));  // sigmoid from exp(-|g|): no overflow
    const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    o[i] = g[i] * sig * u[i];
  }
}

// GELU's tanh form times up: 0.5 g (1 + tanh(z)) u = g sigmoid(2 z) u, z = sqrt(2 / pi) (g + 0.044715 g^3).
inline void gelu_tanh_mul_row(const float* g, const float* u, float* o, int64_t n) {
  constexpr float kTwoBeta = 1.5957691216057308f, kKappa = 0.044715f;  // 2 sqrt(2 / pi)
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i], z = kTwoBeta * (x + kKappa * x * x * x);
    const float e = exp_nonpositive(-std::fabs(z));
    const float sig = z >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    o[i] = x * sig * u[i];
  }
}

}  // namespace kvforge
