// kvforge::qblock_linear and kvforge::qblock_panel_linear: y = x @ W^T (+ bias) with W held as GGUF blocks of 32
// weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or K-quant super-blocks of 256 (Q4_K, Q5_K, Q6_K; ops/qblocks.py and
// ops/kquants.py describe the layouts and the torch references). A K-quant chunk of 64 columns is one quarter of a
// super-block: its codes widened the same way, its sub-block scales (d * scale, -(dmin * min)) as per-lane d and m.
// Few rows (decode): x rounded to int8 per 32-column block (int8_matmul.h's quantize_rows); per 64-column chunk two
// weight blocks are widened in registers to 64 unsigned codes (nibbles split, Q5's fifth bits from a byte mask, Q8's
// signed codes flipped by +128) and multiplied with every row of x by AVX-512 VNNI (vpdpbusd: 16 lanes of exact
// int32 sums over 4 columns, started from -offset * the lane's sum of x so that the code's offset is undone); each
// lane to fp32, times (weight block scale * x block scale), added into an fp32 lane (and for the `_1` types
// m * x scale * the lane's sum of x), with explicit rounding so nothing is fused into an FMA; the lanes summed in a
// fixed tree. The reference repeats this, so the two agree bit for bit. Four weight rows at a time share each row
// of x. More rows: each triple of 16-row panels is dequantized (d * (code - offset) + m, gguf's order) into an
// L2-resident fp32 buffer, then panel_matmul.h's tiles run on it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "panel_matmul.h"
#include "qblock_matmul.h"

#if KVFORGE_INT8_VNNI
#include <immintrin.h>

#include "kquant_codes.h"
#include "qblock_lanes.h"
#endif

namespace kvforge {

bool is_qblock_type(int64_t qtype) {
  return qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0 || qtype == kQ4_K ||
         qtype == kQ5_K || qtype == kQ6_K || qtype == kQ8_0L;
}

int64_t qblock_values(int64_t qtype) { return qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K ? 256 : 32; }

int64_t qblock_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 34;
  }
}

#if KVFORGE_INT8_VNNI
namespace {

constexpr int64_t kBlock = 32, kChunk = 64, kLanes = 16;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
constexpr int kRows = 4;  // weight rows per tile of the few-row kernel

template <int64_t T>
using Traits = BlockTraits<T>;

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The 64 unsigned codes of blocks a (bytes 0..31) and b (32..63; zeros when b is null), with their scales (and
// offsets m) as lanes 0..7 for a and 8..15 for b.
template <int64_t T>
inline __m512i codes(const uint8_t* a, const uint8_t* b, __m512& d, __m512& m) {
  using Tr = Traits<T>;
  uint32_t head_a, head_b = 0;  // d (and m) of each block: fp16 at bytes 0 (and 2)
  std::memcpy(&head_a, a, 4);
  if (b) std::memcpy(&head_b, b, 4);
  const __m512 heads = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_set_epi32(0, 0, static_cast<int>(head_b),
                                                                          static_cast<int>(head_a))));
  d = _mm512_permutexvar_ps(_mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0), heads);
  if (Tr::has_min) m = _mm512_permutexvar_ps(_mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1), heads);
  if (T == kQ8_0) {
    const __m256i qa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + Tr::codes_at));
    const __m256i qb = b ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + Tr::codes_at)) : _mm256_setzero_si256();
    return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qa), qb, 1),
                            _mm512_set1_epi8(static_cast<char>(0x80)));
  }
  const __m128i qa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + Tr::codes_at));
  const __m128i qb = b ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + Tr::codes_at)) : _mm_setzero_si128();
  const __m256i ab = _mm256_inserti128_si256(_mm256_castsi128_si256(qa), qb, 1);
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i lo = _mm256_and_si256(ab, low), hi = _mm256_and_si256(_mm256_srli_epi16(ab, 4), low);
  __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo a, lo b, hi a, hi b]
  v = _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));           // [lo a, hi a, lo b, hi b]: value order
  if (T == kQ5_0 || T == kQ5_1) {
    uint32_t ha = 0, hb = 0;
    std::memcpy(&ha, a + Tr::codes_at - 4, 4);
    if (b) std::memcpy(&hb, b + Tr::codes_at - 4, 4);
    const __mmask64 fifth = _cvtu64_mask64(static_cast<uint64_t>(ha) | (static_cast<uint64_t>(hb) << 32));
    v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(fifth, _mm512_set1_epi8(0x10)));
  }
  return v;
}

// Weight rows [n, n + R) (their lane groups in `w`, [groups][R]) against rows [m0, m0 + MR) of x: per group and
// lane an exact int32 block dot product (from -offset * the lane's sum of x), to fp32, times (weight block scale *
// x block scale), added into an fp32 lane (for the `_1` types and Q4_K / Q5_K, then m * x scale * the lane's sum of
// x), with explicit rounding so nothing is fused into an FMA; the lanes summed in a fixed tree.
template <int64_t T, int R, int MR>
inline void tile(const BlockRows& xr, const LaneGroup* w, float* y, int64_t stride, int64_t n, int64_t m0) {
  constexpr int S = BlockTraits<T>::steps;
  constexpr bool has_min = BlockTraits<T>::has_min;
  __m512 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < xr.groups; ++g) {
    for (int m = 0; m < MR; ++m) {
      const int64_t lane = ((m0 + m) * xr.groups + g) * kLanes;
      const int8_t* xg = xr.q.data() + lane * S * 4;
      __m512i xs[S];
      for (int s = 0; s < S; ++s) xs[s] = _mm512_loadu_si512(xg + s * 64);
      const __m512i fix = _mm512_loadu_si512(xr.fix.data() + lane);
      const __m512 dx = _mm512_loadu_ps(xr.d.data() + lane);
      const __m512 sx = has_min ? _mm512_loadu_ps(xr.sx.data() + lane) : _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        const LaneGroup& wg = w[g * R + r];
        __m512i dot = fix;
        for (int s = 0; s < S; ++s) dot = _mm512_dpbusd_epi32(dot, wg.steps[s], xs[s]);
        const __m512 scale = _mm512_mul_round_ps(wg.d, dx, kRound);
        acc[r][m] = _mm512_add_round_ps(acc[r][m], _mm512_mul_round_ps(_mm512_cvtepi32_ps(dot), scale, kRound), kRound);
        if (has_min) acc[r][m] = _mm512_add_round_ps(acc[r][m], _mm512_mul_round_ps(wg.m, sx, kRound), kRound);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) y[(m0 + m) * stride + n + r] = lane_sum(acc[r][m]);
}

// Weight rows [n, n + R) against every row of x: their lane groups read once into `w`, then every tile of x rows.
template <int64_t T, int R>
void rows_of(const BlockRows& xr, const uint8_t* blocks, LaneGroup* w, float* y, int64_t stride, int64_t M, int64_t K,
             int64_t n) {
  const int64_t row_bytes = K / BlockTraits<T>::values * BlockTraits<T>::bytes;
  for (int r = 0; r < R; ++r) {
    const uint8_t* row = blocks + (n + r) * row_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(row + R * row_bytes), _MM_HINT_T0);
    for (int64_t g = 0; g < xr.groups; ++g) lane_group<T>(row, K, g, w[g * R + r]);
  }
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile<T, R, 4>(xr, w, y, stride, n, m0);
  switch (M - m0) {
    case 1: tile<T, R, 1>(xr, w, y, stride, n, m0); break;
    case 2: tile<T, R, 2>(xr, w, y, stride, n, m0); break;
    case 3: tile<T, R, 3>(xr, w, y, stride, n, m0); break;
    default: break;
  }
}

template <int64_t T>
void rows_range(const BlockRows& xr, const uint8_t* w, float* y, int64_t stride, int64_t M, int64_t K, int64_t n0,
                int64_t n1) {
  std::vector<LaneGroup> groups(xr.groups * kRows);
  int64_t n = n0;
  for (; n + kRows <= n1; n += kRows) rows_of<T, kRows>(xr, w, groups.data(), y, stride, M, K, n);
  for (; n < n1; ++n) rows_of<T, 1>(xr, w, groups.data(), y, stride, M, K, n);
}

// Row n of the weight dequantized into out[0..K): d * (code - offset) (+ m), as ops/qblocks.py's dequantize.
template <int64_t T>
void dequantize_row(const uint8_t* row, float* out, int64_t K) {
  using Tr = Traits<T>;
  const __m512i offset = _mm512_set1_epi32(Tr::offset);
  if constexpr (Tr::is_k) {
    alignas(64) uint8_t u[kChunk];
    for (int64_t c = 0; c < K / kChunk; ++c) {
      __m512 d, m = _mm512_setzero_ps();
      _mm512_store_si512(u, kquant_codes<T>(row, c, d, m));
      for (int g = 0; g < 4; ++g) {  // 16 weights: lanes 4g..4g+3
        const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(4 * g), _mm512_srli_epi32(
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 2));
        const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(u + 16 * g));
        const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), offset));
        __m512 v = _mm512_mul_round_ps(_mm512_permutexvar_ps(lanes, d), q, kRound);
        if (Tr::has_min) v = _mm512_add_round_ps(v, _mm512_permutexvar_ps(lanes, m), kRound);
        _mm512_storeu_ps(out + c * kChunk + 16 * g, v);
      }
    }
    return;
  }
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const uint8_t* block = row + b * Tr::bytes;
    __m512 lanes_d, lanes_m;  // lanes 8..15 are block b's (none here)
    const __m512i u = codes<T>(block, nullptr, lanes_d, lanes_m);
    const __m512 d = _mm512_set1_ps(half_at(block));
    const __m512 m = Tr::has_min ? _mm512_set1_ps(half_at(block + 2)) : _mm512_setzero_ps();
    for (int half = 0; half < 2; ++half) {
      const __m128i bytes = half ? _mm512_extracti32x4_epi32(u, 1) : _mm512_castsi512_si128(u);
      const __m512 q = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(bytes), offset));
      __m512 v = _mm512_mul_round_ps(d, q, kRound);
      if (Tr::has_min) v = _mm512_add_round_ps(v, m, kRound);
      _mm512_storeu_ps(out + b * kBlock + half * 16, v);
    }
  }
}

// Panels [p, p + np) dequantized into buffer [np, K, 16] (zeros past N), then the panel tiles on them.
template <int64_t T>
void panel_range(const float* x, const uint8_t* w, const float* bias, float* y, int64_t M, int64_t K, int64_t N,
                 int64_t p0, int64_t p1, float* buffer, float* rows) {
  const int64_t row_bytes = K / Traits<T>::values * Traits<T>::bytes;
  const __m512i across = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(K)));
  std::vector<uint8_t> natural(T == kQ8_0L ? row_bytes : 0);
  for (int64_t p = p0; p < p1; p += kPanelsPerTile) {
    const int64_t np = std::min(kPanelsPerTile, p1 - p);
    for (int64_t j = 0; j < np; ++j) {
      for (int64_t r = 0; r < kPanel; ++r) {
        const int64_t n = (p + j) * kPanel + r;
        if (n >= N) {
          std::memset(rows + r * K, 0, K * sizeof(float));
        } else if constexpr (T == kQ8_0L) {
          q8_lanes_unpack_row(w, n, K, natural.data());
          dequantize_row<kQ8_0>(natural.data(), rows + r * K, K);
        } else {
          dequantize_row<T>(w + n * row_bytes, rows + r * K, K);
        }
      }
      float* out = buffer + j * K * kPanel;
      for (int64_t k = 0; k < K; ++k) _mm512_storeu_ps(out + k * kPanel, _mm512_i32gather_ps(across, rows + k, 4));
    }
    panel_tiles(x, buffer, bias, y, M, K, N, p, np);
  }
}

void check(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t n, const char* op) {
  TORCH_CHECK(is_qblock_type(qtype), op, ": ggml type ", qtype,
              " is not Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K or Q8_0 in lane groups (1008)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) % qblock_values(qtype) == 0, op,
              ": x [M, K] fp32 with K a multiple of the block's values (32; 256 for K-quants) expected");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(0) == n &&
                  blocks.size(1) == x.size(1) / qblock_values(qtype) * qblock_bytes(qtype),
              op, ": blocks [n, K / block values * block bytes] uint8 expected");
  TORCH_CHECK(qtype != kQ8_0L || q8_lanes_fits(n, x.size(1)), op,
              ": Q8_0 lane layout needs n a multiple of 4 and K a multiple of 512 or 128 past one");
}

at::Tensor qblock_linear_cpu(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype, int64_t n,
                             const c10::optional<at::Tensor>& bias) {
  check(x_in, blocks_in, qtype, n, "qblock_linear");
  const at::Tensor x = x_in.contiguous(), blocks = blocks_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const BlockRows xr = quantize_block_rows(x.data_ptr<float>(), M, K, qtype == kQ8_0L ? kQ8_0 : qtype);
  at::Tensor y = at::empty({M, n}, x.options());
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  constexpr int64_t kRowsPerTask = 64;
  at::parallel_for(0, (n + kRowsPerTask - 1) / kRowsPerTask, 1, [&](int64_t begin, int64_t end) {
    qblock_rows(xr, w, qtype, yp, n, M, K, begin * kRowsPerTask, std::min(n, end * kRowsPerTask));
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

at::Tensor qblock_panel_linear_cpu(const at::Tensor& x_in, const at::Tensor& blocks_in, int64_t qtype, int64_t n,
                                   const c10::optional<at::Tensor>& bias_in) {
  check(x_in, blocks_in, qtype, n, "qblock_panel_linear");
  const at::Tensor x = x_in.contiguous(), blocks = blocks_in.contiguous();
  const bool has_bias = bias_in.has_value() && bias_in->defined();
  const at::Tensor bias = has_bias ? bias_in->contiguous() : at::Tensor();
  const int64_t M = x.size(0), K = x.size(1), P = (n + kPanel - 1) / kPanel;
  at::Tensor y = at::empty({M, n}, x.options());
  const float *xp = x.data_ptr<float>(), *bp = has_bias ? bias.data_ptr<float>() : nullptr;
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t triples = (P + kPanelsPerTile - 1) / kPanelsPerTile;
  const int64_t block = std::max<int64_t>(8, 131072 / K / 8 * 8);  // rows of x per pass: 512 KB, as panel_linear
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t rows = std::min(block, M - m0);
    at::parallel_for(0, triples, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> storage(K * kPanel * (kPanelsPerTile + 1) + kPanel);
      float* buffer = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
      float* scratch = buffer + K * kPanel * kPanelsPerTile;
      const int64_t p0 = begin * kPanelsPerTile, p1 = std::min(P, end * kPanelsPerTile);
      const float* xm = xp + m0 * K;
      float* ym = yp + m0 * n;
      switch (qtype) {
        case kQ4_0: panel_range<kQ4_0>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ4_1: panel_range<kQ4_1>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ5_0: panel_range<kQ5_0>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ5_1: panel_range<kQ5_1>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ4_K: panel_range<kQ4_K>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ5_K: panel_range<kQ5_K>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ6_K: panel_range<kQ6_K>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        case kQ8_0L: panel_range<kQ8_0L>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
        default: panel_range<kQ8_0>(xm, w, bp, ym, rows, K, n, p0, p1, buffer, scratch); break;
      }
    });
  }
  return y;
}

}  // namespace

BlockRows quantize_block_rows(const float* x, int64_t M, int64_t K, int64_t qtype) {
  BlockRows out{quantize_rows(x, M, K)};
  const QuantizedRows& xq = out.xq;
  const int64_t width = lane_values(qtype), per_group = kLanes * width, chunk_lanes = xq.chunks * kLanes;
  const int offset = qtype == kQ4_0 ? 8 : qtype == kQ5_0 ? 16 : qtype == kQ8_0 ? 128 : qtype == kQ6_K ? 32 : 0;
  out.groups = (K + per_group - 1) / per_group;
  out.steps = width / 4;
  out.q.assign(M * out.groups * per_group, 0);
  out.fix.assign(M * out.groups * kLanes, 0);
  out.d.assign(out.fix.size(), 0.0f);
  out.sx.assign(out.fix.size(), 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < out.groups; ++g)
      for (int64_t l = 0; l < kLanes; ++l) {
        const int64_t v0 = g * per_group + l * width, lane = (m * out.groups + g) * kLanes + l;
        if (v0 >= K) break;
        const int8_t* src = xq.q.data() + m * xq.chunks * kChunk + v0;
        int32_t sum = 0;
        for (int64_t s = 0; s < out.steps; ++s) {
          std::memcpy(out.q.data() + (m * out.groups + g) * per_group + s * 64 + 4 * l, src + 4 * s, 4);
          for (int j = 0; j < 4; ++j) sum += src[4 * s + j];
        }
        out.d[lane] = xq.d[m * chunk_lanes + v0 / 4];
        out.fix[lane] = -offset * sum;
        out.sx[lane] = out.d[lane] * static_cast<float>(sum);
      }
  return out;
}

void qblock_rows(const BlockRows& xr, const uint8_t* blocks, int64_t qtype, float* y, int64_t stride, int64_t M,
                 int64_t K, int64_t n0, int64_t n1) {
  switch (qtype) {
    case kQ4_0: return rows_range<kQ4_0>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ4_1: return rows_range<kQ4_1>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ5_0: return rows_range<kQ5_0>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ5_1: return rows_range<kQ5_1>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ4_K: return rows_range<kQ4_K>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ5_K: return rows_range<kQ5_K>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ6_K: return rows_range<kQ6_K>(xr, blocks, y, stride, M, K, n0, n1);
    case kQ8_0L: return q8_lanes_rows(xr, blocks, y, stride, M, K, n0, n1);
    default: return rows_range<kQ8_0>(xr, blocks, y, stride, M, K, n0, n1);
  }
}
#endif

}  // namespace kvforge

#if KVFORGE_INT8_VNNI
TORCH_LIBRARY_IMPL(kvforge, CPU, m) {
  m.impl("qblock_linear", &kvforge::qblock_linear_cpu);
  m.impl("qblock_panel_linear", &kvforge::qblock_panel_linear_cpu);
}
#endif
