// kvforge::paged_decode on CPU: one query token per sequence attends over its blocks in place.
// Parallel over (sequence, KV head); each block's rows of that head are decoded once into an L1 tile
// and used by all of the head's query heads (GQA/MQA); online softmax, so nothing grows with context.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "tiles.h"
#include "vmath.h"

namespace kvforge {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

int64_t side_dim(const std::vector<int64_t>& meta, const at::Tensor& codes) {
  const bool packed = meta[0] == UNIFORM_TOKEN || meta[0] == UNIFORM_CHANNEL;
  return packed ? codes.size(3) * 8 / meta[1] : codes.size(3);
}

struct Exact {
  Overlay k, v;
  Exact(const std::vector<at::Tensor>& parts) {
    if (parts.empty()) return;
    k = Overlay(parts[0], parts[1]);
    v = Overlay(parts[0], parts[2]);
  }
};

// Rows [r0, r1) of head h of block b as fp32: staging entry if the block has one, else its codes;
// sink rows on top.
const float* load(const Side& side, const Overlay& stage, const Overlay& sink, int64_t b, int64_t h, int64_t r0,
                  int64_t r1, float* scratch, int64_t* ld) {
  const float* rows = scratch;
  *ld = side.dim;
  if (!(stage.active() && stage.apply(b, h, r0, r1, scratch))) rows = side.tile(b, h, r0, r1, scratch, ld);
  if (sink.active() && sink.entry_of[b] >= 0) {
    if (rows != scratch) {
      for (int64_t r = r0; r < r1; ++r) std::copy_n(rows + r * *ld, side.dim, scratch + r * side.dim);
      rows = scratch;
      *ld = side.dim;
    }
    sink.apply(b, h, r0, r1, scratch);
  }
  return rows;
}

// Everything one call attends over; tasks are (sequence, KV head) pairs.
struct Problem {
  const Side& K;
  const Side& V;
  const Exact& staged;
  const Exact& sinks;
  const float* q;
  const int64_t* table;
  const int64_t* lens;
  float* out;
  int64_t H, W, G, kvh, bs, D, Dv, window;
  float scale;
};

// DK, DV: head dims known at compile time (0: take them from the problem), so dot products unroll.
template <int DK, int DV>
void run_tasks(const Problem& p, int64_t begin, int64_t end) {
  const int64_t D = DK ? DK : p.D, Dv = DV ? DV : p.Dv, G = p.G, bs = p.bs;
  std::vector<float> kbuf((bs + 1) * D), vbuf((bs + 1) * Dv), qs(G * D), s(G * bs), m(G), l(G), acc(G * Dv);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / p.kvh, h = task % p.kvh, n = p.lens[b];
    const int64_t start = p.window > 0 ? std::max<int64_t>(0, n - p.window) : 0;
    for (int64_t i = 0; i < G * D; ++i) qs[i] = p.q[(b * p.H + h * G) * D + i] * p.scale;
    std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = start / bs; j * bs < n && j < p.W; ++j) {
      const int64_t blk = p.table[b * p.W + j];
      const int64_t r0 = std::max<int64_t>(start - j * bs, 0), r1 = std::min<int64_t>(n - j * bs, bs);
      if (j + 1 < p.W && (j + 1) * bs < n) {
        p.K.prefetch(p.table[b * p.W + j + 1], h);
        p.V.prefetch(p.table[b * p.W + j + 1], h);
      }
      int64_t ldk, ldv;
      const float* kt = load(p.K, p.staged.k, p.sinks.k, blk, h, r0, r1, kbuf.data(), &ldk);
      for (int64_t g = 0; g < G; ++g) {
        int64_t r = r0;
#ifdef __AVX2__
        if constexpr (DK > 0 && DK % 8 == 0)
          for (; r + 8 <= r1; r += 8) dot8<DK>(qs.data() + g * D, kt + r * ldk, ldk, s.data() + g * bs + r);
#endif
        for (; r < r1; ++r) s[g * bs + r] = dot(qs.data() + g * D, kt + r * ldk, D);
      }
      const float* vt = load(p.V, p.staged.v, p.sinks.v, blk, h, r0, r1, vbuf.data(), &ldv);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = s.data() + g * bs;
        float* ag = acc.data() + g * Dv;
        const float top = std::max(m[g], *std::max_element(sg + r0, sg + r1));
        const float alpha = m[g] == top ? 1.f : exp_nonpositive(m[g] - top);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t r = r0; r < r1; ++r) {
          sg[r] = exp_nonpositive(sg[r] - top);
          sum += sg[r];
        }
        l[g] = l[g] * alpha + sum;
        m[g] = top;
        if constexpr (DV > 0) {  // the accumulator stays in registers over the block's rows
          float a[DV];
          for (int c = 0; c < DV; ++c) a[c] = ag[c] * alpha;
          for (int64_t r = r0; r < r1; ++r) {
            const float w = sg[r];
            const float* vr = vt + r * ldv;
            for (int c = 0; c < DV; ++c) a[c] += w * vr[c];
          }
          std::copy_n(a, DV, ag);
        } else {
          for (int64_t c = 0; c < Dv; ++c) ag[c] *= alpha;
          for (int64_t r = r0; r < r1; ++r) {
            const float w = sg[r];
            const float* vr = vt + r * ldv;
#pragma omp simd
            for (int64_t c = 0; c < Dv; ++c) ag[c] += w * vr[c];
          }
        }
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* o = p.out + (b * p.H + h * G + g) * Dv;
      const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
      for (int64_t c = 0; c < Dv; ++c) o[c] = acc[g * Dv + c] * inv;
    }
  }
}

at::Tensor paged_decode_cpu(const at::Tensor& q_in, const at::Tensor& table_in, const at::Tensor& lens_in,
                            double scale, int64_t window, std::vector<int64_t> k_meta, std::vector<at::Tensor> k_parts,
                            std::vector<int64_t> v_meta, std::vector<at::Tensor> v_parts,
                            std::vector<at::Tensor> stage, std::vector<at::Tensor> sink) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "paged_decode: q must be fp32 [B, heads, dim]");
  TORCH_CHECK(k_meta.size() == 3 && v_meta.size() == 3, "paged_decode: meta is [kind, bits, group]");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t bs = k_parts[0].size(1), kvh = k_parts[0].size(2);
  const int64_t Dv = side_dim(v_meta, v_parts[0]);
  TORCH_CHECK(side_dim(k_meta, k_parts[0]) == D, "paged_decode: key dim differs from the query's");
  TORCH_CHECK(H % kvh == 0, "paged_decode: query heads must be a multiple of KV heads");
  const Side K(k_meta[0], k_meta[1], k_meta[2], bs, kvh, D, k_parts);
  const Side V(v_meta[0], v_meta[1], v_meta[2], bs, kvh, Dv, v_parts);
  const Exact staged(stage), sinks(sink);
  at::Tensor out = at::zeros({B, H, Dv}, q.options());
  const Problem p{K, V, staged, sinks, q.data_ptr<float>(), table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                  out.data_ptr<float>(), H, table.size(1), H / kvh, kvh, bs, D, Dv, window,
                  static_cast<float>(scale)};
  at::parallel_for(0, B * kvh, 1, [&](int64_t begin, int64_t end) {
    if (D == 64 && Dv == 64) run_tasks<64, 64>(p, begin, end);
    else if (D == 128 && Dv == 128) run_tasks<128, 128>(p, begin, end);
    else run_tasks<0, 0>(p, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("paged_decode", &kvforge::paged_decode_cpu); }
