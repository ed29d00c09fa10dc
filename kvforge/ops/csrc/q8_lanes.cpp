// Q8_0 weights in the lane layout (ops/q8_lanes.py): rows in fours, each row's whole lane groups (16 fp16 scales,
// then 8 steps x 64 bytes of unsigned codes) and one group of the 4 rows' last 4 blocks (lane l: row l / 4, block
// l % 4). The few-row kernel's arithmetic (qblock_matmul.cpp's tile on Q8_0) with the groups read by plain loads;
// the tail group's lanes hold 4 rows, so its 8 integer dot products serve 4 rows, and each row's 4 lanes are moved
// to lanes 0..3 of its accumulator (lanes 4..15 of a Q8_0 tail add zeros there, so they are left as they are).
#include <cstring>
#include <vector>

#include "qblock_matmul.h"

#if KVFORGE_INT8_VNNI
namespace kvforge {
namespace {

constexpr int64_t kLanes = 16, kSteps = 8, kGroupBytes = 544, kQuad = 4, kBlockBytes = 34;
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// x's lane group `tail` with lane l holding lane l % 4: the 4 rows' tail blocks side by side.
struct TailRows {
  std::vector<int8_t> q;     // [M, 8 steps, 16, 4]
  std::vector<int32_t> fix;  // [M, 16]
  std::vector<float> d;      // [M, 16]
};

TailRows tail_rows(const BlockRows& xr, int64_t M, int64_t tail) {
  TailRows t{std::vector<int8_t>(M * kSteps * 64), std::vector<int32_t>(M * kLanes), std::vector<float>(M * kLanes)};
  for (int64_t m = 0; m < M; ++m) {
    const int64_t lane0 = (m * xr.groups + tail) * kLanes;
    for (int64_t l = 0; l < kLanes; ++l) {
      for (int64_t s = 0; s < kSteps; ++s)
        std::memcpy(&t.q[(m * kSteps + s) * 64 + 4 * l], &xr.q[lane0 * kSteps * 4 + s * 64 + 4 * (l % kQuad)], 4);
      t.fix[m * kLanes + l] = xr.fix[lane0 + l % kQuad];
      t.d[m * kLanes + l] = xr.d[lane0 + l % kQuad];
    }
  }
  return t;
}

inline __m512 scales_at(const uint8_t* group) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group)));
}

// One group's exact int32 block dot products, from fix (-128 * the lane's sum of x).
inline __m512i dots(const uint8_t* group, const __m512i* xs, __m512i fix) {
  for (int s = 0; s < kSteps; ++s)
    fix = _mm512_dpbusd_epi32(fix, _mm512_loadu_si512(group + 32 + 64 * s), xs[s]);
  return fix;
}

// The 4 rows of `quad` (G whole groups each, then the tail group when `tail`) against rows [m0, m0 + MR) of x.
template <int MR>
void quad_tile(const BlockRows& xr, const TailRows& xt, const uint8_t* quad, int64_t G, bool tail, float* y,
               int64_t stride, int64_t n, int64_t m0) {
  __m512 acc[kQuad][MR];
  for (int r = 0; r < kQuad; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int m = 0; m < MR; ++m) {
      const int64_t lane = ((m0 + m) * xr.groups + g) * kLanes;
      __m512i xs[kSteps];
      for (int s = 0; s < kSteps; ++s) xs[s] = _mm512_loadu_si512(xr.q.data() + lane * kSteps * 4 + s * 64);
      const __m512i fix = _mm512_loadu_si512(xr.fix.data() + lane);
      const __m512 dx = _mm512_loadu_ps(xr.d.data() + lane);
      for (int r = 0; r < kQuad; ++r) {
        const uint8_t* wg = quad + (r * G + g) * kGroupBytes;
        const __m512 scale = _mm512_mul_round_ps(scales_at(wg), dx, kRound);
        const __m512 part = _mm512_mul_round_ps(_mm512_cvtepi32_ps(dots(wg, xs, fix)), scale, kRound);
        acc[r][m] = _mm512_add_round_ps(acc[r][m], part, kRound);
      }
    }
  }
  if (tail) {
    const uint8_t* wt = quad + kQuad * G * kGroupBytes;
    const __m512 wd = scales_at(wt);
    for (int m = 0; m < MR; ++m) {
      const int64_t row = m0 + m;
      __m512i xs[kSteps];
      for (int s = 0; s < kSteps; ++s) xs[s] = _mm512_loadu_si512(xt.q.data() + (row * kSteps + s) * 64);
      const __m512i fix = _mm512_loadu_si512(xt.fix.data() + row * kLanes);
      const __m512 scale = _mm512_mul_round_ps(wd, _mm512_loadu_ps(xt.d.data() + row * kLanes), kRound);
      const __m512 part = _mm512_mul_round_ps(_mm512_cvtepi32_ps(dots(wt, xs, fix)), scale, kRound);
      for (int r = 0; r < kQuad; ++r) {
        const __m512 mine = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32(4 * r),
                                                                   _mm512_set_epi32(3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0)), part);
        acc[r][m] = _mm512_mask_add_round_ps(acc[r][m], 0x000F, acc[r][m], mine, kRound);
      }
    }
  }
  for (int r = 0; r < kQuad; ++r)
    for (int m = 0; m < MR; ++m) y[(m0 + m) * stride + n + r] = lane_sum(acc[r][m]);
}

}  // namespace

bool q8_lanes_fits(int64_t n, int64_t K) {
  return n % kQuad == 0 && K % 32 == 0 && (K / 32 % kLanes == 0 || K / 32 % kLanes == kQuad);
}

void q8_lanes_rows(const BlockRows& xr, const uint8_t* blocks, float* y, int64_t stride, int64_t M, int64_t K,
                   int64_t n0, int64_t n1) {
  const int64_t G = K / 32 / kLanes, quad_bytes = kQuad * (K / 32) * kBlockBytes;
  const bool tail = K / 32 % kLanes != 0;
  const TailRows xt = tail ? tail_rows(xr, M, G) : TailRows{};
  for (int64_t n = n0; n < n1; n += kQuad) {
    const uint8_t* quad = blocks + n / kQuad * quad_bytes;
    _mm_prefetch(reinterpret_cast<const char*>(quad + quad_bytes), _MM_HINT_T0);
    int64_t m0 = 0;
    for (; m0 + 4 <= M; m0 += 4) quad_tile<4>(xr, xt, quad, G, tail, y, stride, n, m0);
    switch (M - m0) {
      case 1: quad_tile<1>(xr, xt, quad, G, tail, y, stride, n, m0); break;
      case 2: quad_tile<2>(xr, xt, quad, G, tail, y, stride, n, m0); break;
      case 3: quad_tile<3>(xr, xt, quad, G, tail, y, stride, n, m0); break;
      default: break;
    }
  }
}

void q8_lanes_unpack_row(const uint8_t* blocks, int64_t n, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32, G = nb / kLanes, tail = nb % kLanes, r = n % kQuad;
  const uint8_t* quad = blocks + n / kQuad * kQuad * nb * kBlockBytes;
  auto block = [&](const uint8_t* group, int64_t lanes, int64_t l, uint8_t* dst) {
    std::memcpy(dst, group + 2 * l, 2);
    for (int64_t s = 0; s < kSteps; ++s)
      for (int j = 0; j < 4; ++j) dst[2 + 4 * s + j] = group[2 * lanes + s * lanes * 4 + 4 * l + j] ^ 0x80;
  };
  for (int64_t g = 0; g < G; ++g)
    for (int64_t l = 0; l < kLanes; ++l)
      block(quad + (r * G + g) * kGroupBytes, kLanes, l, out + (g * kLanes + l) * kBlockBytes);
  for (int64_t b = 0; b < tail; ++b)
    block(quad + kQuad * G * kGroupBytes, kQuad * tail, r * tail + b, out + (G * kLanes + b) * kBlockBytes);
}

}  // namespace kvforge
#endif
