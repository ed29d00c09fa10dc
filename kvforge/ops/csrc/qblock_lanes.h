// GGUF block weights read for qblock_matmul.cpp's few-row kernel as lane groups: 16 lanes, each one whole weight
// block (32 values; Q6_K: a 16-value sub-block), and per lane 4 values at each step, so that one VNNI vpdpbusd per
// step adds an exact int32 dot product per block and the fp32 scaling is done once per block, not per 4 values.
// A group is 16 consecutive 32-value blocks (512 values: two K-quant super-blocks of Q4_K / Q5_K) or one Q6_K
// super-block (256 values, 16 sub-blocks of 16); steps[s] lane l holds the unsigned codes of values 4s..4s+3 of
// lane l's block, with the block's scale d (and for the `_1` types, Q4_K and Q5_K, its offset m) per lane.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kquant_codes.h"
#include "qblock_matmul.h"

namespace kvforge {

template <int64_t T>
struct BlockTraits {
  static constexpr bool is_k = T == kQ4_K || T == kQ5_K || T == kQ6_K;  // super-blocks of 256
  static constexpr int64_t values = is_k ? 256 : 32;
  static constexpr int64_t bytes = T == kQ4_0 ? 18 : T == kQ4_1 ? 20 : T == kQ5_0 ? 22 : T == kQ5_1 ? 24
                                   : T == kQ4_K ? 144 : T == kQ5_K ? 176 : T == kQ6_K ? 210 : 34;
  static constexpr bool has_min = T == kQ4_1 || T == kQ5_1 || T == kQ4_K || T == kQ5_K;
  static constexpr int64_t codes_at = T == kQ4_0 ? 2 : T == kQ4_1 ? 4 : T == kQ5_0 ? 6 : T == kQ5_1 ? 8 : 2;
  static constexpr int offset = T == kQ4_0 ? 8 : T == kQ5_0 ? 16 : T == kQ8_0 ? 128 : T == kQ6_K ? 32 : 0;
  static constexpr int steps = lane_values(T) / 4;
  static constexpr int64_t group_values = 16 * lane_values(T);
  static constexpr int64_t group_bytes = group_values / values * bytes;
};

struct LaneGroup {
  __m512i steps[8];
  __m512 d, m;
};

namespace lanes {

// Lanes 4k + p of a, b, c, d (p = 0..3 picks the register) from dword i of each 128-bit lane k of r[p]: a 4 x 4
// transpose of dwords in every 128-bit lane.
inline void transpose4(const __m512i r[4], __m512i out[4]) {
  const __m512i t0 = _mm512_unpacklo_epi32(r[0], r[1]), t1 = _mm512_unpackhi_epi32(r[0], r[1]);
  const __m512i t2 = _mm512_unpacklo_epi32(r[2], r[3]), t3 = _mm512_unpackhi_epi32(r[2], r[3]);
  out[0] = _mm512_unpacklo_epi64(t0, t2);
  out[1] = _mm512_unpackhi_epi64(t0, t2);
  out[2] = _mm512_unpacklo_epi64(t1, t3);
  out[3] = _mm512_unpackhi_epi64(t1, t3);
}

// dwords[i] lane l = dword i of the 16 bytes at p + l * stride for blocks l < count, zero for the others.
inline void dwords_of(const uint8_t* p, int64_t stride, int count, __m512i dwords[4]) {
  __m512i r[4];
  for (int s = 0; s < 4; ++s) {
    __m512i v = _mm512_setzero_si512();
    for (int k = 0; k < 4 && 4 * k + s < count; ++k)
      v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (4 * k + s) * stride)), k);
    r[s] = v;
  }
  transpose4(r, dwords);
}

inline __m512 halves(__m512i words) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)); }

// 32-value block types: `count` (up to 16) blocks at `group`, zero lanes for the rest.
template <int64_t T>
inline void small_blocks(const uint8_t* group, int count, LaneGroup& out) {
  using Tr = BlockTraits<T>;
  const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                        _mm512_set1_epi32(static_cast<int>(Tr::bytes)));
  const __mmask16 present = static_cast<__mmask16>((1u << count) - 1);
  const __m512i heads = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, at, group, 1);  // d (and m) of each block: fp16 at bytes 0 (and 2)
  out.d = halves(heads);
  out.m = Tr::has_min ? halves(_mm512_srli_epi32(heads, 16)) : _mm512_setzero_ps();
  __m512i q[4];
  dwords_of(group + Tr::codes_at, Tr::bytes, count, q);
  if (T == kQ8_0) {  // values 0..15 then 16..31, signed codes flipped to unsigned by +128
    __m512i rest[4];
    dwords_of(group + Tr::codes_at + 16, Tr::bytes, count, rest);
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int s = 0; s < 4; ++s) {
      out.steps[s] = _mm512_xor_si512(q[s], flip);
      out.steps[4 + s] = _mm512_xor_si512(rest[s], flip);
    }
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int s = 0; s < 4; ++s) {  // value j: low nibble of byte j, j + 16: its high nibble
    out.steps[s] = _mm512_and_si512(q[s], low);
    out.steps[4 + s] = _mm512_and_si512(_mm512_srli_epi16(q[s], 4), low);
  }
  if (T == kQ5_0 || T == kQ5_1) {  // the fifth bits: bit j of the 32-bit word before the codes is value j's
    const __m512i fifth = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, at, group + Tr::codes_at - 4, 1);
    const __m512i spread = _mm512_set_epi8(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0, 12, 12, 12, 12, 8, 8, 8,
                                           8, 4, 4, 4, 4, 0, 0, 0, 0, 12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0,
                                           0, 12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i bit = _mm512_set1_epi32(0x08040201), sixteen = _mm512_set1_epi8(0x10);
    for (int s = 0; s < 8; ++s) {
      const __m512i four = _mm512_shuffle_epi8(_mm512_srli_epi32(fifth, 4 * s), spread);  // bits 4s.. in every byte
      out.steps[s] = _mm512_or_si512(out.steps[s], _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(four, bit), sixteen));
    }
  }
}

// Q4_K / Q5_K: super-blocks a (lanes 0..7, its 8 sub-blocks of 32) and b (lanes 8..15; zero lanes without it).
template <int64_t T>
inline void k4_blocks(const uint8_t* a, const uint8_t* b, LaneGroup& out) {
  const __m512 pa = kquant_scale_min(a), pb = b ? kquant_scale_min(b) : _mm512_setzero_ps();  // [d * scale, dmin * min]
  out.d = _mm512_permutex2var_ps(pa, _mm512_set_epi32(23, 22, 21, 20, 19, 18, 17, 16, 7, 6, 5, 4, 3, 2, 1, 0), pb);
  out.m = _mm512_xor_ps(_mm512_permutex2var_ps(pa, _mm512_set_epi32(31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12,
                                                                    11, 10, 9, 8), pb),
                        _mm512_set1_ps(-0.0f));
  constexpr int64_t qs = T == kQ4_K ? 16 : 48;  // 4 x 32 bytes: sub-block 2j in the low nibbles of part j, 2j + 1 high
  const __m512i a0 = _mm512_loadu_si512(a + qs), a1 = _mm512_loadu_si512(a + qs + 64);
  const __m512i b0 = b ? _mm512_loadu_si512(b + qs) : _mm512_setzero_si512();
  const __m512i b1 = b ? _mm512_loadu_si512(b + qs + 64) : _mm512_setzero_si512();
  const __m512i pick = _mm512_set_epi32(24, 24, 16, 16, 8, 8, 0, 0, 24, 24, 16, 16, 8, 8, 0, 0);  // + step: dword
  const __m512i nibble = _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512i fifth = _mm512_setzero_si512();
  if (T == kQ5_K)  // 32 bytes each: bit i of byte t is value t's fifth bit in sub-block i
    fifth = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16))),
                               b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16)) : _mm256_setzero_si256(), 1);
  const __m512i sub = _mm512_set_epi32(7, 6, 5, 4, 3, 2, 1, 0, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i fifth_at = _mm512_set_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int s = 0; s < 8; ++s) {
    const __m512i idx = _mm512_add_epi32(pick, _mm512_set1_epi32(s));
    const __m512i both = _mm512_mask_blend_epi32(0xFF00, _mm512_permutex2var_epi32(a0, idx, a1),
                                                 _mm512_permutex2var_epi32(b0, idx, b1));
    __m512i v = _mm512_and_si512(_mm512_srlv_epi32(both, nibble), low);
    if (T == kQ5_K) {
      const __m512i h = _mm512_permutexvar_epi32(_mm512_add_epi32(fifth_at, _mm512_set1_epi32(s)), fifth);
      v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, sub), _mm512_set1_epi8(1)), 4));
    }
    out.steps[s] = v;
  }
}

// Q6_K: one super-block, lane l its sub-block l of 16 values (4 steps).
inline void k6_blocks(const uint8_t* sb, LaneGroup& out) {
  // sub-block l: half h = l / 8, part g = l % 8 / 2, t0 = 16 * (l % 2); value t of (h, g) is the low (g < 2) or high
  // nibble of ql byte 64h + 32 (g % 2) + t, with bits 2g, 2g + 1 of qh byte 32h + t above it
  const __m512i ql_at = _mm512_set_epi32(28, 24, 20, 16, 28, 24, 20, 16, 12, 8, 4, 0, 12, 8, 4, 0);
  const __m512i ql_shift = _mm512_set_epi32(4, 4, 4, 4, 0, 0, 0, 0, 4, 4, 4, 4, 0, 0, 0, 0);
  const __m512i qh_at = _mm512_set_epi32(12, 8, 12, 8, 12, 8, 12, 8, 4, 0, 4, 0, 4, 0, 4, 0);
  const __m512i qh_shift = _mm512_set_epi32(6, 6, 4, 4, 2, 2, 0, 0, 6, 6, 4, 4, 2, 2, 0, 0);
  const __m512i l0 = _mm512_loadu_si512(sb), l1 = _mm512_loadu_si512(sb + 64), qh = _mm512_loadu_si512(sb + 128);
  for (int s = 0; s < 4; ++s) {
    const __m512i step = _mm512_set1_epi32(s);
    const __m512i lo = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_permutex2var_epi32(l0, _mm512_add_epi32(ql_at, step), l1), ql_shift),
        _mm512_set1_epi8(0x0F));
    const __m512i hi = _mm512_and_si512(
        _mm512_srlv_epi32(_mm512_permutexvar_epi32(_mm512_add_epi32(qh_at, step), qh), qh_shift), _mm512_set1_epi8(3));
    out.steps[s] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 4));
  }
  const __m512 scales = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 192))));
  out.d = _mm512_mul_round_ps(_mm512_set1_ps(_cvtsh_ss(static_cast<uint16_t>(sb[208] | (sb[209] << 8)))), scales,
                              kKquantRound);
  out.m = _mm512_setzero_ps();
}

}  // namespace lanes

// Lane group g of a weight row of K values; lanes past the row's end are zeros (codes and scales).
template <int64_t T>
inline void lane_group(const uint8_t* row, int64_t K, int64_t g, LaneGroup& out) {
  using Tr = BlockTraits<T>;
  const uint8_t* group = row + g * Tr::group_bytes;
  const int64_t blocks = std::min<int64_t>((K - g * Tr::group_values) / Tr::values, Tr::group_values / Tr::values);
  if constexpr (T == kQ6_K) lanes::k6_blocks(group, out);
  else if constexpr (T == kQ4_K || T == kQ5_K) lanes::k4_blocks<T>(group, blocks > 1 ? group + Tr::bytes : nullptr, out);
  else lanes::small_blocks<T>(group, static_cast<int>(blocks), out);
}

}  // namespace kvforge
