// kvforge::stage_append on CPU: a decode step's new K and V rows stored as fp16 in their blocks' staging entries
// (kv/quant/layer.py), with the checks that decide whether that is allowed, in one call instead of a dozen torch
// ops per layer. Nothing is written unless every row qualifies.
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "rows.h"

namespace kvforge {
namespace {

bool stage_append_cpu(const at::Tensor& slots_in, const at::Tensor& k_in, const std::optional<at::Tensor>& v_in,
                      const at::Tensor& entry_of, at::Tensor stage_k, const std::optional<at::Tensor>& stage_v,
                      at::Tensor stage_full, int64_t block_size, int64_t max_rows,
                      const std::optional<at::Tensor>& positions_in, int64_t sinks) {
  const int64_t n = slots_in.numel();
  if (n == 0 || n > max_rows) return false;
  const bool has_v = v_in.has_value() && stage_v.has_value();
  TORCH_CHECK(entry_of.scalar_type() == at::kInt && stage_k.scalar_type() == at::kHalf &&
                  (!has_v || stage_v->scalar_type() == at::kHalf) && stage_full.scalar_type() == at::kBool,
              "stage_append: entry_of int32, staging rows fp16 and stage_full bool expected");
  const at::Tensor slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor k = k_in.to(at::kFloat).contiguous();
  const at::Tensor v = has_v ? v_in->to(at::kFloat).contiguous() : at::Tensor();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int32_t* entry = entry_of.data_ptr<int32_t>();
  if (positions_in.has_value() && sinks > 0) {
    const at::Tensor positions = positions_in->to(at::kLong).contiguous();
    for (int64_t i = 0; i < n; ++i)
      if (positions.data_ptr<int64_t>()[i] < sinks) return false;
  }
  for (int64_t i = 0; i < n; ++i)
    if (slot[i] % block_size == 0 || entry[slot[i] / block_size] < 0) return false;
  const int64_t kw = k.numel() / n, vw = has_v ? v.numel() / n : 0;
  TORCH_CHECK(stage_k.is_contiguous() && stage_k.numel() % kw == 0 &&
                  (!has_v || (stage_v->is_contiguous() && stage_v->numel() % vw == 0)),
              "stage_append: staging rows must be contiguous and as wide as the new rows");
  c10::Half* sk = stage_k.data_ptr<c10::Half>();
  c10::Half* sv = has_v ? stage_v->data_ptr<c10::Half>() : nullptr;
  bool* full = stage_full.data_ptr<bool>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = entry[slot[i] / block_size], off = slot[i] % block_size, row = e * block_size + off;
    put_row(k.data_ptr<float>() + i * kw, sk + row * kw, kw);
    if (has_v) put_row(v.data_ptr<float>() + i * vw, sv + row * vw, vw);
    if (off == block_size - 1) full[e] = true;
  }
  return true;
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("stage_append", &kvforge::stage_append_cpu); }
