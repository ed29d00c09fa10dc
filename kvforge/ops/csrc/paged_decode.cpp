// kvforge::paged_attend on CPU: each sequence's queries (one for decode; 1 + k for speculative verification;
// a chunk for prefill over cached history) attend over its blocks in place, each query up to its own position.
// Tasks are (run of a sequence's queries, KV heads), pulled by the threads longest first; each block's rows of a
// head are decoded once into an L1 tile (or read in place) and used by all queries of the run and all of the
// head's query heads (GQA/MQA); online softmax, so nothing grows with context. kvforge::paged_decode is its
// one-query-per-sequence case.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>

#include "packed_rows.h"
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

// A run of consecutive queries of one sequence: query i (from `first`) sees keys [lo_i, limit + i) of the
// sequence's blocks (lo_i: the window's start, else 0). Queries of one sequence are split into runs of at most
// MAX_RUN so that a long prefill chunk spreads over threads and its scores stay in L1.
struct Run {
  int64_t seq, first, count, limit;
};
constexpr int64_t MAX_RUN = 16;

// Everything one call attends over; tasks are (run, KV head) pairs.
struct Problem {
  const Side& K;
  const Side& V;
  const Exact& staged;
  const Exact& sinks;
  const float* q;
  const int64_t* table;
  const std::vector<Run>& runs;
  float* out;
  int64_t H, W, G, kvh, bs, D, Dv, window;
  float scale;
  int64_t heads;  // KV heads per task
};

#ifdef __AVX512F__
// weigh_rows for `rows` accumulator rows of 64 values, 6 at a time.
template <class L>
void weigh_all(const float* s, int64_t bs, const typename L::T* v, int64_t ldv, int64_t t0, int64_t t1,
               const float* alpha, float* acc, int64_t rows) {
  for (int64_t g = 0; g < rows; g += 6) {
    const int64_t k = std::min<int64_t>(6, rows - g);
    float* a = acc + g * 64;
    const float* w = s + g * bs;
    if (k == 6) weigh_rows<6, L>(w, bs, v, ldv, t0, t1, alpha + g, a);
    else if (k == 5) weigh_rows<5, L>(w, bs, v, ldv, t0, t1, alpha + g, a);
    else if (k == 4) weigh_rows<4, L>(w, bs, v, ldv, t0, t1, alpha + g, a);
    else if (k == 3) weigh_rows<3, L>(w, bs, v, ldv, t0, t1, alpha + g, a);
    else if (k == 2) weigh_rows<2, L>(w, bs, v, ldv, t0, t1, alpha + g, a);
    else weigh_rows<1, L>(w, bs, v, ldv, t0, t1, alpha + g, a);
  }
}
#endif

// Head h's rows of block blk's staging entry (fp16, row stride heads * dim), for blocks that have one and no sink
// rows over it; else null.
const uint16_t* staged_rows(const Overlay& stage, const Overlay& sink, int64_t blk, int64_t h) {
  if (!stage.active() || stage.entry_of[blk] < 0 || (sink.active() && sink.entry_of[blk] >= 0)) return nullptr;
  return reinterpret_cast<const uint16_t*>(stage.rows) + (stage.entry_of[blk] * stage.n * stage.heads + h) * stage.dim;
}

bool overlaid(const Problem& p, int64_t blk) {
  const auto holds = [blk](const Overlay& o) { return o.active() && o.entry_of[blk] >= 0; };
  return holds(p.staged.k) || holds(p.sinks.k);
}

// DK, DV: head dims known at compile time (0: take them from the problem), so dot products unroll.
// A task is a run and `heads` consecutive KV heads (all of them when there are enough runs to keep the threads
// busy). Blocks are walked in order and, within a block, its heads in order, so a task reads each block's rows
// as one contiguous stream. Each head's tile is loaded once and used by every query of the run and every query
// head of that KV head (rows i * G + g); each row keeps its own online softmax over its own causal range.
// L (a vmath.h row reader, DK == DV == 64): for tasks of a few query rows (decode), blocks without exact rows laid
// over them are read in place, converted in the dot products and weighted sums; row scales (SCALED) multiply the
// scores and the weights. L = PackedRows: 2- and 4-bit codes are read in place by packed_rows.h.
// Above this many query rows per task, converting every row once into a tile costs less than converting it in
// each row's dot product.
constexpr int64_t IN_PLACE_ROWS = 6;
static_assert(IN_PLACE_ROWS <= PACKED_MAX_ROWS, "packed rows take every in-place row count");
// One-head tasks ask the cache for a block's rows this many blocks ahead. Tasks of all heads instead sweep each
// block once before using it (Side::sweep): on fp32/fp16/int8/int4 caches at 64 sequences that took 10-40% off
// the attention time against the prefetches, which were no help for rows this wide.
constexpr int64_t PREFETCH_BLOCKS = 2;
// Where the sweeps' reads end up, so that they are not left out.
volatile float sweep_sink = 0.f;

template <int DK, int DV, class L = void>
void run_tasks(const Problem& p, const std::vector<int64_t>& order, std::atomic<int64_t>& next) {
  constexpr bool kInPlace = !std::is_void_v<L>, kPacked = std::is_same_v<L, PackedRows>;
  const int64_t D = DK ? DK : p.D, Dv = DV ? DV : p.Dv, G = p.G, bs = p.bs, R = MAX_RUN * G, HT = p.heads;
  std::vector<float> kbuf((bs + 1) * D), vbuf((bs + 1) * Dv), qs(HT * R * D), s(R * bs), m(HT * R), l(HT * R);
  std::vector<float> acc(HT * R * Dv), alpha(R), kscale(bs), vscale(bs);
  OutlierList k_outliers, v_outliers;  // packed blocks read in place: the block's outliers by head
  const float factor = p.K.reader() == READ_E4M3 ? E4M3_FACTOR : 1.f;
  int64_t lo[MAX_RUN], hi[MAX_RUN], r0s[MAX_RUN], r1s[MAX_RUN];
  const int64_t groups = p.kvh / HT;
  float swept = 0.f;
  for (int64_t at = next.fetch_add(1); at < static_cast<int64_t>(order.size()); at = next.fetch_add(1)) {
    const int64_t task = order[at];
    const Run& run = p.runs[task / groups];
    const int64_t b = run.seq, h0 = task % groups * HT, n = run.count, rows = n * G;
    for (int64_t i = 0; i < n; ++i) {
      hi[i] = run.limit + i;
      lo[i] = p.window > 0 ? std::max<int64_t>(0, hi[i] - p.window) : 0;
      for (int64_t hh = 0; hh < HT; ++hh) {
        const float* qi = p.q + ((run.first + i) * p.H + (h0 + hh) * G) * D;
        float* qd = qs.data() + (hh * R + i * G) * D;
        for (int64_t c = 0; c < G * D; ++c) qd[c] = qi[c] * p.scale;
      }
    }
    for (int64_t hh = 0; hh < HT; ++hh) {
      std::fill_n(m.begin() + hh * R, rows, -std::numeric_limits<float>::infinity());
      std::fill_n(l.begin() + hh * R, rows, 0.f);
      std::fill_n(acc.begin() + hh * R * Dv, rows * Dv, 0.f);
    }
    const int64_t first_key = lo[0], last_key = hi[n - 1];
    for (int64_t j = first_key / bs; j * bs < last_key && j < p.W; ++j) {
      const int64_t blk = p.table[b * p.W + j];
      const int64_t t0 = std::max<int64_t>(first_key - j * bs, 0), t1 = std::min<int64_t>(last_key - j * bs, bs);
      const int64_t ahead = j + PREFETCH_BLOCKS;
      const bool has_next = ahead < p.W && ahead * bs < last_key;
      for (int64_t i = 0; i < n; ++i) {
        r0s[i] = std::max<int64_t>(lo[i] - j * bs, 0);
        r1s[i] = std::min<int64_t>(hi[i] - j * bs, bs);
      }
      const bool in_place = kInPlace && rows <= IN_PLACE_ROWS && !overlaid(p, blk);
      if (HT > 1) swept += p.K.sweep(blk) + p.V.sweep(blk);  // all heads: the whole block, front to back
      if (kPacked && in_place && p.K.n_out) p.K.list_outliers(blk, k_outliers);
      if (kPacked && in_place && p.V.n_out) p.V.list_outliers(blk, v_outliers);
      for (int64_t hh = 0; hh < HT; ++hh) {
        const int64_t h = h0 + hh;
        const float* q = qs.data() + hh * R * D;
        float* mh = m.data() + hh * R;
        float* lh = l.data() + hh * R;
        float* ah = acc.data() + hh * R * Dv;
        if (HT == 1 && has_next) {
          p.K.prefetch(p.table[b * p.W + ahead], h);
          p.V.prefetch(p.table[b * p.W + ahead], h);
        }
        int64_t ldk, ldv;
#ifdef __AVX512F__
        // packed formats' staged blocks, in decode tasks: their fp16 rows read where they are
        const uint16_t* sk = kPacked && !in_place && rows <= IN_PLACE_ROWS ? staged_rows(p.staged.k, p.sinks.k, blk, h)
                                                                          : nullptr;
        const uint16_t* sv = sk ? staged_rows(p.staged.v, p.sinks.v, blk, h) : nullptr;
#else
        const uint16_t* sk = nullptr;
        const uint16_t* sv = nullptr;
#endif
        const int64_t lds = p.staged.k.heads * p.staged.k.dim, ldsv = p.staged.v.heads * p.staged.v.dim;
        const float* kt = in_place || sk ? nullptr : load(p.K, p.staged.k, p.sinks.k, blk, h, t0, t1, kbuf.data(), &ldk);
        if (kPacked && in_place) packed_scores(p.K, k_outliers, blk, h, q, rows, t0, t1, s.data(), bs);
        else for (int64_t i = 0; i < n; ++i) {
          for (int64_t g = i * G; r0s[i] < r1s[i] && g < (i + 1) * G; ++g) {
            int64_t r = r0s[i];
#ifdef __AVX512F__
            if constexpr (kPacked) {
              if (sk) {
                for (; r + 8 <= r1s[i]; r += 8) dot8<DK, F16Rows>(q + g * D, sk + r * lds, lds, s.data() + g * bs + r);
                for (; r < r1s[i]; ++r) s[g * bs + r] = dot1<DK, F16Rows>(q + g * D, sk + r * lds);
                continue;
              }
            }
            if constexpr (kInPlace && !kPacked) {
              if (in_place) {
                const auto* kr = reinterpret_cast<const typename L::T*>(p.K.rows(blk, h));
                const int64_t ld = p.K.row_stride();
                for (; r + 8 <= r1s[i]; r += 8) dot8<DK, L>(q + g * D, kr + r * ld, ld, s.data() + g * bs + r);
                for (; r < r1s[i]; ++r) s[g * bs + r] = dot1<DK, L>(q + g * D, kr + r * ld);
                continue;
              }
            }
#endif
#ifdef __AVX2__
            if constexpr (DK > 0 && DK % 8 == 0)
              for (; r + 8 <= r1s[i]; r += 8) dot8<DK>(q + g * D, kt + r * ldk, ldk, s.data() + g * bs + r);
#endif
            for (; r < r1s[i]; ++r) s[g * bs + r] = dot(q + g * D, kt + r * ldk, D);
          }
        }
        const bool scaled = in_place && !kPacked && p.K.kind == SCALED;
        if (scaled) {  // scores of in-place SCALED rows still lack their row's scale
          p.K.row_scales(blk, h, t0, t1, factor, kscale.data());
          p.V.row_scales(blk, h, t0, t1, factor, vscale.data());
          for (int64_t g = 0; g < rows; ++g)
            for (int64_t r = t0; r < t1; ++r) s[g * bs + r] *= kscale[r];
        }
        const float* vt = in_place || sv ? nullptr : load(p.V, p.staged.v, p.sinks.v, blk, h, t0, t1, vbuf.data(), &ldv);
        for (int64_t g = 0; g < rows; ++g) {  // online softmax; weights outside a row's range become 0
          const int64_t r0 = r0s[g / G], r1 = r1s[g / G];
          float* sg = s.data() + g * bs;
          if (r0 >= r1) {
            alpha[g] = 1.f;
            std::fill(sg + t0, sg + t1, 0.f);
          } else {
            alpha[g] = softmax_step(sg, t0, t1, r0, r1, mh[g], lh[g]);
          }
        }
#ifdef __AVX512F__
        if constexpr (kPacked) {
          if (in_place) {
            packed_weigh(p.V, v_outliers, blk, h, s.data(), bs, t0, t1, alpha.data(), ah, rows);
            continue;
          }
          if (sv) {
            weigh_all<F16Rows>(s.data(), bs, sv, ldsv, t0, t1, alpha.data(), ah, rows);
            continue;
          }
        } else if constexpr (kInPlace) {
          if (in_place) {
            if (scaled)
              for (int64_t g = 0; g < rows; ++g)
                for (int64_t r = t0; r < t1; ++r) s[g * bs + r] *= vscale[r];
            const auto* vr = reinterpret_cast<const typename L::T*>(p.V.rows(blk, h));
            weigh_all<L>(s.data(), bs, vr, p.V.row_stride(), t0, t1, alpha.data(), ah, rows);
            continue;
          }
        }
        if constexpr (DV == 64) {  // up to 6 rows' accumulators in registers, each V row loaded once for them
          weigh_all<F32Rows>(s.data(), bs, vt, ldv, t0, t1, alpha.data(), ah, rows);
          continue;
        }
#endif
        for (int64_t g = 0; g < rows; ++g) {
          const float* sg = s.data() + g * bs;
          float* ag = ah + g * Dv;
          for (int64_t c = 0; c < Dv; ++c) ag[c] *= alpha[g];
          for (int64_t r = t0; r < t1; ++r) {
            const float w = sg[r];
            const float* vr = vt + r * ldv;
#pragma omp simd
            for (int64_t c = 0; c < Dv; ++c) ag[c] += w * vr[c];
          }
        }
      }
    }
    for (int64_t hh = 0; hh < HT; ++hh) {
      const float* lh = l.data() + hh * R;
      const float* ah = acc.data() + hh * R * Dv;
      for (int64_t g = 0; g < rows; ++g) {
        float* o = p.out + ((run.first + g / G) * p.H + (h0 + hh) * G + g % G) * Dv;
        const float inv = lh[g] > 0.f ? 1.f / lh[g] : 0.f;
        for (int64_t c = 0; c < Dv; ++c) o[c] = ah[g * Dv + c] * inv;
      }
    }
  }
  sweep_sink = swept;
}

// Sequence b owns queries [starts[b], starts[b + 1]) of q, the last ones of its lens[b] keys (they were
// written to the cache before attention), in order.
std::vector<Run> runs_of(const int64_t* starts, const int64_t* lens, int64_t B) {
  std::vector<Run> runs;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t count = starts[b + 1] - starts[b];
    TORCH_CHECK(count >= 0 && lens[b] >= count, "paged_attend: sequence ", b, " has ", count, " queries but ",
                lens[b], " keys; each query's own key must be among its sequence's keys");
    for (int64_t i = 0; i < count; i += MAX_RUN)
      runs.push_back({b, starts[b] + i, std::min(MAX_RUN, count - i), lens[b] - count + i + 1});
  }
  return runs;
}

// All of a run's KV heads in one task (each block read as one stream) when the runs alone give every thread
// several tasks; else one head per task, so that a few long sequences still spread over the threads.
int64_t heads_per_task(size_t runs, int64_t kvh) {
  return static_cast<int64_t>(runs) >= 4 * at::get_num_threads() ? kvh : 1;
}

// Tasks (run * splits + part), longest run first, so that threads pulling them in turn finish together.
std::vector<int64_t> task_order(const std::vector<Run>& runs, int64_t splits) {
  std::vector<int64_t> by_length(runs.size());
  std::iota(by_length.begin(), by_length.end(), int64_t{0});
  std::stable_sort(by_length.begin(), by_length.end(),
                   [&](int64_t a, int64_t b) { return runs[a].limit + runs[a].count > runs[b].limit + runs[b].count; });
  std::vector<int64_t> order;
  order.reserve(runs.size() * splits);
  for (int64_t r : by_length)
    for (int64_t part = 0; part < splits; ++part) order.push_back(r * splits + part);
  return order;
}

at::Tensor attend(const at::Tensor& q_in, const std::vector<int64_t>& starts, const at::Tensor& table_in,
                  const at::Tensor& lens_in, double scale, int64_t window, const std::vector<int64_t>& k_meta,
                  const std::vector<at::Tensor>& k_parts, const std::vector<int64_t>& v_meta,
                  const std::vector<at::Tensor>& v_parts, const std::vector<at::Tensor>& stage,
                  const std::vector<at::Tensor>& sink) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "paged attention: q must be fp32 [T, heads, dim]");
  TORCH_CHECK(k_meta.size() == 3 && v_meta.size() == 3, "paged attention: meta is [kind, bits, group]");
  const at::Tensor q = q_in.contiguous();
  const at::Tensor table = table_in.to(at::kLong).contiguous();
  const at::Tensor lens = lens_in.to(at::kLong).contiguous();
  const int64_t B = table.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(lens.numel() == B && static_cast<int64_t>(starts.size()) == B + 1 && starts[B] == q.size(0),
              "paged attention: need one length per table row and query starts [B + 1] ending at q's row count");
  const int64_t bs = k_parts[0].size(1), kvh = k_parts[0].size(2);
  const int64_t Dv = side_dim(v_meta, v_parts[0]);
  TORCH_CHECK(side_dim(k_meta, k_parts[0]) == D, "paged attention: key dim differs from the query's");
  TORCH_CHECK(H % kvh == 0, "paged attention: query heads must be a multiple of KV heads");
  const Side K(k_meta[0], k_meta[1], k_meta[2], bs, kvh, D, k_parts);
  const Side V(v_meta[0], v_meta[1], v_meta[2], bs, kvh, Dv, v_parts);
  const Exact staged(stage), sinks(sink);
  const std::vector<Run> runs = runs_of(starts.data(), lens.data_ptr<int64_t>(), B);
  at::Tensor out = at::empty({q.size(0), H, Dv}, q.options());  // every (query, head) row is written by one task
  const Problem p{K, V, staged, sinks, q.data_ptr<float>(), table.data_ptr<int64_t>(), runs,
                  out.data_ptr<float>(), H, table.size(1), H / kvh, kvh, bs, D, Dv, window,
                  static_cast<float>(scale), heads_per_task(runs.size(), kvh)};
  const Reader reader = D != 64 || Dv != 64 ? DECODE_TILES
                        : reads_packed(K, V)  ? READ_PACKED
                        : K.reader() == V.reader() ? K.reader() : DECODE_TILES;
  const std::vector<int64_t> order = task_order(runs, kvh / p.heads);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(order.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
#ifdef __AVX512F__
    switch (reader) {
      case READ_F16: return run_tasks<64, 64, F16Rows>(p, order, next);
      case READ_BF16: return run_tasks<64, 64, BF16Rows>(p, order, next);
      case READ_INT8: return run_tasks<64, 64, Int8Rows>(p, order, next);
      case READ_E4M3: return run_tasks<64, 64, E4M3Rows>(p, order, next);
      case READ_E5M2: return run_tasks<64, 64, E5M2Rows>(p, order, next);
      case READ_PACKED: return run_tasks<64, 64, PackedRows>(p, order, next);
      default: break;
    }
#endif
    if (D == 64 && Dv == 64) run_tasks<64, 64>(p, order, next);
    else if (D == 128 && Dv == 128) run_tasks<128, 128>(p, order, next);
    else run_tasks<0, 0>(p, order, next);
  });
  return out;
}

at::Tensor paged_attend_cpu(const at::Tensor& q, const at::Tensor& query_start, const at::Tensor& table,
                            const at::Tensor& lens, double scale, int64_t window, std::vector<int64_t> k_meta,
                            std::vector<at::Tensor> k_parts, std::vector<int64_t> v_meta,
                            std::vector<at::Tensor> v_parts, std::vector<at::Tensor> stage,
                            std::vector<at::Tensor> sink) {
  const at::Tensor starts = query_start.to(at::kLong).contiguous();
  const std::vector<int64_t> s(starts.data_ptr<int64_t>(), starts.data_ptr<int64_t>() + starts.numel());
  return attend(q, s, table, lens, scale, window, k_meta, k_parts, v_meta, v_parts, stage, sink);
}

// One query per sequence: paged_attend with query starts 0, 1, ..., B.
at::Tensor paged_decode_cpu(const at::Tensor& q, const at::Tensor& table, const at::Tensor& lens, double scale,
                            int64_t window, std::vector<int64_t> k_meta, std::vector<at::Tensor> k_parts,
                            std::vector<int64_t> v_meta, std::vector<at::Tensor> v_parts,
                            std::vector<at::Tensor> stage, std::vector<at::Tensor> sink) {
  TORCH_CHECK(q.dim() == 3 && q.size(0) == table.size(0), "paged_decode: q must be [B, heads, dim], one row per table row");
  std::vector<int64_t> starts(q.size(0) + 1);
  std::iota(starts.begin(), starts.end(), int64_t{0});
  return attend(q, starts, table, lens, scale, window, k_meta, k_parts, v_meta, v_parts, stage, sink);
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) {
  m.impl("paged_decode", &kvforge::paged_decode_cpu);
  m.impl("paged_attend", &kvforge::paged_attend_cpu);
}
