// kvforge::uniform_encode on CPU: blocks of rows into b-bit codes with a scale and zero per group, plus the
// dense-and-sparse outliers (kv/quant/uniform.py is the torch reference and says what each part holds). One call
// per side instead of some seventy torch ops; the same float operations in the same order, so the same parts.
#pragma GCC optimize("fp-contract=off")  // the reference multiplies and adds separately: no fused multiply-add

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <vector>

namespace kvforge {
namespace {

constexpr float kMinScale = 1e-6f, kLogMin = -18.f, kLogSteps = 9.f;

// A block's groups: per channel, `count` = heads * dim groups of the block's tokens; per token, groups of
// group_size consecutive values of a row (row: heads * dim values).
struct Groups {
  bool per_channel;
  int64_t count, members, row, group_size;
};

struct Block {  // one block's input values and output parts
  const float* x;
  uint8_t* codes;
  uint8_t* scale_code;  // param_bits 8
  c10::Half* scale_half;  // param_bits 16
  uint8_t* zero_code;  // coded zeros (per channel, param_bits 8)
  c10::Half* zero_half;  // otherwise
  c10::Half* ends;  // [heads, 2] of the coded zeros' grid
  void* index;
  c10::Half* values;
};

struct Encoder {
  Groups g;
  int64_t bits, levels, n_out, param_bits, heads, dim;
  bool coded_zero, wide_index;
  const float* scale_table;  // param_bits 8: the 256 decoded scales
  std::vector<float> lo, hi, zero, scale, mean, score, ranked, q, row_buffer[2];
  std::vector<int64_t> order;
  std::vector<uint8_t> outlier;

  // Token t's values as members see them: per channel the parameters themselves; per token its groups' parameters
  // repeated over their members, in `buffer` (one row, so scratch stays small).
  const float* row_params(const std::vector<float>& params, int64_t t, std::vector<float>& buffer) const {
    if (g.per_channel) return params.data();
    buffer.resize(g.row);
    const int64_t groups = g.row / g.group_size;
    for (int64_t j = 0; j < groups; ++j)
      std::fill_n(buffer.begin() + j * g.group_size, g.group_size, params[t * groups + j]);
    return buffer.data();
  }

  void run(const Block& b) {
    const int64_t n = g.count * g.members;
    outlier.assign(n, 0);
    if (n_out > 0) pick_outliers(b, n);
    ranges(b, n);
    zeros(b);
    scales(b);
    pack(b, n);
  }

  // The n_out values farthest from their group's mean, stored by head, then row, then channel (as the reference).
  void pick_outliers(const Block& b, int64_t n) {
    mean.assign(g.count, 0.f);
    if (g.per_channel) {  // members one token apart: add token by token, as torch's strided reduction does
      for (int64_t i0 = 0; i0 < n; i0 += g.row)
        for (int64_t c = 0; c < g.row; ++c) mean[c] += b.x[i0 + c];
    } else {
      for (int64_t k = 0; k < g.count; ++k)
        for (int64_t m = 0; m < g.group_size; ++m) mean[k] += b.x[k * g.group_size + m];
    }
    for (float& m : mean) m /= static_cast<float>(g.members);
    score.resize(n);
    for (int64_t t = 0; t < n / g.row; ++t) {
      const float *x = b.x + t * g.row, *c = row_params(mean, t, row_buffer[0]);
      float* out = score.data() + t * g.row;
#pragma omp simd
      for (int64_t j = 0; j < g.row; ++j) out[j] = std::fabs(x[j] - c[j]);
    }
    // The n_out-th largest score, then every index above it and, lowest index first, those equal to it.
    ranked.assign(score.begin(), score.end());
    std::nth_element(ranked.begin(), ranked.begin() + (n_out - 1), ranked.end(), std::greater<float>());
    const float cut = ranked[n_out - 1];
    order.clear();
    for (int64_t i = 0; i < n; ++i)
      if (score[i] > cut) order.push_back(i);
    for (int64_t i = 0; i < n && static_cast<int64_t>(order.size()) < n_out; ++i)
      if (score[i] == cut) order.push_back(i);
    const int64_t bs = n / g.row;
    const auto head_major = [&](int64_t i) { return ((i / dim % heads) * bs + i / g.row) * dim + i % dim; };
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return head_major(a) < head_major(c); });
    for (int64_t j = 0; j < n_out; ++j) {
      const int64_t i = order[j];
      outlier[i] = 1;
      if (wide_index)
        static_cast<int32_t*>(b.index)[j] = static_cast<int32_t>(i);
      else
        static_cast<int16_t*>(b.index)[j] = static_cast<int16_t>(i);
      b.values[j] = static_cast<c10::Half>(b.x[i]);
    }
  }

  // Each group's min and max over its members that are not outliers (0 where all are).
  void ranges(const Block& b, int64_t n) {
    const float inf = std::numeric_limits<float>::infinity();
    lo.assign(g.count, inf);
    hi.assign(g.count, -inf);
    if (g.per_channel) {
      for (int64_t i0 = 0; i0 < n; i0 += g.row) {
        const float* x = b.x + i0;
        const uint8_t* o = outlier.data() + i0;
#pragma omp simd
        for (int64_t c = 0; c < g.row; ++c) {
          lo[c] = std::min(lo[c], o[c] ? inf : x[c]);
          hi[c] = std::max(hi[c], o[c] ? -inf : x[c]);
        }
      }
    } else {
      for (int64_t k = 0; k < g.count; ++k) {
        const float* x = b.x + k * g.group_size;
        const uint8_t* o = outlier.data() + k * g.group_size;
        float l = inf, h = -inf;
#pragma omp simd reduction(min : l) reduction(max : h)
        for (int64_t m = 0; m < g.group_size; ++m) {
          l = std::min(l, o[m] ? inf : x[m]);
          h = std::max(h, o[m] ? -inf : x[m]);
        }
        lo[k] = l;
        hi[k] = h;
      }
    }
    for (int64_t k = 0; k < g.count; ++k) {
      if (std::isinf(lo[k])) lo[k] = 0.f;
      if (std::isinf(hi[k])) hi[k] = 0.f;
    }
  }

  void zeros(const Block& b) {
    zero.resize(g.count);
    if (!coded_zero) {
      for (int64_t k = 0; k < g.count; ++k) {
        b.zero_half[k] = static_cast<c10::Half>(lo[k]);
        zero[k] = static_cast<float>(b.zero_half[k]);
      }
      return;
    }
    for (int64_t h = 0; h < heads; ++h) {  // per-channel groups: head h owns groups h * dim .. h * dim + dim - 1
      const float* l = lo.data() + h * dim;
      b.ends[2 * h] = static_cast<c10::Half>(*std::min_element(l, l + dim));
      b.ends[2 * h + 1] = static_cast<c10::Half>(*std::max_element(l, l + dim));
      const float base = static_cast<float>(b.ends[2 * h]);
      const float step = std::max((static_cast<float>(b.ends[2 * h + 1]) - base) / 255.f, kMinScale);
      for (int64_t d = 0; d < dim; ++d) {
        const float code = std::min(std::max(std::floor((l[d] - base) / step), 0.f), 255.f);
        b.zero_code[h * dim + d] = static_cast<uint8_t>(code);
        zero[h * dim + d] = base + code * step;
      }
    }
  }

  void scales(const Block& b) {
    scale.resize(g.count);
    for (int64_t k = 0; k < g.count; ++k) {
      const float s = (hi[k] - zero[k]) / static_cast<float>(levels);
      if (param_bits == 8) {
        const float code = std::ceil((std::log2(std::max(s, std::exp2(kLogMin))) - kLogMin) * kLogSteps);
        b.scale_code[k] = static_cast<uint8_t>(std::min(std::max(code, 0.f), 255.f));
        scale[k] = scale_table[b.scale_code[k]];
      } else {
        b.scale_half[k] = static_cast<c10::Half>(std::max(s, kMinScale));
        scale[k] = static_cast<float>(b.scale_half[k]);
      }
    }
  }

  void pack(const Block& b, int64_t n) {
    q.resize(g.row);
    const float top = static_cast<float>(levels);
    const int64_t per = 8 / bits;
    for (int64_t t = 0; t < n / g.row; ++t) {
      const float *x = b.x + t * g.row, *z = row_params(zero, t, row_buffer[0]), *sc = row_params(scale, t, row_buffer[1]);
#pragma omp simd
      for (int64_t j = 0; j < g.row; ++j) q[j] = std::min(std::max(std::nearbyint((x[j] - z[j]) / sc[j]), 0.f), top);
      uint8_t* codes = b.codes + t * g.row / per;
      for (int64_t byte = 0; byte < g.row / per; ++byte) {
        unsigned packed = 0;
        for (int64_t j = 0; j < per; ++j) packed |= static_cast<unsigned>(q[byte * per + j]) << (j * bits);
        codes[byte] = static_cast<uint8_t>(packed);
      }
    }
  }
};

template <class T>
T* block_ptr(const at::Tensor& t, int64_t b) {
  return t.defined() ? t.data_ptr<T>() + b * (t.numel() / t.size(0)) : nullptr;
}

std::vector<at::Tensor> uniform_encode_cpu(const at::Tensor& x_in, int64_t bits, bool per_channel, int64_t group_size,
                                           int64_t num_outliers, int64_t param_bits,
                                           const std::optional<at::Tensor>& scale_table_in) {
  TORCH_CHECK(x_in.dim() == 4, "uniform_encode: x must be [blocks, block_size, heads, dim], got ", x_in.sizes());
  TORCH_CHECK(bits == 1 || bits == 2 || bits == 4 || bits == 8, "uniform_encode: bits must be 1, 2, 4 or 8");
  TORCH_CHECK(param_bits == 8 || param_bits == 16, "uniform_encode: param_bits must be 8 or 16");
  const at::Tensor x = x_in.to(at::kFloat).contiguous();
  const int64_t n = x.size(0), bs = x.size(1), heads = x.size(2), dim = x.size(3), per_block = bs * heads * dim;
  TORCH_CHECK(dim % (8 / bits) == 0, "uniform_encode: dim must fill whole bytes of codes");
  TORCH_CHECK(per_channel || (group_size > 0 && dim % group_size == 0), "uniform_encode: group_size must divide dim");
  TORCH_CHECK(num_outliers >= 0 && num_outliers <= per_block, "uniform_encode: 0 <= num_outliers <= values per block");
  at::Tensor scale_table;
  if (param_bits == 8) {
    TORCH_CHECK(scale_table_in.has_value() && scale_table_in->numel() == 256,
                "uniform_encode: 8-bit scales need the 256-entry table of decoded scales");
    scale_table = scale_table_in->to(at::kFloat).contiguous();
  }
  const auto bytes = x.options().dtype(at::kByte), half = x.options().dtype(at::kHalf);
  const std::vector<int64_t> params = per_channel ? std::vector<int64_t>{n, heads, dim}
                                                  : std::vector<int64_t>{n, bs, heads, dim / group_size};
  const bool coded_zero = param_bits == 8 && per_channel, wide_index = per_block > (1 << 15);
  std::vector<at::Tensor> parts = {at::empty({n, bs, heads, dim * bits / 8}, bytes),
                                   at::empty(params, param_bits == 8 ? bytes : half),
                                   at::empty(params, coded_zero ? bytes : half)};
  if (coded_zero) parts.push_back(at::empty({n, heads, 2}, half));
  if (num_outliers > 0) {
    parts.push_back(at::empty({n, num_outliers}, x.options().dtype(wide_index ? at::kInt : at::kShort)));
    parts.push_back(at::empty({n, num_outliers}, half));
  }
  Encoder enc;
  enc.g = per_channel ? Groups{true, heads * dim, bs, heads * dim, group_size}
                      : Groups{false, per_block / group_size, group_size, heads * dim, group_size};
  enc.bits = bits;
  enc.levels = (1 << bits) - 1;
  enc.n_out = num_outliers;
  enc.param_bits = param_bits;
  enc.heads = heads;
  enc.dim = dim;
  enc.coded_zero = coded_zero;
  enc.wide_index = wide_index;
  enc.scale_table = param_bits == 8 ? scale_table.data_ptr<float>() : nullptr;
  const at::Tensor& scale = parts[1];
  const at::Tensor& zero = parts[2];
  const at::Tensor ends = coded_zero ? parts[3] : at::Tensor();
  const at::Tensor index = num_outliers > 0 ? parts[parts.size() - 2] : at::Tensor();
  const at::Tensor values = num_outliers > 0 ? parts.back() : at::Tensor();
  for (int64_t b = 0; b < n; ++b) {
    Block blk{x.data_ptr<float>() + b * per_block,
              block_ptr<uint8_t>(parts[0], b),
              param_bits == 8 ? block_ptr<uint8_t>(scale, b) : nullptr,
              param_bits == 8 ? nullptr : block_ptr<c10::Half>(scale, b),
              coded_zero ? block_ptr<uint8_t>(zero, b) : nullptr,
              coded_zero ? nullptr : block_ptr<c10::Half>(zero, b),
              block_ptr<c10::Half>(ends, b),
              index.defined() ? static_cast<void*>(static_cast<uint8_t*>(index.data_ptr()) +
                                                   b * num_outliers * index.element_size())
                              : nullptr,
              block_ptr<c10::Half>(values, b)};
    enc.run(blk);
  }
  return parts;
}

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) { m.impl("uniform_encode", &kvforge::uniform_encode_cpu); }
