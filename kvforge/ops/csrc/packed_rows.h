// 2- and 4-bit KV rows read in place by decode attention, with no decoded tile. Keys quantized per channel over a
// block fold their parameters into the query (q . k = (q * scale) . code + q . zero); values quantized per token
// in groups fold theirs into the weight (w * v = (w * scale) code + w * zero). Codes are widened in registers;
// dense-and-sparse outliers add (exact - decoded) times the query or weight afterwards, a few scalar FMAs per outlier
// instead of a patch on every row.
#pragma once

#include "tiles.h"

namespace kvforge {

// run_tasks' reader type for these rows.
struct PackedRows {
  using T = uint8_t;
};

// Query rows a call may carry (their accumulators stay in registers).
constexpr int64_t PACKED_MAX_ROWS = 6;

// Whether packed_scores and packed_weigh read these sides: per-channel keys and per-token values of the same
// width (2 or 4 bits), 64-wide heads, value groups of 16, 32 or 64, blocks of at most 64 rows, AVX-512.
bool reads_packed(const Side& K, const Side& V);

// s[g * ss + r] = dot(q + g * 64, key row r of head h of block b) for g < rows, r in [t0, t1); outliers: block b's
// (K.list_outliers).
void packed_scores(const Side& K, const OutlierList& outliers, int64_t b, int64_t h, const float* q, int64_t rows,
                   int64_t t0, int64_t t1, float* s, int64_t ss);

// acc[g * 64 ..] = acc[g * 64 ..] * alpha[g] + sum over r in [t0, t1) of w[g * ws + r] * value row r of head h of
// block b, for g < rows.
void packed_weigh(const Side& V, const OutlierList& outliers, int64_t b, int64_t h, const float* w, int64_t ws,
                  int64_t t0, int64_t t1, const float* alpha, float* acc, int64_t rows);

}  // namespace kvforge
