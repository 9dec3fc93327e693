// The pool's element type as a template parameter, how an fp8 pool's tiles reach the tensor cores (widen or mma),
// and the conversion of bf16 rows to the de-interleaved f16 both fp8 paths read.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kdtree_verify.h"
#include "ptx.cuh"

namespace kdtree {

// The pool's element type (enum kdtree_kv_dtype), a template parameter of the main kernel.
enum Kv : int { kKvBf16 = KDTREE_KV_BF16, kKvE4m3 = KDTREE_KV_FP8_E4M3, kKvE5m2 = KDTREE_KV_FP8_E5M2 };

__host__ __device__ constexpr bool is_fp8(Kv kv) { return kv != kKvBf16; }
// An fp8 pool's kernels compute in f16 (mma.sync f16 x f16, fp32 accumulate): fp8 widens to f16 exactly in one
// instruction per two values (fp8x4_to_f16x2x2: a prmt for e5m2, an F2FP for e4m3), where bf16 takes five. The widen
// path widens each prefix tile once per CTA, in shared memory, as soon as it lands (the output warps, convert_tile),
// so that the key loops read it as they read an f16 draft tile (NOTES.md, "fp8 pools": widened in the key loops'
// registers instead, after each ldmatrix, every score warp widened every fragment it read, slower for both dtypes).
// Q, the draft rows and the widened prefix tiles are stored as f16 with each 16-dim block de-interleaved (its 8 even
// dims, then its 8 odd dims): the order in which the mma path's fp8 value fragments arrive (below), so that one
// draft-tile format and one epilogue serve both paths. ldmatrix.trans of a de-interleaved f16 row gives the B
// fragments of two n-tiles whose column c is the block's dim 2c and dim 2c + 1, so O's n-tile pair (2i, 2i + 1)
// holds block i interleaved: lane q has dims 4q..4q+3 (see the epilogue).
// The mma path (MMA8) reads its prefix tiles as fp8, at chunk slot c / 2 of the f16 chunk pair (c, c + 1):
// - QK^T: q as the pool's fp8 type (Triton's q.to(k.dtype)) in registers, m16n8k32 A fragments straight from global
//   memory; ldmatrix of fp8 key rows gives the B fragment as it is (lane l: dims 4q..4q+3 of key l / 4);
// - PV: the k slots of an m16n8k32 are the tile's keys permuted, slot 4q + i of each 16 = key
//   {2q, 2q + 1, 8 + 2q, 9 + 2q}[i]: what a score lane holds of a row (n-tiles 2m and 2m + 1) and what two
//   ldmatrix.trans of 8 fp8 keys give a lane of one dim pair (bytes 0, 2 of each: dim 2c; bytes 1, 3: dim 2c + 1).
//   P is stored as e4m3 in that order (unscaled: P <= 2^RESCALE_SLACK is within e4m3's 448; Triton casts P <= 1 to
//   the pool's type, e5m2 too, which keeps one bit fewer).
// 16 bf16 values (chunks a: dims 0..7, b: dims 8..15 of a block) as f16, de-interleaved: even = dims 0, 2, .., 14;
// odd = dims 1, 3, .., 15. Exact for magnitudes in f16's normal range, 2^-14 to 65504 (bf16's 8-bit significand fits
// f16's 11); smaller ones round to f16's subnormals, larger ones become inf (kdtree_verify.h says so).
__device__ __forceinline__ void bf16x16_to_f16_deinterleaved(const uint4& a, const uint4& b, uint4& even, uint4& odd) {
  auto h2 = [](uint32_t w) {
    const __half2 h = __float22half2_rn(__bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w)));
    return *reinterpret_cast<const uint32_t*>(&h);
  };
  const uint32_t w[8] = {h2(a.x), h2(a.y), h2(a.z), h2(a.w), h2(b.x), h2(b.y), h2(b.z), h2(b.w)};
  even = make_uint4(prmt(w[0], w[1], 0x5410), prmt(w[2], w[3], 0x5410), prmt(w[4], w[5], 0x5410),
                    prmt(w[6], w[7], 0x5410));
  odd = make_uint4(prmt(w[0], w[1], 0x7632), prmt(w[2], w[3], 0x7632), prmt(w[4], w[5], 0x7632),
                   prmt(w[6], w[7], 0x7632));
}

}  // namespace kdtree
