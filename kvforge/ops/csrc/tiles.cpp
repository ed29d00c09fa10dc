#include "tiles.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <tuple>

#include "vmath.h"

namespace kvforge {
namespace {

constexpr float MIN_ZERO_STEP = 1e-6f;  // uniform.py MIN_SCALE: floor of the per-head zero grid's step

const uint8_t* bytes(const at::Tensor& t) {
  return t.numel() ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr;
}

// Byte -> its 8 / BITS codes as floats, one table per width (as packing.py reads codes on the torch path).
template <int BITS>
struct Unpacker {
  static constexpr int per = 8 / BITS;
  float values[256][per];
  Unpacker() {
    for (int v = 0; v < 256; ++v)
      for (int j = 0; j < per; ++j) values[v][j] = static_cast<float>((v >> (j * BITS)) & ((1 << BITS) - 1));
  }
  // out[c] = code[c] * s[c] + z[c]
  void operator()(const uint8_t* src, int64_t nbytes, float* out, const float* s, const float* z) const {
    int64_t i = 0;
#ifdef __AVX2__
    if constexpr (BITS == 2 || BITS == 4) i = unpack_simd<BITS>(src, nbytes, out, s, z);
#endif
    for (; i < nbytes; ++i)
      for (int j = 0; j < per; ++j) out[i * per + j] = values[src[i]][j] * s[i * per + j] + z[i * per + j];
  }
};

float half_at(const uint8_t* p, int64_t i) { return static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]); }

}  // namespace

Side::Side(int64_t kind_, int64_t bits_, int64_t group_, int64_t bs_, int64_t heads_, int64_t dim_,
           const std::vector<at::Tensor>& parts)
    : kind(kind_), bits(bits_), group(group_), dim(dim_), heads(heads_), bs(bs_) {
  dim_shift = (dim & (dim - 1)) == 0 ? __builtin_ctzll(dim) : -1;
  TORCH_CHECK(!parts.empty() && parts[0].is_contiguous(), "paged_decode: codes must be contiguous");
  dtype = parts[0].scalar_type();
  data = bytes(parts[0]);
  if (kind == SCALED) {
    row_scale = reinterpret_cast<const c10::Half*>(bytes(parts[1]));
    TORCH_CHECK(dtype == at::kChar || dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
                "paged_decode: scaled codes must be int8, float8_e4m3fn or float8_e5m2");
  } else if (kind == UNIFORM_TOKEN || kind == UNIFORM_CHANNEL) {
    scale = bytes(parts[1]);
    scale_coded = parts[1].scalar_type() == at::kByte;
    zero = bytes(parts[2]);
    zero_coded = parts[2].scalar_type() == at::kByte;
    ends = reinterpret_cast<const c10::Half*>(bytes(parts[3]));
    out_index = bytes(parts[4]);
    index32 = parts[4].scalar_type() == at::kInt;
    out_value = reinterpret_cast<const c10::Half*>(bytes(parts[5]));
    n_out = parts[4].numel() ? parts[4].size(1) : 0;
    if (n_out)
      for (int64_t rh = 0; rh < bs * heads; ++rh) row_of.push_back(static_cast<int32_t>(rh / heads));
    if (scale_coded) std::copy_n(parts[6].data_ptr<float>(), 256, table);
  }
}

const float* Side::tile(int64_t b, int64_t h, int64_t r0, int64_t r1, float* scratch, int64_t* ld) const {
  *ld = dim;
  const int64_t first = (b * bs * heads + h) * dim;  // element offset of row 0 of head h
  if (kind == PLAIN) {
    if (dtype == at::kFloat) {
      *ld = heads * dim;
      return reinterpret_cast<const float*>(data) + first;
    }
    const uint16_t* src = reinterpret_cast<const uint16_t*>(data) + first;
    for (int64_t r = r0; r < r1; ++r) {
      if (dtype == at::kHalf) half_to_float(src + r * heads * dim, scratch + r * dim, dim);
      else bf16_to_float(src + r * heads * dim, scratch + r * dim, dim);
    }
    return scratch;
  }
  if (kind == SCALED) scaled_rows(b, h, r0, r1, scratch);
  else uniform_rows(b, h, r0, r1, scratch);
  if (n_out) outliers(b, h, r0, r1, scratch);
  return scratch;
}

namespace {
void prefetch_range(const uint8_t* p, int64_t n) {
  if (p == nullptr) return;
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(p + i);
}
}  // namespace

template <class F>
void Side::each_parameter_range(int64_t b, F&& visit) const {
  if (kind == SCALED) visit(reinterpret_cast<const uint8_t*>(row_scale + b * bs * heads), bs * heads * 2);
  if (kind == UNIFORM_TOKEN || kind == UNIFORM_CHANNEL) {
    const int64_t per = kind == UNIFORM_TOKEN ? bs * heads * (dim / group) : heads * dim;
    visit(scale + b * per * (scale_coded ? 1 : 2), per * (scale_coded ? 1 : 2));
    visit(zero + b * per * (zero_coded ? 1 : 2), per * (zero_coded ? 1 : 2));
    if (ends) visit(reinterpret_cast<const uint8_t*>(ends + b * heads * 2), heads * 4);
  }
  if (n_out) {
    visit(out_index + b * n_out * (index32 ? 4 : 2), n_out * (index32 ? 4 : 2));
    visit(reinterpret_cast<const uint8_t*>(out_value + b * n_out), n_out * 2);
  }
}

void Side::prefetch(int64_t b, int64_t h) const {
  const int64_t rb = row_bytes();
  for (int64_t r = 0; r < bs; ++r) prefetch_range(data + ((b * bs + r) * heads + h) * rb, rb);
  each_parameter_range(b, prefetch_range);
}

namespace {
// Reads one byte of every cache line of [p, p + n) into x.
void touch(const void* p, int64_t n, uint8_t& x) {
  if (p == nullptr) return;
  const uint8_t* c = static_cast<const uint8_t*>(p);
  for (int64_t i = 0; i < n; i += 64) x ^= c[i];
  if (n > 0) x ^= c[n - 1];
}
}  // namespace

float Side::sweep(int64_t b) const {
  const int64_t bytes = bs * heads * row_bytes();
  uint8_t x = 0;
  touch(data + b * bytes, bytes, x);
  each_parameter_range(b, [&x](const uint8_t* p, int64_t n) { touch(p, n, x); });
  return x;
}

Reader Side::reader() const {
  if (kind == PLAIN) return dtype == at::kHalf ? READ_F16 : dtype == at::kBFloat16 ? READ_BF16 : DECODE_TILES;
  if (kind != SCALED) return DECODE_TILES;
  return dtype == at::kChar ? READ_INT8 : dtype == at::kFloat8_e4m3fn ? READ_E4M3 : READ_E5M2;
}

void Side::row_scales(int64_t b, int64_t h, int64_t r0, int64_t r1, float factor, float* out) const {
  for (int64_t r = r0; r < r1; ++r) out[r] = static_cast<float>(row_scale[(b * bs + r) * heads + h]) * factor;
}

void Side::scaled_rows(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t row = (b * bs + r) * heads + h;
    const uint8_t* src = data + row * dim;
    const float s = static_cast<float>(row_scale[row]);
    float* o = out + r * dim;
    if (dtype == at::kChar) {
      const int8_t* q = reinterpret_cast<const int8_t*>(src);
      for (int64_t c = 0; c < dim; ++c) o[c] = static_cast<float>(q[c]) * s;
    } else if (dtype == at::kFloat8_e4m3fn) {
      for (int64_t c = 0; c < dim; ++c) o[c] = fp8_to_float<3, 7>(src[c]) * s;
    } else {
      for (int64_t c = 0; c < dim; ++c) o[c] = fp8_to_float<2, 15>(src[c]) * s;
    }
  }
}

void Side::uniform_rows(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const {
  switch (bits) {
    case 1: return uniform_rows_of<1>(b, h, r0, r1, out);
    case 2: return uniform_rows_of<2>(b, h, r0, r1, out);
    case 4: return uniform_rows_of<4>(b, h, r0, r1, out);
    default: return uniform_rows_of<8>(b, h, r0, r1, out);
  }
}

template <int BITS>
void Side::uniform_rows_of(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const {
  static const Unpacker<BITS> unpack;
  const int64_t rb = row_bytes();
  float s[512], z[512];  // per channel: the block's parameters (keys) or the row's groups' (values)
  TORCH_CHECK(dim <= 512, "paged_decode: uniform codes need head_dim <= 512");
  if (kind == UNIFORM_TOKEN) {
    const int64_t groups = dim / group;
    TORCH_CHECK(groups <= 32, "paged_decode: per-token codes need at most 32 groups per row");
    float gs[32], gz[32];
#ifdef __AVX2__
    if constexpr (BITS == 2 || BITS == 4) {
      if (group % 16 == 0 && rb % 16 == 0) {  // whole 16-code chunks per group: its scale and zero broadcast
        const int shift = __builtin_ctzll(group);
        const bool pow2 = (group & (group - 1)) == 0;
        for (int64_t r = r0; r < r1; ++r) {
          token_params(b, h, r, r + 1, gs, gz);
          float* o = out + r * dim;
          unpack_chunks<BITS>(data + ((b * bs + r) * heads + h) * rb, rb, [&](__m128i codes, int64_t e) {
            const int64_t j = pow2 ? e >> shift : e / group;
            store_group_codes(codes, o + e, gs[j], gz[j]);
          });
        }
        return;
      }
    }
#endif
    for (int64_t r = r0; r < r1; ++r) {
      token_params(b, h, r, r + 1, gs, gz);
      for (int64_t j = 0; j < groups; ++j) {
        std::fill_n(s + j * group, group, gs[j]);
        std::fill_n(z + j * group, group, gz[j]);
      }
      unpack(data + ((b * bs + r) * heads + h) * rb, rb, out + r * dim, s, z);
    }
    return;
  }
  channel_params(b, h, s, z);
  for (int64_t r = r0; r < r1; ++r) unpack(data + ((b * bs + r) * heads + h) * rb, rb, out + r * dim, s, z);
}

void Side::channel_params(int64_t b, int64_t h, float* s, float* z) const {
  const int64_t p = (b * heads + h) * dim;
  if (scale_coded) {
    int64_t c = 0;
#ifdef __AVX512F__
    for (; c + 16 <= dim; c += 16) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + p + c)));
      _mm512_storeu_ps(s + c, _mm512_i32gather_ps(codes, table, 4));
    }
#endif
    for (; c < dim; ++c) s[c] = table[scale[p + c]];
  } else {
    half_to_float(reinterpret_cast<const uint16_t*>(scale) + p, s, dim);
  }
  if (zero_coded) {
    const float base = static_cast<float>(ends[(b * heads + h) * 2]);
    const float step = std::max((static_cast<float>(ends[(b * heads + h) * 2 + 1]) - base) / 255.f, MIN_ZERO_STEP);
    for (int64_t c = 0; c < dim; ++c) z[c] = base + static_cast<float>(zero[p + c]) * step;
  } else {
    half_to_float(reinterpret_cast<const uint16_t*>(zero) + p, z, dim);
  }
}

void Side::token_params(int64_t b, int64_t h, int64_t r0, int64_t r1, float* s, float* z) const {
  const int64_t groups = dim / group;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t p = ((b * bs + r) * heads + h) * groups, o = (r - r0) * groups;
    for (int64_t j = 0; j < groups; ++j) {
      s[o + j] = scale_coded ? table[scale[p + j]] : half_at(scale, p + j);
      z[o + j] = half_at(zero, p + j);
    }
  }
}

void Side::outliers(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const {
  // flat index = (row * heads + head) * dim + channel. Values of other heads' rows and of rows outside
  // [r0, r1) land in the spill row past the tile, so the loop has no branch to mispredict. The row offsets
  // depend on the head and row range only: kept per thread while they stay the same.
  thread_local int32_t offset[1024];
  thread_local int64_t made_for[6] = {-1, -1, -1, -1, -1, -1};
  TORCH_CHECK(bs * heads <= 1024, "paged_decode: outliers need block_size * kv_heads <= 1024");
  const int64_t key[6] = {h, r0, r1, bs, heads, dim};
  if (!std::equal(key, key + 6, made_for)) {
    for (int64_t r = 0; r < bs; ++r)
      for (int64_t hh = 0; hh < heads; ++hh)
        offset[r * heads + hh] = static_cast<int32_t>((hh == h && r >= r0 && r < r1 ? r : bs) * dim);
    std::copy_n(key, 6, made_for);
  }
  const uint32_t d = static_cast<uint32_t>(dim);
  const int shift = dim_shift;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (!index32 && shift >= 0) {  // 16 outliers at a time: their tile offsets gathered, their values scattered
    const int16_t* index = reinterpret_cast<const int16_t*>(out_index) + b * n_out;
    const uint16_t* value = reinterpret_cast<const uint16_t*>(out_value) + b * n_out;
    const __m128i count = _mm_cvtsi32_si128(shift);
    const __m512i channel = _mm512_set1_epi32(dim - 1);
    for (int64_t i = 0; i < n_out; i += 16) {
      const __mmask16 m = n_out - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n_out - i)) - 1);
      const __m512i flat = _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, index + i));
      const __m512 v = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, value + i));
      const __m512i row = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, _mm512_srl_epi32(flat, count), offset, 4);
      _mm512_mask_i32scatter_ps(out, m, _mm512_add_epi32(row, _mm512_and_si512(flat, channel)), v, 4);
    }
    return;
  }
#endif
  float values[256];
  for (int64_t i0 = 0; i0 < n_out; i0 += 256) {
    const int64_t n = std::min<int64_t>(256, n_out - i0);
    half_to_float(reinterpret_cast<const uint16_t*>(out_value + b * n_out + i0), values, n);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t at = b * n_out + i0 + i;
      const uint32_t flat = index32 ? reinterpret_cast<const int32_t*>(out_index)[at]
                                    : reinterpret_cast<const int16_t*>(out_index)[at];
      const uint32_t rh = shift >= 0 ? flat >> shift : flat / d;
      out[offset[rh] + (flat - rh * d)] = values[i];
    }
  }
}

namespace {
// v[i] = old v[order[i]].
template <class T>
void permute(std::vector<T>& v, const std::vector<int32_t>& order) {
  const std::vector<T> old(v);
  for (size_t i = 0; i < order.size(); ++i) v[i] = old[order[i]];
}
}  // namespace

void Side::list_outliers(int64_t b, OutlierList& out) const {
  for (auto* v : {&out.row, &out.channel, &out.head}) v->resize(n_out);
  out.value.resize(n_out);
  half_to_float(reinterpret_cast<const uint16_t*>(out_value + b * n_out), out.value.data(), n_out);
  const int16_t* index16 = reinterpret_cast<const int16_t*>(out_index) + b * n_out;
  const int32_t* index32_ = reinterpret_cast<const int32_t*>(out_index) + b * n_out;
  bool sorted = true;
  int64_t last = -1, i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (!index32 && dim_shift >= 0) {  // 16 at a time (the last ones masked): row from the row_of table, key compared
                                     // with the one before
    const __m128i shift = _mm_cvtsi32_si128(dim_shift);
    const __m512i channel_mask = _mm512_set1_epi32(static_cast<int32_t>(dim - 1)), vheads = _mm512_set1_epi32(heads);
    const __m512i vbs = _mm512_set1_epi32(static_cast<int32_t>(bs)), vdim = _mm512_set1_epi32(static_cast<int32_t>(dim));
    __m512i before = _mm512_set1_epi32(-1);
    __mmask16 unsorted = 0;
    for (; i < n_out; i += 16) {
      const __mmask16 m = n_out - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n_out - i)) - 1);
      const __m512i flat = _mm512_cvtepi16_epi32(_mm256_maskz_loadu_epi16(m, index16 + i));
      const __m512i rh = _mm512_srl_epi32(flat, shift);
      const __m512i row = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, rh, row_of.data(), 4);
      const __m512i head = _mm512_sub_epi32(rh, _mm512_mullo_epi32(row, vheads));
      const __m512i channel = _mm512_and_si512(flat, channel_mask);
      const __m512i key = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_add_epi32(_mm512_mullo_epi32(head, vbs), row), vdim),
                                           channel);
      const __m512i previous = _mm512_alignr_epi32(key, before, 15);  // lane j: key of lane j - 1
      unsorted |= _mm512_mask_cmple_epi32_mask(m, key, previous);
      before = key;
      _mm512_mask_storeu_epi32(out.row.data() + i, m, row);
      _mm512_mask_storeu_epi32(out.head.data() + i, m, head);
      _mm512_mask_storeu_epi32(out.channel.data() + i, m, channel);
    }
    sorted = unsorted == 0;
  }
#endif
  for (; i < n_out; ++i) {
    const int64_t flat = index32 ? index32_[i] : index16[i];
    const int64_t rh = dim_shift >= 0 ? flat >> dim_shift : flat / dim;
    const int32_t row = row_of[rh], head = static_cast<int32_t>(rh - row * heads);
    out.row[i] = row;
    out.head[i] = head;
    out.channel[i] = static_cast<int32_t>(flat - rh * dim);
    const int64_t key = (head * bs + row) * dim + out.channel[i];
    sorted = sorted && key > last;
    last = key;
  }
  if (!sorted) {  // stored in another order (by an older version, say): sort by head, row, channel
    out.order.resize(n_out);
    std::iota(out.order.begin(), out.order.end(), 0);
    std::sort(out.order.begin(), out.order.end(), [&](int32_t x, int32_t y) {
      return std::tie(out.head[x], out.row[x], out.channel[x]) < std::tie(out.head[y], out.row[y], out.channel[y]);
    });
    permute(out.head, out.order);
    permute(out.row, out.order);
    permute(out.channel, out.order);
    permute(out.value, out.order);
  }
  out.start.assign(heads + 1, 0);  // by counting (a binary search per head cost more than the listing itself)
  for (int64_t k = 0; k < n_out; ++k) ++out.start[out.head[k] + 1];
  for (int64_t h = 0; h < heads; ++h) out.start[h + 1] += out.start[h];
}

Overlay::Overlay(const at::Tensor& entry, const at::Tensor& exact)
    : entry_of(entry.data_ptr<int32_t>()),
      rows(reinterpret_cast<const c10::Half*>(exact.data_ptr())),
      n(exact.size(1)),
      heads(exact.size(2)),
      dim(exact.size(3)) {}

bool Overlay::apply(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const {
  const int32_t e = entry_of[b];
  if (e < 0) return false;
  for (int64_t r = r0; r < std::min(r1, n); ++r)
    half_to_float(reinterpret_cast<const uint16_t*>(rows) + ((e * n + r) * heads + h) * dim, out + r * dim, dim);
  return true;
}

}  // namespace kvforge
