// What one CTA reads and holds: the launch's parameters, the hand-offs between its two warp roles, its share of a
// request (Work), its epilogue's plan, and its shared memory as a struct.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "kdtree_verify.h"
#include "tile_config.cuh"

namespace kdtree {

struct Params {
  const __nv_bfloat16* q; int64_t q_st, q_sh;
  const __nv_bfloat16* k_ext; int64_t k_ext_st;
  const __nv_bfloat16* v_ext; int64_t v_ext_st;
  const __nv_bfloat16* k_buf; int64_t k_buf_st;
  const void* qo_indptr; const void* kv_indptr; const void* kv_indices; const void* mask_indptr;
  int qo_t, kvp_t, kvi_t, mi_t;
  const uint8_t* mask;
  __nv_bfloat16* out; int64_t o_st, o_sh;
  float* part_o; float* part_lse;
  unsigned long long* counter; unsigned long long* counter_mirror;
  float scale_log2;
  float k_scale, v_scale;  // an fp8 pool's scales (the bf16 kernels read neither)
  int H, splits, m_tiles;
  int pair;  // two splits, launched in clusters of two CTAs that merge on chip (see the kernel's epilogue)
  const int32_t* q_live;  // [batch] or nullptr: each request's live tokens (kdtree_verify_args.q_live)
};

__device__ __forceinline__ int64_t load_idx(const void* p, int t, int64_t i) {
  return t == KDTREE_I64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
}

// Request b's live tokens: its first q_live[b] (clamped to [0, qlen]), or all qlen without q_live.
__device__ __forceinline__ int live_tokens(const int32_t* q_live, int b, int qlen) {
  return q_live == nullptr ? qlen : min(max(q_live[b], 0), qlen);
}

// The splits of each live row tile of a request with `rows` live rows. The launch's grid is planned for every row
// (a graph captured at the whole tree replays a cut of it), so a cut leaves whole row tiles idle; their CTAs take more
// splits of the live tiles instead, which shortens the request's slowest CTA rather than only the total work. CTA
// (split, mt) of the grid becomes split c % n of live tile c / n, c = mt * splits + split. Kept where the plan has no
// workspace for more partial rows (one split) or merges on chip (a pair); the main kernel and the combine agree.
__device__ __forceinline__ int live_splits(int splits, int m_tiles, bool pair, int rows, int BM) {
  const int live_tiles = (rows + BM - 1) / BM;
  if (splits == 1 || pair || live_tiles == 0 || live_tiles >= m_tiles) return splits;
  return max(splits, min(MAX_LIVE_SPLITS, m_tiles * splits / live_tiles));
}

// Producer / consumer hand-offs between the two warp roles; `n` counts the threads of both.
__device__ __forceinline__ void bar_sync(int id, int n) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

// Keys [lo, hi) of request b that split s covers; the same arithmetic in both kernels.
__device__ __forceinline__ void split_range(int L, int splits, int s, int BN, int& lo, int& hi, int& used) {
  int want = (L + MIN_KEYS_PER_SPLIT - 1) / MIN_KEYS_PER_SPLIT;
  used = max(1, min(splits, want));
  int chunk = (L + used - 1) / used;
  chunk = (chunk + BN - 1) / BN * BN;
  used = (L + chunk - 1) / chunk;  // rounding up the chunk can leave trailing splits empty
  if (L == 0) used = 0;
  lo = s * chunk;
  hi = min(L, lo + chunk);
}

// What one CTA works on: rows [m0, m0 + BM) of request b (of its `rows`: the live tokens' x H), keys [k_lo, k_hi) of prefix ++ draft, in ntiles tiles.
// A bf16 pool: tile t starts at k_lo + t * BN (a tile can hold prefix and draft keys). An fp8 pool: tiles
// 0..np-1 are the prefix's (fp8 in shared memory; the last one masked past P), from np on the draft's (f16), so
// that a tile holds one format: tile t >= np starts at d_lo + (t - np) * BN, d_lo = max(k_lo, P).
struct Work {
  int64_t qs, kv0, mbase;
  int qlen, rows, m0, P, L, k_lo, k_hi, ntiles, np, d_lo;  // np, d_lo: an fp8 pool's only
  template <bool FP8>
  __device__ int start(int t, int BN) const {
    if constexpr (FP8) return t < np ? k_lo + t * BN : d_lo + (t - np) * BN;
    return k_lo + t * BN;
  }
  __device__ bool draft_tile(int t) const { return t >= np; }  // an fp8 pool's tiles only
};

// What a CTA does with its rows after the key loop, decided at launch and kept in shared memory rather
// than in registers through the loop.
struct Epilogue {
  // bf16 output; a partial row for the combine; merged with the other split's rows, then bf16 output
  enum Mode : int { kStore, kPartial, kPair };
  int mode;
  int r_lo;  // kPair: the first of the BM/2 rows this CTA merges and stores
  int64_t row0;  // kPartial: the partial row block in the workspace
};

// One CTA's dynamic shared memory, in order. The staged partial rows of the epilogue reuse q and k (contiguous:
// every part is a whole number of 128-byte lines), the statistics after them stay intact.
template <class C>
struct SmemLayout {
  uint8_t q[C::SMEM_Q];  // Q rows (k-steps Q_FROM..), swizzled
  uint8_t k[C::SMEM_K];  // STAGES key tiles, swizzled
  uint8_t p[C::SMEM_P];  // P of two tiles (bf16)
  float alpha[2][C::BM];  // each P buffer's rescale factors
  float l_fin[C::BM];  // final row sums and maxima (score warps -> epilogue)
  float m_fin[C::BM];
  Epilogue epi;
};

// Pointers into the layout, as the warps use them.
template <class C>
struct Smem {
  uint8_t* q;
  uint8_t* k;
  uint8_t* p;
  float* alpha;  // [2][BM]
  float* l_fin;  // [BM]
  float* m_fin;  // [BM]
  Epilogue* epi;
  __device__ explicit Smem(uint8_t* base) : Smem(*reinterpret_cast<SmemLayout<C>*>(base)) {}
  __device__ explicit Smem(SmemLayout<C>& s)
      : q(s.q), k(s.k), p(s.p), alpha(&s.alpha[0][0]), l_fin(s.l_fin), m_fin(s.m_fin), epi(&s.epi) {}
};
#define KDTREE_TILE_CONFIG(NAME, ID, Type, ...) \
  static_assert(sizeof(SmemLayout<Type>) == Type::SMEM, "Cfg::SMEM is the layout's size: no padding between its parts");
#include "kdtree_tile_configs.h"
#undef KDTREE_TILE_CONFIG

}  // namespace kdtree
