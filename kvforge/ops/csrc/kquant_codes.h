// GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K: 256 weights, ops/kquants.py) read for qblock_matmul.cpp's kernels:
// chunk c (64 columns, a quarter super-block) as 64 unsigned codes in value order, with per-lane (4 columns) d and,
// for Q4_K / Q5_K, m = -(dmin * min): the same fp32 products as gguf's dequantization.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "qblock_matmul.h"

namespace kvforge {

constexpr int64_t kquant_bytes(int64_t qtype) { return qtype == kQ4_K ? 144 : qtype == kQ5_K ? 176 : 210; }
constexpr int kKquantRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// A Q4_K / Q5_K super-block's [d * scale x8, dmin * min x8] (its 6-bit scales and mins unpacked as ggml does).
inline __m512 kquant_scale_min(const uint8_t* sb) {
  uint32_t u0, u1, u2;
  std::memcpy(&u0, sb + 4, 4);
  std::memcpy(&u1, sb + 8, 4);
  std::memcpy(&u2, sb + 12, 4);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  const uint32_t scales_low = u0 & k6, scales_high = (u2 & k4) | (((u0 >> 6) & k2) << 4);
  const uint32_t mins_low = u1 & k6, mins_high = ((u2 >> 4) & k4) | (((u1 >> 6) & k2) << 4);
  const __m128i packed = _mm_set_epi32(static_cast<int>(mins_high), static_cast<int>(mins_low),
                                       static_cast<int>(scales_high), static_cast<int>(scales_low));
  const __m512 sm = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed));
  int32_t heads;  // d and dmin, fp16
  std::memcpy(&heads, sb, 4);
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 dd = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(heads))));
  return _mm512_mul_round_ps(dd, sm, kKquantRound);
}

// The 64 unsigned codes of chunk c (64 columns) of a K-quant weight row, with per-lane d (and m).
template <int64_t T>
inline __m512i kquant_codes(const uint8_t* row, int64_t c, __m512& d, __m512& m) {
  const uint8_t* sb = row + (c / 4) * kquant_bytes(T);
  const int j = static_cast<int>(c % 4);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if (T == kQ6_K) {
    const int h = j / 2, upper = j % 2;  // 128-value half; its low or high nibbles
    __m512i ql = _mm512_loadu_si512(sb + 64 * h);
    if (upper) ql = _mm512_srli_epi16(ql, 4);
    ql = _mm512_and_si512(ql, _mm512_set1_epi8(0x0F));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 128 + 32 * h));
    __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    hb = _mm512_srli_epi16(hb, 4 * upper);
    hb = _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(3)), 4);
    int32_t s4;
    std::memcpy(&s4, sb + 192 + 4 * j, 4);
    const __m128 sc = _mm_mul_ps(_mm_set1_ps(_cvtsh_ss(static_cast<uint16_t>(sb[208] | (sb[209] << 8)))), _mm_cvtepi32_ps(_mm_cvtepi8_epi32(_mm_cvtsi32_si128(s4))));
    d = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
                              _mm512_castps128_ps512(sc));
    return _mm512_or_si512(ql, hb);
  }
  // d * scale and -(dmin * min) per lane
  const __m512 prod = kquant_scale_min(sb);
  const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i sub = _mm512_add_epi32(pick, _mm512_set1_epi32(2 * j));
  d = _mm512_permutexvar_ps(sub, prod);
  m = _mm512_xor_ps(_mm512_permutexvar_ps(_mm512_add_epi32(sub, _mm512_set1_epi32(8)), prod),
                    _mm512_set1_ps(-0.0f));
  const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + (T == kQ4_K ? 16 : 48) + 32 * j));
  const __m256i lo = _mm256_and_si256(q, low4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
  __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  if (T == kQ5_K) {
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + 16));
    const uint64_t bits = static_cast<uint64_t>(_mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(1 << (2 * j))))) |
                          (static_cast<uint64_t>(_mm256_test_epi8_mask(qh, _mm256_set1_epi8(static_cast<char>(2 << (2 * j))))) << 32);
    v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), _mm512_set1_epi8(0x10)));
  }
  return v;
}

}  // namespace kvforge
