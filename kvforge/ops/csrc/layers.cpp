// Per-layer elementwise work of a decoder in one pass each, so a decode step dispatches one operator
// where the torch code dispatched five to ten: RMSNorm, RoPE (rotate-half, in place on q and k heads
// of a fused projection's output), SwiGLU's silu(gate) * up (GeGLU's gelu_tanh(gate) * up), and a residual add fused with the norm after it.
// fp32, rows in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "rows.h"

namespace kvforge {
namespace {

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), op, ": fp32 CPU tensors only");
  TORCH_CHECK(x.stride(-1) == 1, op, ": the last dimension must be contiguous");
}

at::Tensor rms_norm_cpu(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_rows(x_in, "rms_norm");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(w.numel() == d, "rms_norm: weight has ", w.numel(), " elements, rows have ", d);
  at::Tensor out = at::empty_like(x);
  const float *src = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(src + r * d, wp, dst + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// residual += x in place, then RMSNorm of the sum: a decoder's residual add and the next norm in one pass.
at::Tensor add_rms_norm_cpu(at::Tensor residual, const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  check_rows(residual, "add_rms_norm_");
  TORCH_CHECK(residual.is_contiguous() && x_in.sizes() == residual.sizes(),
              "add_rms_norm_: residual must be contiguous and x of its shape");
  const at::Tensor x = x_in.contiguous(), w = weight.contiguous();
  const int64_t d = residual.size(-1), rows = residual.numel() / d;
  TORCH_CHECK(w.numel() == d, "add_rms_norm_: weight has ", w.numel(), " elements, rows have ", d);
  at::Tensor out = at::empty_like(residual);
  float* res = residual.data_ptr<float>();
  const float *src = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      add_rms_norm_row(res + r * d, src + r * d, wp, dst + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// x [T, heads, dim] (any row and head strides), cos/sin [T, dim]: x = x * cos + rotate_half(x) * sin.
void rope_cpu(at::Tensor x, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  check_rows(x, "rope_");
  TORCH_CHECK(x.dim() == 3, "rope_: x must be [tokens, heads, dim]");
  const at::Tensor c = cos_in.contiguous(), s = sin_in.contiguous();
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(c.size(0) == t && c.size(1) == d && s.sizes() == c.sizes(), "rope_: cos/sin must be [tokens, dim]");
  TORCH_CHECK(d % 2 == 0 && half <= 512, "rope_: head dim must be even and at most 1024");
  float* base = x.data_ptr<float>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  const float *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  at::parallel_for(0, t * heads, 64, [&](int64_t begin, int64_t end) {
    float lo[512];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads;
      rope_row(base + i * st + h * sh, cp + i * d, sp + i * d, d, lo);
    }
  });
}

// gate_up [T, 2 * inter] (gate then up) -> act(gate) * up [T, inter]
template <void (*Row)(const float*, const float*, float*, int64_t)>
at::Tensor gated_cpu(const at::Tensor& gu_in, const char* op) {
  check_rows(gu_in, op);
  const at::Tensor gu = gu_in.contiguous();
  const int64_t n = gu.size(-1) / 2, rows = gu.numel() / gu.size(-1);
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, gu.options());
  const float* src = gu.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) Row(src + r * 2 * n, src + r * 2 * n + n, dst + r * n, n);
  });
  return out;
}

at::Tensor silu_mul_cpu(const at::Tensor& gu) { return gated_cpu<silu_mul_row>(gu, "silu_mul"); }
at::Tensor gelu_tanh_mul_cpu(const at::Tensor& gu) { return gated_cpu<gelu_tanh_mul_row>(gu, "gelu_tanh_mul"); }

}  // namespace
}  // namespace kvforge

TORCH_LIBRARY_IMPL(kvforge, CPU, m) {
  m.impl("rms_norm", &kvforge::rms_norm_cpu);
  m.impl("add_rms_norm_", &kvforge::add_rms_norm_cpu);
  m.impl("rope_", &kvforge::rope_cpu);
  m.impl("silu_mul", &kvforge::silu_mul_cpu);
  m.impl("gelu_tanh_mul", &kvforge::gelu_tanh_mul_cpu);
}
