#include "packed_rows.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <type_traits>

#include "vmath.h"

namespace kvforge {

#ifdef __AVX512F__
namespace {

constexpr int64_t DIM = 64, MAX_BLOCK = 64;

// The 64 codes of one packed row as 4 vectors of 16 floats.
template <int BITS>
__attribute__((always_inline)) inline void widen_row(const uint8_t* src, __m512 c[4]) {
  unpack_chunks<BITS>(src, DIM * BITS / 8, [&](__m128i codes, int64_t e) {
    c[e / 16] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes));
  });
}

// Lane i = the sum of the 16 lanes of v[i].
inline __m512 sum_each16(const __m512 v[16]) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// Code c of a packed row (the lowest bits first, as packing.py packs them).
template <int BITS>
inline float code_at(const uint8_t* row, int64_t c) {
  constexpr int PER = 8 / BITS;
  return static_cast<float>((row[c / PER] >> (c % PER * BITS)) & ((1 << BITS) - 1));
}

// folded[g] = q[g] * scale (per channel), bias[g] = q[g] . zero; rows of 16 keys at a time: each row's codes are
// widened once for all query rows, whose 16 products per row are summed together at the end of the 16. A row's
// outliers add q . (exact - decoded) to its bias, made before the dense pass (added into a score just stored, they
// waited on the store).
template <int BITS, int ROWS>
void scores_of(const Side& K, const OutlierList& outliers, int64_t b, int64_t h, const float* q, int64_t t0, int64_t t1,
               float* s, int64_t ss) {
  alignas(64) float scale[DIM], zero[DIM], folded[ROWS][DIM], bias[ROWS][MAX_BLOCK];
  K.channel_params(b, h, scale, zero);
  for (int g = 0; g < ROWS; ++g) {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < DIM; c += 16) {
      const __m512 qc = _mm512_loadu_ps(q + g * DIM + c);
      _mm512_store_ps(folded[g] + c, _mm512_mul_ps(qc, _mm512_load_ps(scale + c)));
      acc = _mm512_fmadd_ps(qc, _mm512_load_ps(zero + c), acc);
    }
    const __m512 all = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
    for (int64_t r16 = t0 & ~int64_t{15}; r16 < t1; r16 += 16) _mm512_store_ps(bias[g] + r16, all);
  }
  const uint8_t* rows = K.rows(b, h);
  const int64_t ld = K.heads * K.row_bytes();
  if (K.n_out)
    outliers.each(h, t0, t1, [&](int64_t r, int64_t c, float exact) {
      const float delta = exact - (code_at<BITS>(rows + r * ld, c) * scale[c] + zero[c]);
      for (int g = 0; g < ROWS; ++g) bias[g][r] += q[g * DIM + c] * delta;
    });
  __m512 part[ROWS][16];
  for (int g = 0; g < ROWS; ++g)
    for (int i = 0; i < 16; ++i) part[g][i] = _mm512_setzero_ps();
  for (int64_t r16 = t0 & ~int64_t{15}; r16 < t1; r16 += 16) {
    const int64_t lo = std::max(t0, r16), hi = std::min(t1, r16 + 16);
    for (int64_t r = lo; r < hi; ++r) {
      __m512 c[4];
      widen_row<BITS>(rows + r * ld, c);
      for (int g = 0; g < ROWS; ++g) {
        __m512 a = _mm512_mul_ps(c[0], _mm512_load_ps(folded[g]));
        a = _mm512_fmadd_ps(c[1], _mm512_load_ps(folded[g] + 16), a);
        a = _mm512_fmadd_ps(c[2], _mm512_load_ps(folded[g] + 32), a);
        part[g][r - r16] = _mm512_fmadd_ps(c[3], _mm512_load_ps(folded[g] + 48), a);
      }
    }
    for (int g = 0; g < ROWS; ++g)
      _mm512_mask_storeu_ps(s + g * ss + r16, lanes(r16, lo, hi),
                            _mm512_add_ps(sum_each16(part[g]), _mm512_load_ps(bias[g] + r16)));
  }
}

// acc[g] = acc[g] * alpha[g] + sum over rows of scaled[g][row] times the row's codes, plus extra[g]; the
// accumulators stay in registers (no call in between to spill them).
template <int BITS, int ROWS, int GROUPS>
void accumulate(const uint8_t* rows, int64_t ld, int64_t t0, int64_t t1,
                const float (&scaled)[ROWS][MAX_BLOCK][GROUPS], const float (&extra)[ROWS][DIM], const float* alpha,
                float* acc) {
  constexpr int CHUNKS_PER_GROUP = 4 / GROUPS;
  __m512 a[ROWS][4];
  for (int g = 0; g < ROWS; ++g)
    for (int k = 0; k < 4; ++k)
      a[g][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * DIM + 16 * k), _mm512_set1_ps(alpha[g]));
  for (int64_t i = 0; i < t1 - t0; ++i) {
    __m512 c[4];
    widen_row<BITS>(rows + i * ld, c);
    for (int g = 0; g < ROWS; ++g)
      for (int k = 0; k < 4; ++k)
        a[g][k] = _mm512_fmadd_ps(_mm512_set1_ps(scaled[g][i][k / CHUNKS_PER_GROUP]), c[k], a[g][k]);
  }
  for (int g = 0; g < ROWS; ++g)
    for (int k = 0; k < 4; ++k)
      _mm512_storeu_ps(acc + g * DIM + 16 * k, _mm512_add_ps(a[g][k], _mm512_load_ps(extra[g] + 16 * k)));
}

// Weights times each row's group scales are made for the whole block first, so the row loop only broadcasts them
// from memory; the zeros' share (sum of weight times zero per group) and the outliers' (weight times exact - decoded)
// are summed apart and added once at the end.
template <int BITS, int ROWS, int GROUPS>
void weigh_of(const Side& V, const OutlierList& outliers, int64_t b, int64_t h, const float* w, int64_t ws,
              int64_t t0, int64_t t1, const float* alpha, float* acc) {
  const int64_t n = t1 - t0;
  float scale[MAX_BLOCK * GROUPS], zero[MAX_BLOCK * GROUPS];
  V.token_params(b, h, t0, t1, scale, zero);
  float scaled[ROWS][MAX_BLOCK][GROUPS], zsum[ROWS][GROUPS] = {};
  for (int g = 0; g < ROWS; ++g)
    for (int64_t i = 0; i < n; ++i)
      for (int j = 0; j < GROUPS; ++j) {
        scaled[g][i][j] = w[g * ws + t0 + i] * scale[i * GROUPS + j];
        zsum[g][j] += w[g * ws + t0 + i] * zero[i * GROUPS + j];
      }
  alignas(64) float extra[ROWS][DIM];
  for (int g = 0; g < ROWS; ++g)
    for (int c = 0; c < DIM; c += 16) _mm512_store_ps(extra[g] + c, _mm512_set1_ps(zsum[g][c / (DIM / GROUPS)]));
  const uint8_t* rows = V.rows(b, h) + t0 * V.heads * V.row_bytes();
  const int64_t ld = V.heads * V.row_bytes();
  if (V.n_out)
    outliers.each(h, t0, t1, [&](int64_t r, int64_t c, float exact) {
      const int64_t j = (r - t0) * GROUPS + c / (DIM / GROUPS);
      const float delta = exact - (code_at<BITS>(rows + (r - t0) * ld, c) * scale[j] + zero[j]);
      for (int g = 0; g < ROWS; ++g) extra[g][c] += w[g * ws + r] * delta;
    });
  accumulate<BITS, ROWS, GROUPS>(rows, ld, t0, t1, scaled, extra, alpha, acc);
}

template <int BITS, int ROWS>
void weigh_groups(const Side& V, const OutlierList& outliers, int64_t b, int64_t h, const float* w, int64_t ws,
                  int64_t t0, int64_t t1, const float* alpha, float* acc) {
  switch (DIM / V.group) {
    case 1: return weigh_of<BITS, ROWS, 1>(V, outliers, b, h, w, ws, t0, t1, alpha, acc);
    case 2: return weigh_of<BITS, ROWS, 2>(V, outliers, b, h, w, ws, t0, t1, alpha, acc);
    default: return weigh_of<BITS, ROWS, 4>(V, outliers, b, h, w, ws, t0, t1, alpha, acc);
  }
}

// f(bits, rows) with both as std::integral_constant: 2 or 4 bits, 1 to PACKED_MAX_ROWS query rows.
template <class F>
void with_shape(int64_t bits, int64_t rows, F&& f) {
  TORCH_CHECK(rows >= 1 && rows <= PACKED_MAX_ROWS, "packed rows: 1 to ", PACKED_MAX_ROWS, " query rows, got ", rows);
  const auto by_rows = [&](auto b) {
    switch (rows) {
      case 1: return f(b, std::integral_constant<int, 1>{});
      case 2: return f(b, std::integral_constant<int, 2>{});
      case 3: return f(b, std::integral_constant<int, 3>{});
      case 4: return f(b, std::integral_constant<int, 4>{});
      case 5: return f(b, std::integral_constant<int, 5>{});
      default: return f(b, std::integral_constant<int, 6>{});
    }
  };
  if (bits == 4) by_rows(std::integral_constant<int, 4>{});
  else by_rows(std::integral_constant<int, 2>{});
}

}  // namespace

bool reads_packed(const Side& K, const Side& V) {
  const bool widths = K.bits == V.bits && (K.bits == 2 || K.bits == 4);
  return K.kind == UNIFORM_CHANNEL && V.kind == UNIFORM_TOKEN && widths && K.dim == DIM && V.dim == DIM &&
         (V.group == 16 || V.group == 32 || V.group == 64) && V.bs <= MAX_BLOCK;
}

void packed_scores(const Side& K, const OutlierList& outliers, int64_t b, int64_t h, const float* q, int64_t rows,
                   int64_t t0, int64_t t1, float* s, int64_t ss) {
  with_shape(K.bits, rows, [&](auto bits, auto r) {
    scores_of<decltype(bits)::value, decltype(r)::value>(K, outliers, b, h, q, t0, t1, s, ss);
  });
}

void packed_weigh(const Side& V, const OutlierList& outliers, int64_t b, int64_t h, const float* w, int64_t ws,
                  int64_t t0, int64_t t1, const float* alpha, float* acc, int64_t rows) {
  with_shape(V.bits, rows, [&](auto bits, auto r) {
    weigh_groups<decltype(bits)::value, decltype(r)::value>(V, outliers, b, h, w, ws, t0, t1, alpha, acc);
  });
}

#else

bool reads_packed(const Side&, const Side&) { return false; }
void packed_scores(const Side&, const OutlierList&, int64_t, int64_t, const float*, int64_t, int64_t, int64_t, float*,
                   int64_t) {
  TORCH_CHECK(false, "packed rows need AVX-512");
}
void packed_weigh(const Side&, const OutlierList&, int64_t, int64_t, const float*, int64_t, int64_t, int64_t,
                  const float*, float*, int64_t) {
  TORCH_CHECK(false, "packed rows need AVX-512");
}

#endif

}  // namespace kvforge
