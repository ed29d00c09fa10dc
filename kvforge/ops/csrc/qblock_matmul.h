// Linear layers on GGUF block weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) in their file layout, for callers that split
// the weight's rows over threads themselves (layer_bridge.cpp): quantize_block_rows rounds x once (int8 per
// 32-column block, int8_matmul.h's quantize_rows), qblock_rows multiplies weight rows [n0, n1) with it.
#pragma once

#include <cstdint>
#include <vector>

#include "int8_matmul.h"

namespace kvforge {

// ggml's type ids of the block types computed in place
enum QBlockType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

bool is_qblock_type(int64_t qtype);
int64_t qblock_bytes(int64_t qtype);   // bytes of one block (32 weights; a K-quant super-block: 256)
int64_t qblock_values(int64_t qtype);  // weights per block: 32 or 256

// Rows of x in the kernels' form: int8_matmul.h's, plus per lane its block scale * its integer sum of x.
struct BlockRows {
  QuantizedRows xq;
  std::vector<float> sx;  // [M, chunks * 16], for the `_1` types' offsets m
};

#if KVFORGE_INT8_VNNI
BlockRows quantize_block_rows(const float* x, int64_t M, int64_t K);
// y[m * stride + n] for weight rows n in [n0, n1) of blocks (row-major block bytes of a [N, K] weight).
void qblock_rows(const BlockRows& xr, const uint8_t* blocks, int64_t qtype, float* y, int64_t stride, int64_t M,
                 int64_t K, int64_t n0, int64_t n1);
#endif

}  // namespace kvforge
