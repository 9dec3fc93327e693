// The merge of a request's prefix splits: two CTAs of a cluster on chip (merge_pair, from the main kernel's
// epilogue), more in the combine kernel (see the end of this file).
#pragma once
#include <cuda_bf16.h>

#include <cmath>
#include <cstdint>

#include "cta.cuh"
#include "ptx.cuh"
#include "tile_config.cuh"
#include "timeline.cuh"

namespace kdtree {

// A request split in two: the merge of the two CTAs' partial rows (rows r_lo.. r_lo + BM/2 of this CTA
// with the same rows of the other CTA of the cluster, read through distributed shared memory) into the
// bf16 output. Every remote load of a warp's rows goes out before the first is used: one round trip to
// the other SM (issued one row at a time, with the row max waiting for the row sum, they took ~6 us).
// Not inlined, so that the kernel's key loops keep the register allocation they have without it.
template <class C>
__device__ __noinline__ void merge_pair(__nv_bfloat16* out, int64_t o_st, int64_t o_sh, int H, int64_t qs, int m0,
                                        int rows, int r_lo, int ow, int lane, const float* staged,
                                        const float* l_fin, const float* m_fin) {
  constexpr int ROWS = C::BM / 2 / C::NO, CH = DV / 4 / 32;  // rows per warp, float4 per lane and row
  static_assert(C::BM / 2 % C::NO == 0, "the merged rows spread evenly over the output warps");
  const uint32_t peer = cluster_rank() ^ 1u;
  float l_b[ROWS], m_b[ROWS];
  float4 o_b[ROWS][CH];
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int r = r_lo + ow + i * C::NO;
    l_b[i] = ld_cluster(cluster_map(l_fin + r, peer));
    m_b[i] = ld_cluster(cluster_map(m_fin + r, peer));
    const uint32_t other = cluster_map(staged + r * C::STAGED_ROW, peer);
#pragma unroll
    for (int c = 0; c < CH; ++c) o_b[i][c] = ld_cluster4(other + (lane + 32 * c) * 16);
  }
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int r = r_lo + ow + i * C::NO, gr = m0 + r;
    if (gr >= rows) break;  // rows are in order: the rest are padding too
    const float l_a = l_fin[r];
    const float lse_a = l_a > 0.f ? m_fin[r] + log2f(l_a) : -INFINITY;
    const float lse_b = l_b[i] > 0.f ? m_b[i] + log2f(l_b[i]) : -INFINITY;
    const float mx = fmaxf(lse_a, lse_b);
    const float w_a = lse_a == -INFINITY ? 0.f : exp2f(lse_a - mx);
    const float w_b = lse_b == -INFINITY ? 0.f : exp2f(lse_b - mx);
    const float inv = w_a + w_b > 0.f ? 1.f / (w_a + w_b) : 0.f;  // no visible key: zeros, as Triton writes
    const float f_a = w_a * inv, f_b = w_b * inv;
    const float4* own = reinterpret_cast<const float4*>(staged + r * C::STAGED_ROW);
    __nv_bfloat16* dst = out + (qs + gr / H) * o_st + (gr % H) * o_sh;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const float4 a = own[lane + 32 * c], o = o_b[i][c];
      __nv_bfloat162 lo2 = __floats2bfloat162_rn(f_a * a.x + f_b * o.x, f_a * a.y + f_b * o.y);
      __nv_bfloat162 hi2 = __floats2bfloat162_rn(f_a * a.z + f_b * o.z, f_a * a.w + f_b * o.w);
      uint2 packed;
      packed.x = *reinterpret_cast<uint32_t*>(&lo2);
      packed.y = *reinterpret_cast<uint32_t*>(&hi2);
      *reinterpret_cast<uint2*>(dst + (lane + 32 * c) * 4) = packed;
    }
  }
}

// Packed rows [lo, hi) of the request whose tokens start at qs (row r: token r / H, head r % H) as zeros: its rows
// past the live tokens (q_live), which no CTA computes. The split-0 CTA of each row tile writes those of its tile.
// Not inlined: it runs before the key loops and must not change their register allocation.
__device__ __noinline__ void zero_rows(__nv_bfloat16* out, int64_t o_st, int64_t o_sh, int H, int64_t qs, int lo,
                                       int hi) {
  constexpr int CH = DV / 4;  // four bf16 (8 bytes) a store
  for (int i = threadIdx.x; i < (hi - lo) * CH; i += blockDim.x) {
    const int r = lo + i / CH;
    *reinterpret_cast<uint2*>(out + (qs + r / H) * o_st + (r % H) * o_sh + (i % CH) * 4) = make_uint2(0u, 0u);
  }
}

// Merge the prefix splits of each row by log-sum-exp. One block per (request, packed row); each of its G
// groups of four warps sums every G-th split (a lane carries one float4 of the 512 value dims), so with
// many splits many partial rows are in flight at once; group 0 adds the groups up and stores.
// Launched as a programmatic dependent of the main kernel: its blocks are scheduled as main-kernel CTAs
// retire and wait (griddepcontrol.wait) for the whole main grid before reading a partial result.
// Groups per row: one below 16 splits, 4 from 16, 8 from 32, so that each group sums at least 4 splits. 8 groups
// took ~0.5 us off batch 1 / 32k (65 splits) and added 1.4 us at b1/h8/n64/4k (16 splits).
constexpr int COMBINE_SPLITS_4 = 16, COMBINE_SPLITS_8 = 32;
template <class C, int G>
__global__ void __launch_bounds__(128 * G) combine_kernel(const Params p) {
  __shared__ float4 part[G > 1 ? G - 1 : 1][128];
  const int col = threadIdx.x & 127, grp = threadIdx.x >> 7;
  const int gr = blockIdx.x, b = blockIdx.y;
  const int64_t qs = load_idx(p.qo_indptr, p.qo_t, b);
  const int qlen = static_cast<int>(load_idx(p.qo_indptr, p.qo_t, b + 1) - qs);
  const int rows = live_tokens(p.q_live, b, qlen) * p.H;
  if (gr >= rows) {  // padding, or a row the main kernel wrote as zeros
    // Block (0, 0) waits even so: this grid must not end before the main one (every block of it may return here).
    if (gr == 0 && b == 0) asm volatile("griddepcontrol.wait;\n" ::: "memory");
    return;
  }
  const int P = static_cast<int>(load_idx(p.kv_indptr, p.kvp_t, b + 1) - load_idx(p.kv_indptr, p.kvp_t, b));
  int lo, hi, used;
  const int splits = live_splits(p.splits, p.m_tiles, p.pair, rows, C::BM);  // as the main kernel split this tile
  split_range(P + qlen, splits, 0, C::BN, lo, hi, used);
  const int mt = gr / C::BM, r = gr % C::BM;
  const int64_t base = (static_cast<int64_t>(b) * p.m_tiles * p.splits + mt * splits) * C::BM + r;
  stamp_combine(0);
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  stamp_combine(1);
  // One pass over the splits: each group keeps a running maximum of their log-sum-exp and rescales when
  // it grows (a branch uniform over the block), so the partial rows are requested without waiting for a
  // maximum over all splits first.
  float mx = -INFINITY, wsum = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* src = reinterpret_cast<const float4*>(p.part_o + base * DV) + col;
#pragma unroll 8
  for (int s = grp; s < used; s += G) {
    const float lse = p.part_lse[base + s * C::BM];
    const float4 v = src[static_cast<int64_t>(s) * C::BM * DV / 4];
    if (lse > mx) {
      const float f = exp2f(mx - lse);  // 0 while mx is -inf
      acc.x *= f; acc.y *= f; acc.z *= f; acc.w *= f; wsum *= f;
      mx = lse;
    }
    const float w = lse == -INFINITY ? 0.f : exp2f(lse - mx);  // a split with no visible key adds nothing
    acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w; wsum += w;
  }
  if constexpr (G > 1) {
    __shared__ float g_max[G], g_sum[G];
    if (grp > 0) part[grp - 1][col] = acc;
    if (col == 0) g_max[grp] = mx, g_sum[grp] = wsum;
    __syncthreads();
    if (grp > 0) return;
    float m_all = mx;
#pragma unroll
    for (int g = 1; g < G; ++g) m_all = fmaxf(m_all, g_max[g]);
    const float f = mx == -INFINITY ? 0.f : exp2f(mx - m_all);
    acc.x *= f; acc.y *= f; acc.z *= f; acc.w *= f; wsum *= f;
#pragma unroll
    for (int g = 1; g < G; ++g) {
      const float fg = g_max[g] == -INFINITY ? 0.f : exp2f(g_max[g] - m_all);
      const float4 v = part[g - 1][col];
      acc.x += fg * v.x; acc.y += fg * v.y; acc.z += fg * v.z; acc.w += fg * v.w;
      wsum += fg * g_sum[g];
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  __nv_bfloat16* dst = p.out + (qs + gr / p.H) * p.o_st + (gr % p.H) * p.o_sh + col * 4;
  __nv_bfloat162 lo2 = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  __nv_bfloat162 hi2 = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t*>(&lo2);
  packed.y = *reinterpret_cast<uint32_t*>(&hi2);
  *reinterpret_cast<uint2*>(dst) = packed;
  stamp_combine(2);
}

}  // namespace kdtree
