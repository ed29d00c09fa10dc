// kvforge::argmax_rows on CPU: each row's index of its largest value (the first where several are equal), 16 lanes
// at a time, rows split over the threads. torch's argmax over a 262k vocabulary runs ~10x slower, one value at a
// time. A row with a NaN gets some index (the sampler fails such rows); otherwise torch.argmax's answer.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

namespace kvforge {
namespace {

int64_t row_argmax(const float* x, int64_t n) {
  int64_t i = 0, best_at = 0;
  float best = n > 0 ? x[0] : 0.0f;
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 top = _mm512_loadu_ps(x);
    __m512i at = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), top_at = at;
    const __m512i step = _mm512_set1_epi32(16);
    for (i = 16; i + 16 <= n; i += 16) {
      at = _mm512_add_epi32(at, step);
      const __m512 v = _mm512_loadu_ps(x + i);
      const __mmask16 above = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);
      top = _mm512_mask_mov_ps(top, above, v);
      top_at = _mm512_mask_mov_epi32(top_at, above, at);
    }
    best = _mm512_reduce_max_ps(top);
    const __mmask16 tied = _mm512_cmp_ps_mask(top, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_at = tied ? _mm512_mask_reduce_min_epi32(tied, top_at) : 0;
  }
#endif
  for (; i < n; ++i)
    if (x[i] > best) best = x[i], best_at = i;
  return best_at;
}

at::Tensor argmax_rows_cpu(const at::Tensor& logits_in) {
  TORCH_CHECK(logits_in.dim() == 2 && logits_in.scalar_type() == at::kFloat && logits_in.size(1) > 0 &&
                  logits_in.size(1) < (int64_t{1} << 31),
              "argmax_rows: logits [N, V] fp32 with 0 < V < 2^31 expected");
  const at::Tensor logits = logits_in.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* y = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) y[r] = row_argmax(x + r * n, n);
  });
  return out;
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("argmax_rows", &kvforge::argmax_rows_cpu); }
