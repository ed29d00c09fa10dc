// Block tiles: one KV head's rows of one block, decoded to fp32 in a small scratch buffer (L1-sized),
// straight from the pool's storage. Formats: plain fp32/fp16/bf16, scaled int8/fp8 (one scale per row
// and head), uniform b-bit groups per token (values) or per channel over the block (keys), optional
// dense-and-sparse outliers; then exact fp16 rows (staging entries, sinks) laid over the decoded ones.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <vector>

namespace kvforge {

enum Kind : int64_t { PLAIN = 0, SCALED = 1, UNIFORM_TOKEN = 2, UNIFORM_CHANNEL = 3 };

// Formats whose rows a kernel reads in place, converting in registers (vmath.h's *Rows readers).
enum Reader : int { DECODE_TILES = 0, READ_F16, READ_BF16, READ_INT8, READ_E4M3, READ_E5M2, READ_PACKED };

// Parts, in order, per kind (absent parts are empty tensors):
//   PLAIN:            rows [N, bs, kvh, d] fp32 | fp16 | bf16
//   SCALED:           codes [N, bs, kvh, d] int8 | float8, scale [N, bs, kvh] fp16
//   UNIFORM_TOKEN:    codes [N, bs, kvh, d*bits/8] u8, scale [N, bs, kvh, d/g] (u8 code | fp16), zero fp16,
//                     -, outlier index [N, n] (int16 | int32), outlier value [N, n] fp16, scale table [256] fp32
//   UNIFORM_CHANNEL:  codes, scale [N, kvh, d] (u8 code | fp16), zero [N, kvh, d] (u8 code | fp16),
//                     ends [N, kvh, 2] fp16 (with u8 zeros), outlier index, outlier value, scale table
// One block's outliers of one side, sorted by head, then row, then channel (Side::list_outliers): entries
// [start[h], start[h + 1]) are head h's. The encoder stores them in that order; others are sorted here.
struct OutlierList {
  std::vector<int32_t> start, row, channel, head;
  std::vector<float> value;
  std::vector<int32_t> order;  // scratch for outliers stored in another order

  // f(r, c, exact value) for head h's outliers in rows [r0, r1).
  template <class F>
  void each(int64_t h, int64_t r0, int64_t r1, F&& f) const {
    for (int32_t i = start[h]; i < start[h + 1]; ++i)
      if (row[i] >= r0 && row[i] < r1) f(row[i], channel[i], value[i]);
  }
};

struct Side {
  int64_t kind = PLAIN, bits = 0, group = 0, dim = 0, heads = 0, bs = 0;
  at::ScalarType dtype = at::kFloat;
  const uint8_t* data = nullptr;
  const c10::Half* row_scale = nullptr;
  const uint8_t* scale = nullptr;
  bool scale_coded = false;
  const uint8_t* zero = nullptr;
  bool zero_coded = false;
  const c10::Half* ends = nullptr;
  const uint8_t* out_index = nullptr;
  bool index32 = false;
  const c10::Half* out_value = nullptr;
  int64_t n_out = 0;
  float table[256];  // u8 scale code -> scale
  std::vector<int32_t> row_of;  // with outliers: row of flat (row * heads + head) index
  int dim_shift = -1;           // log2(dim) when dim is a power of two

  Side(int64_t kind_, int64_t bits_, int64_t group_, int64_t bs_, int64_t heads_, int64_t dim_,
       const std::vector<at::Tensor>& parts);
  // Rows [r0, r1) of head h of block b; returns a pointer to row 0 with row stride *ld.
  // scratch holds block_size + 1 rows of dim (the last one is a spill row).
  const float* tile(int64_t b, int64_t h, int64_t r0, int64_t r1, float* scratch, int64_t* ld) const;
  // Asks the cache for what tile(b, h, ...) will read (blocks sit at random places in the pool).
  void prefetch(int64_t b, int64_t h) const;
  // Reads every row of every head of block b once, front to back, so that the hardware prefetcher streams the
  // block (software prefetches of a block's rows did not reach memory any sooner), and a byte of every cache line
  // of its parameters and outliers, so that their misses overlap instead of coming one by one (2- and 4-bit caches
  // at 2k context: 10-20% off the attention time); returns a value that depends on the reads so that they happen.
  float sweep(int64_t b) const;
  // How a kernel may read this format's rows without a tile (DECODE_TILES: it may not).
  Reader reader() const;
  // Row 0 of head h of block b in storage; row r is row_stride() elements (packed: heads * row_bytes() bytes) further.
  const uint8_t* rows(int64_t b, int64_t h) const { return data + (b * bs * heads + h) * row_bytes(); }
  int64_t row_stride() const { return heads * dim; }
  // SCALED: out[r] = scale of row r of head h of block b, times factor, for r in [r0, r1).
  void row_scales(int64_t b, int64_t h, int64_t r0, int64_t r1, float factor, float* out) const;
  // UNIFORM_CHANNEL: the fp32 scale and zero of each of head h's channels in block b.
  void channel_params(int64_t b, int64_t h, float* s, float* z) const;
  // UNIFORM_TOKEN: s[(r - r0) * groups + j], z[...] = the fp32 scale and zero of group j of row r of head h of
  // block b, for r in [r0, r1).
  void token_params(int64_t b, int64_t h, int64_t r0, int64_t r1, float* s, float* z) const;
  // Block b's outliers, sorted by head, row and channel into out (its vectors are reused from block to block).
  void list_outliers(int64_t b, OutlierList& out) const;
  // Bytes of one row of one head in storage.
  int64_t row_bytes() const {
    return kind == UNIFORM_TOKEN || kind == UNIFORM_CHANNEL ? dim * bits / 8 : dim * at::elementSize(dtype);
  }

 private:
  void scaled_rows(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const;
  void uniform_rows(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const;
  template <int BITS>
  void uniform_rows_of(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const;
  void outliers(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const;
  // visit(first byte, bytes) for block b's share (all heads) of each parameter and outlier array.
  template <class F>
  void each_parameter_range(int64_t b, F&& visit) const;
};

// Exact fp16 rows laid over decoded ones: entry_of [N] int32 (-1: none), rows [E, n, kvh, d] fp16.
struct Overlay {
  const int32_t* entry_of = nullptr;
  const c10::Half* rows = nullptr;
  int64_t n = 0, heads = 0, dim = 0;

  Overlay() = default;
  Overlay(const at::Tensor& entry, const at::Tensor& exact);
  bool active() const { return entry_of != nullptr; }
  // Copies rows [r0, min(r1, n)) of head h into out (stride dim) when block b holds an entry.
  bool apply(int64_t b, int64_t h, int64_t r0, int64_t r1, float* out) const;
};

}  // namespace kvforge
