// Linear layers on GGUF block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in their file layout, for callers that split
// the weight's rows over threads themselves (layer_bridge.cpp): quantize_block_rows rounds x once (int8 per
// 32-column block, int8_matmul.h's quantize_rows), qblock_rows multiplies weight rows [n0, n1) with it.
#pragma once

#include <cstdint>
#include <vector>

#include "int8_matmul.h"

namespace kvforge {

// ggml's type ids of the block types computed in place
enum QBlockType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
                          kQ8_0L = 1008 };  // kQ8_0L: Q8_0 in lane groups (ops/q8_lanes.py, csrc/q8_lanes.cpp)

bool is_qblock_type(int64_t qtype);
int64_t qblock_bytes(int64_t qtype);   // bytes of one block (32 weights; a K-quant super-block: 256)
int64_t qblock_values(int64_t qtype);  // weights per block: 32 or 256

// Values per lane of the few-row kernel (qblock_lanes.h): a 32-value block; Q6_K: a 16-value sub-block.
constexpr int64_t lane_values(int64_t qtype) { return qtype == kQ6_K ? 16 : 32; }

// Rows of x in the kernels' form: int8_matmul.h's (the int8 weights' kernel takes xq), and for block weights the
// same int8 values in lane groups (qblock_lanes.h: per group of 16 lanes, per step of 4 values, each lane's 4 bytes),
// with per lane the block's scale d, -offset * its integer sum (the code offset undone), d * that sum (for m).
struct BlockRows {
  QuantizedRows xq;
  int64_t groups = 0, steps = 0;
  std::vector<int8_t> q;     // [M, groups, steps, 16, 4], zeros past K
  std::vector<int32_t> fix;  // [M, groups, 16]
  std::vector<float> d, sx;  // [M, groups, 16]
};

#if KVFORGE_INT8_VNNI
BlockRows quantize_block_rows(const float* x, int64_t M, int64_t K, int64_t qtype);
// y[m * stride + n] for weight rows n in [n0, n1) of blocks (row-major block bytes of a [N, K] weight).
void qblock_rows(const BlockRows& xr, const uint8_t* blocks, int64_t qtype, float* y, int64_t stride, int64_t M,
                 int64_t K, int64_t n0, int64_t n1);
// The lane layout of Q8_0 (q8_lanes.cpp): which shapes take it, the few-row kernel on it (x rounded as for Q8_0,
// n0 and n1 multiples of 4), and row n as the file's Q8_0 block bytes.
bool q8_lanes_fits(int64_t n, int64_t K);
void q8_lanes_rows(const BlockRows& xr, const uint8_t* blocks, float* y, int64_t stride, int64_t M, int64_t K,
                   int64_t n0, int64_t n1);
void q8_lanes_unpack_row(const uint8_t* blocks, int64_t n, int64_t K, uint8_t* out);
#endif

}  // namespace kvforge
