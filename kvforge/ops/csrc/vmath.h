// exp(x) for x <= 0 written so that gcc vectorizes loops over it (libm's expf stays scalar without
// -ffast-math): range reduction by ln 2, a degree-6 polynomial, and the exponent set through its bits.
// Relative error ~2e-7 over [-87, 0]; below that the result is 0 (as expf's, for softmax purposes).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace kvforge {

constexpr float kExpLog2e = 1.44269504088896341f, kExpLn2Hi = 0.693359375f, kExpLn2Lo = -2.12194440e-4f;
constexpr float kExpRound = 12582912.f;  // 1.5 * 2**23: adding and subtracting it rounds to an integer
constexpr float kExpFloor = -87.f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_nonpositive(float x) {
  x = x < kExpFloor ? kExpFloor : x;
  const float n = (x * kExpLog2e + kExpRound) - kExpRound;
  const float f = (x - n * kExpLn2Hi) - n * kExpLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * f + kExpPoly[i];
  p = p * f * f + f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

}  // namespace kvforge

#include <c10/util/Half.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvforge {

// fp16 -> fp32 (F16C where the CPU has it; c10::Half's bit arithmetic does not vectorize).
inline void half_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
#ifdef __F16C__
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]);
}

inline void bf16_to_float(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)));
  }
#endif
#ifdef __AVX2__
  for (; i + 8 <= n; i += 8) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
  }
#endif
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

// A finite float8 byte (MANT mantissa bits, exponent bias BIAS) -> fp32, branch-free so loops vectorize.
template <int MANT, int BIAS>
inline float fp8_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24, em = b & 0x7F;
  const uint32_t normal = sign | ((em << (23 - MANT)) + (static_cast<uint32_t>(127 - BIAS) << 23));
  float n, sub = static_cast<float>(em) * (1.f / static_cast<float>(1u << (BIAS + MANT - 1)));
  std::memcpy(&n, &normal, sizeof n);
  sub = sign ? -sub : sub;
  return em >= (1u << MANT) ? n : sub;
}

#ifdef __AVX2__
// Packed 4-bit or 2-bit codes, the lowest bits first (as packing.py packs them).
// 16 byte codes -> out[i] = code[i] * s[i] + z[i] (written once: no narrower store is read back wider)
inline void store_codes(__m128i codes, float* out, const float* s, const float* z) {
#ifdef __AVX512F__
  const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(c, _mm512_loadu_ps(s), _mm512_loadu_ps(z)));
#else
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)));
  _mm256_storeu_ps(out, _mm256_fmadd_ps(lo, _mm256_loadu_ps(s), _mm256_loadu_ps(z)));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(hi, _mm256_loadu_ps(s + 8), _mm256_loadu_ps(z + 8)));
#endif
}

// 16 byte codes of one group -> out[i] = code[i] * s + z
inline void store_group_codes(__m128i codes, float* out, float s, float z) {
#ifdef __AVX512F__
  const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  _mm512_storeu_ps(out, _mm512_fmadd_ps(c, _mm512_set1_ps(s), _mm512_set1_ps(z)));
#else
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), vs, vz));
  _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), vs, vz));
#endif
}

// Packed codes, 16 source bytes at a time, as 16 byte codes each: emit(codes, index of the first code);
// returns the bytes done.
template <int BITS, class Emit>
inline int64_t unpack_chunks(const uint8_t* src, int64_t nbytes, Emit&& emit) {
  const __m128i mask = _mm_set1_epi8((1 << BITS) - 1);
  int64_t i = 0;
  for (; i + 16 <= nbytes; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    if constexpr (BITS == 4) {
      const __m128i lo = _mm_and_si128(v, mask), hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
      emit(_mm_unpacklo_epi8(lo, hi), i * 2);
      emit(_mm_unpackhi_epi8(lo, hi), i * 2 + 16);
    } else {
      const __m128i c0 = _mm_and_si128(v, mask), c1 = _mm_and_si128(_mm_srli_epi16(v, 2), mask);
      const __m128i c2 = _mm_and_si128(_mm_srli_epi16(v, 4), mask), c3 = _mm_and_si128(_mm_srli_epi16(v, 6), mask);
      const __m128i t0 = _mm_unpacklo_epi8(c0, c1), t1 = _mm_unpackhi_epi8(c0, c1);
      const __m128i t2 = _mm_unpacklo_epi8(c2, c3), t3 = _mm_unpackhi_epi8(c2, c3);
      emit(_mm_unpacklo_epi16(t0, t2), i * 4);
      emit(_mm_unpackhi_epi16(t0, t2), i * 4 + 16);
      emit(_mm_unpacklo_epi16(t1, t3), i * 4 + 32);
      emit(_mm_unpackhi_epi16(t1, t3), i * 4 + 48);
    }
  }
  return i;
}

// Packed codes -> code * s + z per element; returns the bytes done.
template <int BITS>
inline int64_t unpack_simd(const uint8_t* src, int64_t nbytes, float* out, const float* s, const float* z) {
  return unpack_chunks<BITS>(src, nbytes, [&](__m128i codes, int64_t e) { store_codes(codes, out + e, s + e, z + e); });
}
#endif

#ifdef __AVX2__
// Rows of a KV format read where the pool stores them: 8 (or 16) consecutive elements as fp32, before any row
// scale, so dot products and weighted sums convert in registers instead of through a decoded tile.
struct F32Rows {
  using T = float;
  static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
#ifdef __AVX512F__
  static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
#endif
};
#endif

#ifdef __AVX512F__
struct F16Rows {
  using T = uint16_t;
  static __m256 load8(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static __m512 load16(const T* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

struct BF16Rows {  // bf16 is the top half of an fp32
  using T = uint16_t;
  static __m256 load8(const T* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static __m512 load16(const T* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
};

struct Int8Rows {
  using T = int8_t;
  static __m256 load8(const T* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static __m512 load16(const T* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

struct E5M2Rows {  // float8_e5m2 is the top byte of an fp16
  using T = uint8_t;
  static __m256 load8(const T* p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
  }
  static __m512 load16(const T* p) {
    const __m256i h = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm512_cvtph_ps(_mm256_slli_epi16(h, 8));
  }
};

// float8_e4m3fn as an fp16 with the same sign, exponent and mantissa bits (subnormals included): its value / 256,
// so a row scale read with these rows carries the factor E4M3_FACTOR.
constexpr float E4M3_FACTOR = 256.f;
struct E4M3Rows {  // sign-extended byte << 7 puts the sign in bits 14 and 15: clearing bit 14 leaves the fp16
  using T = uint8_t;
  static __m256 load8(const T* p) {
    const __m128i h = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
    return _mm256_cvtph_ps(_mm_and_si128(h, _mm_set1_epi16(static_cast<int16_t>(0xBF80))));
  }
  static __m512 load16(const T* p) {
    const __m256i h = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(h, _mm256_set1_epi16(static_cast<int16_t>(0xBF80))));
  }
};
#endif

#ifdef __AVX2__
// out[i] = dot(q, k + i * ld) for 8 rows, D a multiple of 8: each row's products stay in vector lanes and
// the 8 horizontal sums are done together (one transposing reduction instead of 8).
template <int D, class L = F32Rows>
inline void dot8(const float* q, const typename L::T* k, int64_t ld, float* out) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), L::load8(k + i * ld));
    __m256 b = _mm256_setzero_ps();
    for (int c = 8; c + 8 <= D; c += 16) {
      b = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), L::load8(k + i * ld + c), b);
      if (c + 16 <= D) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c + 8), L::load8(k + i * ld + c + 8), a);
    }
    acc[i] = _mm256_add_ps(a, b);
  }
  const __m256 a01 = _mm256_hadd_ps(acc[0], acc[1]), a23 = _mm256_hadd_ps(acc[2], acc[3]);
  const __m256 a45 = _mm256_hadd_ps(acc[4], acc[5]), a67 = _mm256_hadd_ps(acc[6], acc[7]);
  const __m256 lo = _mm256_hadd_ps(a01, a23), hi = _mm256_hadd_ps(a45, a67);
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
}

// dot(q, k) of one row, D a multiple of 8.
template <int D, class L = F32Rows>
inline float dot1(const float* q, const typename L::T* k) {
  __m256 a = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), L::load8(k + c), a);
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 s = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#endif

#ifdef __AVX512F__
// exp_nonpositive on 16 lanes, the same steps.
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 round = _mm512_set1_ps(kExpRound);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kExpLog2e), round), round);
  const __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Lo), _mm512_fnmadd_ps(n, _mm512_set1_ps(kExpLn2Hi), x));
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, f), f, f), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// Lanes [lo, hi) of the 16 from `at` (clipped to them).
inline __mmask16 lanes(int64_t at, int64_t lo, int64_t hi) {
  const int64_t a = std::max<int64_t>(lo - at, 0), b = std::min<int64_t>(hi - at, 16);
  return a >= b ? 0 : static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
}
#endif

// One online-softmax step of a row whose scores s[t0, t1) cover a block, of which [r0, r1) (non-empty) are in
// its range: s becomes the weights (0 outside the range), m and l (running max and sum) move on; returns the
// factor for what the row accumulated before this block.
inline float softmax_step(float* s, int64_t t0, int64_t t1, int64_t r0, int64_t r1, float& m, float& l) {
#ifdef __AVX512F__
  __m512 top16 = _mm512_set1_ps(m);
  for (int64_t r = r0 & ~int64_t{15}; r < r1; r += 16)
    top16 = _mm512_mask_max_ps(top16, lanes(r, r0, r1), top16, _mm512_maskz_loadu_ps(lanes(r, r0, r1), s + r));
  const float top = _mm512_reduce_max_ps(top16);
  __m512 sum16 = _mm512_setzero_ps();
  for (int64_t r = t0 & ~int64_t{15}; r < t1; r += 16) {
    const __mmask16 in = lanes(r, r0, r1);
    const __m512 w = _mm512_maskz_mov_ps(in, exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, s + r),
                                                                             _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(s + r, lanes(r, t0, t1), w);
    sum16 = _mm512_add_ps(sum16, w);
  }
  const float sum = _mm512_reduce_add_ps(sum16);
#else
  const float top = std::max(m, *std::max_element(s + r0, s + r1));
  float sum = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    s[r] = exp_nonpositive(s[r] - top);
    sum += s[r];
  }
  std::fill(s + t0, s + r0, 0.f);
  std::fill(s + r1, s + t1, 0.f);
#endif
  const float alpha = m == top ? 1.f : exp_nonpositive(m - top);
  l = l * alpha + sum;
  m = top;
  return alpha;
}

#ifdef __AVX512F__
// acc[g] = acc[g] * alpha[g] + sum over rows r in [t0, t1) of w[g * ws + r] * v[r] for K rows g of 64 values:
// the K accumulators stay in registers and each value row (stride ldv) is loaded once for all of them.
template <int K, class L = F32Rows>
inline void weigh_rows(const float* w, int64_t ws, const typename L::T* v, int64_t ldv, int64_t t0, int64_t t1,
                       const float* alpha, float* acc) {
  __m512 a[K][4];
  for (int g = 0; g < K; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * 64 + c * 16), _mm512_set1_ps(alpha[g]));
  for (int64_t r = t0; r < t1; ++r) {
    const typename L::T* vr = v + r * ldv;
    const __m512 v0 = L::load16(vr), v1 = L::load16(vr + 16), v2 = L::load16(vr + 32), v3 = L::load16(vr + 48);
    for (int g = 0; g < K; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * ws + r]);
      a[g][0] = _mm512_fmadd_ps(wg, v0, a[g][0]);
      a[g][1] = _mm512_fmadd_ps(wg, v1, a[g][1]);
      a[g][2] = _mm512_fmadd_ps(wg, v2, a[g][2]);
      a[g][3] = _mm512_fmadd_ps(wg, v3, a[g][3]);
    }
  }
  for (int g = 0; g < K; ++g)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + g * 64 + c * 16, a[g][c]);
}
#endif

}  // namespace kvforge
