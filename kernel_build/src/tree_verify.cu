// MLA tree-verify attention: one pass over each request's prefix and draft keys, all of a request's
// (draft token x head) rows packed into the MMA M dimension so every key row is read once per row
// tile; the prefix is split across CTAs and merged by log-sum-exp. Tensor cores through mma.sync
// m16n8k16 (bf16 in, fp32 accumulate), the instruction sm_90, sm_100 and sm_120 all have.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "kdtree_verify.h"
#include "ptx.cuh"

namespace kdtree {

constexpr int QK = KDTREE_QK_DIM;  // 512 latent + 64 rope
constexpr int DV = KDTREE_V_DIM;
constexpr int ROW_BYTES = QK * 2 + 16;  // +16 B of padding: 8 ldmatrix rows land in 8 different bank groups
constexpr int ROW_CHUNKS = QK * 2 / 16;  // 16-byte chunks per key row (72)
constexpr int V_CHUNKS = DV * 2 / 16;  // 64
constexpr int MIN_KEYS_PER_SPLIT = 256;  // below this, partial-result traffic outweighs the parallelism
constexpr int MAX_SPLITS = 128;

template <int BM_, int BN_, int STAGES_, int NW_>
struct Cfg {
  static constexpr int BM = BM_;  // packed (token, head) rows per CTA
  static constexpr int BN = BN_;  // keys per pipeline stage
  static constexpr int STAGES = STAGES_;
  static constexpr int NW = NW_;
  static constexpr int NT = NW * 32;
  static constexpr int RB = BM / 16;  // 16-row blocks
  static constexpr int KG = NW / RB;  // key groups in the QK phase (warps that share a row block)
  static constexpr int KW = BN / KG;  // keys per warp in the QK phase
  static constexpr int NB_QK = KW / 8;
  static constexpr int DV_W = DV / NW;  // value dims per warp in the PV phase (all BM rows)
  static constexpr int NB_PV = DV_W / 8;
  // With BM <= BN, P (BM x BN bf16) lives in the staged keys' rope columns (dims 512..575), dead once
  // QK is done: row r of P in key row r, so no separate buffer (this is what lets wide take 64-key tiles).
  static constexpr bool P_IN_K = BM <= BN && BN * 2 <= (QK - DV) * 2;
  static constexpr int P_ROW_BYTES = P_IN_K ? ROW_BYTES : BN * 2 + 16;
  static constexpr int LD_THREADS = NT / BN;  // loader threads per key row
  static constexpr bool QK_DUAL = NB_QK < 4;  // fewer than 4 independent accumulators: add a second set
  static constexpr int SMEM_Q = BM * ROW_BYTES;
  static constexpr int SMEM_K = STAGES * BN * ROW_BYTES;
  static constexpr int SMEM_P = P_IN_K ? 0 : BM * P_ROW_BYTES;
  static constexpr int SMEM_STATS = (2 * KG * BM + 2 * BM) * 4;  // row max / sum per key group; alpha; final max
  static constexpr int SMEM = SMEM_Q + SMEM_K + SMEM_P + SMEM_STATS;
  static_assert(BM % 16 == 0 && NW % RB == 0 && KW % 8 == 0 && BN % 16 == 0, "tile shape");
  static_assert(DV_W % 16 == 0, "PV n-blocks come in pairs");
  static_assert(NT % BN == 0 && ROW_CHUNKS % LD_THREADS == 0 && (BM * ROW_CHUNKS) % NT == 0, "even load split");
};
using Wide = Cfg<64, 64, 2, 8>;  // sm_90 / sm_100: 220.5 KB shared
using Compact = Cfg<32, 16, 3, 4>;  // sm_120: fits 99 KB
static_assert(Compact::SMEM <= 101376, "sm_120 allows 99 KB of shared memory per block");
static_assert(Wide::SMEM <= 232448, "sm_90 / sm_100 allow 227 KB of shared memory per block");

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
  int H, splits, m_tiles;
};

__device__ __forceinline__ int64_t load_idx(const void* p, int t, int64_t i) {
  return t == KDTREE_I64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
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

template <class C>
__global__ void __launch_bounds__(C::NT, 1) tree_verify_kernel(const Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* Qs = smem;
  uint8_t* Ks = Qs + C::SMEM_Q;
  uint8_t* Ps = Ks + C::SMEM_K;
  float* red_max = reinterpret_cast<float*>(Ps + C::SMEM_P);  // [KG][BM]
  float* red_sum = red_max + C::KG * C::BM;  // [KG][BM]
  float* alpha_s = red_sum + C::KG * C::BM;  // [BM]
  float* mfin_s = alpha_s + C::BM;  // [BM]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, mt = blockIdx.y, b = blockIdx.z;

  if (p.counter != nullptr && split == 0 && mt == 0 && b == 0 && tid == 0) {
    unsigned long long v = atomicAdd(p.counter, 1ull) + 1ull;
    if (p.counter_mirror != nullptr) *reinterpret_cast<volatile unsigned long long*>(p.counter_mirror) = v;
  }

  const int64_t qs = load_idx(p.qo_indptr, p.qo_t, b);
  const int qlen = static_cast<int>(load_idx(p.qo_indptr, p.qo_t, b + 1) - qs);
  const int rows = qlen * p.H;
  const int m0 = mt * C::BM;
  if (m0 >= rows) return;
  const int64_t kv0 = load_idx(p.kv_indptr, p.kvp_t, b);
  const int P = static_cast<int>(load_idx(p.kv_indptr, p.kvp_t, b + 1) - kv0);
  const int L = P + qlen;
  int k_lo, k_hi, used;
  split_range(L, p.splits, split, C::BN, k_lo, k_hi, used);
  if (split >= used) return;
  const int64_t mbase = p.mask != nullptr ? load_idx(p.mask_indptr, p.mi_t, b) : 0;

  // Q tile: rows past this request's rows are zero-filled (their results are never stored).
#pragma unroll
  for (int it = 0; it < C::BM * ROW_CHUNKS / C::NT; ++it) {
    int c = tid + it * C::NT, r = c / ROW_CHUNKS, col = c % ROW_CHUNKS;
    int gr = m0 + r;
    bool ok = gr < rows;
    const __nv_bfloat16* src = p.q;
    if (ok) src = p.q + (qs + gr / p.H) * p.q_st + (gr % p.H) * p.q_sh + col * 8;
    cp_async16(Qs + r * ROW_BYTES + col * 16, src, ok);
  }
  // Key tiles: LD_THREADS threads per key row, each copying its share of the 72 16-byte chunks. A thread
  // needs one pool slot per tile, read one tile ahead so the index load's latency hides behind a tile of work.
  const int ld_key = tid / C::LD_THREADS, ld_sub = tid % C::LD_THREADS;
  auto slot_of = [&](int t) -> int64_t {
    const int kp = k_lo + t * C::BN + ld_key;
    return kp < P && kp < k_hi ? load_idx(p.kv_indices, p.kvi_t, kv0 + kp) : 0;
  };
  auto load_tile = [&](int t, int stage, int64_t slot) {
    const int kp = k_lo + t * C::BN + ld_key;
    const bool ok = kp < k_hi;  // past the range: zero-filled, then masked
    const __nv_bfloat16* src = p.k_buf;
    if (ok) src = kp < P ? p.k_buf + slot * p.k_buf_st : p.k_ext + (qs + kp - P) * p.k_ext_st;
    uint8_t* dst = Ks + (stage * C::BN + ld_key) * ROW_BYTES;
#pragma unroll
    for (int i = 0; i < ROW_CHUNKS / C::LD_THREADS; ++i) {
      const int col = ld_sub + C::LD_THREADS * i;
      cp_async16(dst + col * 16, ok ? src + col * 8 : src, ok);
    }
  };

  const int ntiles = (k_hi - k_lo + C::BN - 1) / C::BN;
#pragma unroll
  for (int s = 0; s < C::STAGES - 1; ++s) {
    if (s < ntiles) load_tile(s, s, slot_of(s));
    cp_async_commit();
  }
  int64_t next_slot = slot_of(C::STAGES - 1);

  const int rb_qk = warp % C::RB, kg = warp / C::RB;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
  float o[C::RB][C::NB_PV][4];
#pragma unroll
  for (int i = 0; i < C::RB; ++i)
#pragma unroll
    for (int j = 0; j < C::NB_PV; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;

  // Draft-token index of this thread's two QK rows (for the tree mask).
  int qi[2], qrow_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    int gr = m0 + rb_qk * 16 + (lane >> 2) + 8 * h;
    qrow_ok[h] = gr < rows;
    qi[h] = qrow_ok[h] ? gr / p.H : 0;
  }

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<C::STAGES - 2>();
    __syncthreads();  // tile t landed; every warp is done with tile t-1 (its stage, P and stats)
    if (t + C::STAGES - 1 < ntiles) load_tile(t + C::STAGES - 1, (t + C::STAGES - 1) % C::STAGES, next_slot);
    cp_async_commit();
    next_slot = slot_of(t + C::STAGES);  // consumed next iteration

    uint8_t* Kt = Ks + (t % C::STAGES) * C::BN * ROW_BYTES;
    const int kt0 = k_lo + t * C::BN;

    // S = Q K^T for 16 rows x KW keys; with few n-blocks, two accumulator sets (even/odd k-steps) halve
    // the mma dependency chain.
    float s[C::NB_QK][4], s2[C::NB_QK][4];
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = s2[j][e] = 0.f;
    const uint32_t q_addr = smem_u32(Qs + (rb_qk * 16 + (lane & 15)) * ROW_BYTES + (lane >> 4) * 16);
    const uint32_t k_addr = smem_u32(Kt + (kg * C::KW + ((lane >> 4) << 3) + (lane & 7)) * ROW_BYTES + ((lane >> 3) & 1) * 16);
    auto qk_step = [&](int ks, float (&acc)[C::NB_QK][4]) {
      uint32_t a[4];
      ldmatrix_x4(a, q_addr + ks * 32);
#pragma unroll
      for (int nb = 0; nb + 1 < C::NB_QK; nb += 2) {
        uint32_t bb[4];
        ldmatrix_x4(bb, k_addr + nb * 8 * ROW_BYTES + ks * 32);
        mma_bf16(acc[nb], a, bb[0], bb[1]);
        mma_bf16(acc[nb + 1], a, bb[2], bb[3]);
      }
      if constexpr (C::NB_QK % 2 == 1) {
        uint32_t bb[2];
        ldmatrix_x2(bb, k_addr + (C::NB_QK - 1) * 8 * ROW_BYTES + ks * 32);
        mma_bf16(acc[C::NB_QK - 1], a, bb[0], bb[1]);
      }
    };
    if constexpr (C::QK_DUAL) {
#pragma unroll 2
      for (int ks = 0; ks < QK / 16; ks += 2) {
        qk_step(ks, s);
        qk_step(ks + 1, s2);
      }
#pragma unroll
      for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] += s2[j][e];
    } else {
#pragma unroll 4
      for (int ks = 0; ks < QK / 16; ++ks) qk_step(ks, s);
    }

    // Scale into the log2 domain; mask draft keys (tree or causal) and keys past the range.
    const bool edge = kt0 + C::BN > P;
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[j][e] * p.scale_log2;
        if (edge) {
          int h = e >> 1;
          int kp = kt0 + kg * C::KW + j * 8 + 2 * (lane & 3) + (e & 1);
          bool vis = kp < P;
          if (!vis && kp < k_hi) {
            if (!qrow_ok[h]) vis = true;
            else if (p.mask != nullptr) vis = p.mask[mbase + static_cast<int64_t>(qi[h]) * L + kp] != 0;
            else vis = kp - P <= qi[h];
          }
          if (!vis) v = -INFINITY;
        }
        s[j][e] = v;
      }

    // Row max across the key groups that share these rows.
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j) {
      mx[0] = fmaxf(mx[0], fmaxf(s[j][0], s[j][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
    }
    const int r0 = rb_qk * 16 + (lane >> 2);
    if ((lane & 3) == 0) {
      red_max[kg * C::BM + r0] = mx[0];
      red_max[kg * C::BM + r0 + 8] = mx[1];
    }
    __syncthreads();  // also: every warp finished reading this stage's keys for QK

    // Draft values from a separate tensor replace the latent part of the staged draft rows.
    if (p.v_ext != nullptr && edge) {
      const int d_lo = max(kt0, P), d_hi = min(kt0 + C::BN, k_hi);
      for (int c = tid; c < (d_hi - d_lo) * V_CHUNKS; c += C::NT) {
        int kp = d_lo + c / V_CHUNKS, col = c % V_CHUNKS;
        uint4 v = *reinterpret_cast<const uint4*>(p.v_ext + (qs + kp - P) * p.v_ext_st + col * 8);
        *reinterpret_cast<uint4*>(Kt + (kp - kt0) * ROW_BYTES + col * 16) = v;
      }
    }

    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tm = -INFINITY;
#pragma unroll
      for (int g = 0; g < C::KG; ++g) tm = fmaxf(tm, red_max[g * C::BM + r0 + 8 * h]);
      float m_new = fmaxf(m_run[h], tm);
      float m_use = m_new == -INFINITY ? 0.f : m_new;  // a fully masked row so far: keep zeros, no NaN
      alpha[h] = exp2f(m_run[h] - m_use);
      m_run[h] = m_new;
      l_run[h] *= alpha[h];
#pragma unroll
      for (int j = 0; j < C::NB_QK; ++j) {
        s[j][2 * h] = exp2f(s[j][2 * h] - m_use);
        s[j][2 * h + 1] = exp2f(s[j][2 * h + 1] - m_use);
        l_run[h] += s[j][2 * h] + s[j][2 * h + 1];
      }
    }
    // P in bf16 (as SGLang's Triton kernel feeds its P.V product); the row sum stays fp32.
    uint8_t* const Pt = C::P_IN_K ? Kt + DV * 2 : Ps;
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j) {
      int col = kg * C::KW + j * 8 + 2 * (lane & 3);
      *reinterpret_cast<__nv_bfloat162*>(Pt + r0 * C::P_ROW_BYTES + col * 2) = __floats2bfloat162_rn(s[j][0], s[j][1]);
      *reinterpret_cast<__nv_bfloat162*>(Pt + (r0 + 8) * C::P_ROW_BYTES + col * 2) = __floats2bfloat162_rn(s[j][2], s[j][3]);
    }
    if (kg == 0 && (lane & 3) == 0) {
      alpha_s[r0] = alpha[0];
      alpha_s[r0 + 8] = alpha[1];
    }
    __syncthreads();

    // O = O * alpha + P V for all BM rows x this warp's DV_W value dims.
    const int d0 = warp * C::DV_W;
#pragma unroll
    for (int rb = 0; rb < C::RB; ++rb) {
      float a0 = alpha_s[rb * 16 + (lane >> 2)], a1 = alpha_s[rb * 16 + (lane >> 2) + 8];
      if (a0 != 1.f || a1 != 1.f) {  // the running max rarely moves once a few tiles are in
#pragma unroll
        for (int j = 0; j < C::NB_PV; ++j) {
          o[rb][j][0] *= a0; o[rb][j][1] *= a0; o[rb][j][2] *= a1; o[rb][j][3] *= a1;
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < C::BN / 16; ++kk) {
      uint32_t a[C::RB][4];
#pragma unroll
      for (int rb = 0; rb < C::RB; ++rb)
        ldmatrix_x4(a[rb], smem_u32(Pt + (rb * 16 + (lane & 15)) * C::P_ROW_BYTES + kk * 32 + (lane >> 4) * 16));
      const uint32_t v_addr =
          smem_u32(Kt + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_BYTES + (d0 + (lane >> 4) * 8) * 2);
#pragma unroll
      for (int nb = 0; nb < C::NB_PV; nb += 2) {
        uint32_t bb[4];
        ldmatrix_x4_trans(bb, v_addr + nb * 16);
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb) {
          mma_bf16(o[rb][nb], a[rb], bb[0], bb[1]);
          mma_bf16(o[rb][nb + 1], a[rb], bb[2], bb[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Row sums across the key groups, then normalise and store.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  {
    const int r0 = rb_qk * 16 + (lane >> 2);
    if ((lane & 3) == 0) {
      red_sum[kg * C::BM + r0] = l_run[0];
      red_sum[kg * C::BM + r0 + 8] = l_run[1];
      if (kg == 0) {
        mfin_s[r0] = m_run[0];
        mfin_s[r0 + 8] = m_run[1];
      }
    }
  }
  __syncthreads();

  const int d0 = warp * C::DV_W;
#pragma unroll
  for (int rb = 0; rb < C::RB; ++rb)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = rb * 16 + (lane >> 2) + 8 * h;
      const int gr = m0 + r;
      float l = 0.f;
#pragma unroll
      for (int g = 0; g < C::KG; ++g) l += red_sum[g * C::BM + r];
      const float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros, as the Triton kernel writes
      if (p.splits == 1) {
        if (gr < rows) {
          __nv_bfloat16* dst = p.out + (qs + gr / p.H) * p.o_st + (gr % p.H) * p.o_sh + d0 + 2 * (lane & 3);
#pragma unroll
          for (int j = 0; j < C::NB_PV; ++j)
            *reinterpret_cast<__nv_bfloat162*>(dst + j * 8) =
                __floats2bfloat162_rn(o[rb][j][2 * h] * inv, o[rb][j][2 * h + 1] * inv);
        }
      } else {
        const int64_t wrow = ((static_cast<int64_t>(b) * p.m_tiles + mt) * p.splits + split) * C::BM + r;
        float* dst = p.part_o + wrow * DV + d0 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < C::NB_PV; ++j)
          *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[rb][j][2 * h] * inv, o[rb][j][2 * h + 1] * inv);
        if (warp == 0 && (lane & 3) == 0) p.part_lse[wrow] = l > 0.f ? mfin_s[r] + log2f(l) : -INFINITY;
      }
    }
}

// Merge the prefix splits of each row by log-sum-exp. One block per (request, packed row); its four
// warps each own 128 of the 512 value dims, so a lane carries one float4 and many splits stay in flight.
template <class C>
__global__ void __launch_bounds__(128) combine_kernel(const Params p) {
  const int lane = threadIdx.x & 31, quarter = threadIdx.x >> 5;
  const int gr = blockIdx.x, b = blockIdx.y;
  const int64_t qs = load_idx(p.qo_indptr, p.qo_t, b);
  const int qlen = static_cast<int>(load_idx(p.qo_indptr, p.qo_t, b + 1) - qs);
  if (gr >= qlen * p.H) return;
  const int P = static_cast<int>(load_idx(p.kv_indptr, p.kvp_t, b + 1) - load_idx(p.kv_indptr, p.kvp_t, b));
  int lo, hi, used;
  split_range(P + qlen, p.splits, 0, C::BN, lo, hi, used);
  const int mt = gr / C::BM, r = gr % C::BM;
  const int64_t base = (static_cast<int64_t>(b) * p.m_tiles + mt) * p.splits * C::BM + r;
  float mx = -INFINITY;
  for (int s = lane; s < used; s += 32) mx = fmaxf(mx, p.part_lse[base + s * C::BM]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  if (mx != -INFINITY) {
    const float4* src = reinterpret_cast<const float4*>(p.part_o + base * DV) + quarter * 32 + lane;
#pragma unroll 8
    for (int s = 0; s < used; ++s) {
      const float lse = p.part_lse[base + s * C::BM];
      const float w = lse == -INFINITY ? 0.f : exp2f(lse - mx);
      const float4 v = src[static_cast<int64_t>(s) * C::BM * DV / 4];
      wsum += w;
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  __nv_bfloat16* dst = p.out + (qs + gr / p.H) * p.o_st + (gr % p.H) * p.o_sh + (quarter * 32 + lane) * 4;
  __nv_bfloat162 lo2 = __floats2bfloat162_rn(acc.x * inv, acc.y * inv);
  __nv_bfloat162 hi2 = __floats2bfloat162_rn(acc.z * inv, acc.w * inv);
  uint2 packed;
  packed.x = *reinterpret_cast<uint32_t*>(&lo2);
  packed.y = *reinterpret_cast<uint32_t*>(&hi2);
  *reinterpret_cast<uint2*>(dst) = packed;
}

// ---------------------------------------------------------------------------------------------------
// Host side.

thread_local char g_error[256] = "";

static int fail(int code, const char* msg) {
  snprintf(g_error, sizeof g_error, "%s", msg);
  return code;
}

struct Plan {
  int m_tiles, splits;
  size_t ws_bytes;
};

template <class C>
static Plan plan(int batch, int H, int max_q_len, int cta_slots) {
  Plan pl;
  pl.m_tiles = (max_q_len * H + C::BM - 1) / C::BM;
  const long base = static_cast<long>(batch) * pl.m_tiles;
  // Split each request's keys so the grid fills the device's resident CTA slots in one wave
  // (rounding up would leave a second, nearly empty wave).
  pl.splits = static_cast<int>(std::max<long>(1, std::min<long>(MAX_SPLITS, cta_slots / base)));
  pl.ws_bytes = pl.splits == 1 ? 0 : static_cast<size_t>(base) * pl.splits * C::BM * (DV + 1) * sizeof(float);
  return pl;
}

template <class C>
static int launch(const kdtree_verify_args* a, cudaStream_t stream) {
  const Plan pl = plan<C>(a->batch, a->num_heads, a->max_q_len, a->cta_slots);
  if (a->workspace_bytes < pl.ws_bytes || (pl.ws_bytes > 0 && a->workspace == nullptr))
    return fail(KDTREE_ERR_WORKSPACE, "workspace is smaller than kdtree_verify_workspace_bytes()");
  static thread_local int attr_set_device = -1;
  int dev = 0;
  cudaGetDevice(&dev);
  if (attr_set_device != dev) {  // once per thread and device, outside the steady state
    cudaError_t e = cudaFuncSetAttribute(tree_verify_kernel<C>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (e != cudaSuccess) return fail(KDTREE_ERR_CUDA, cudaGetErrorString(e));
    attr_set_device = dev;
  }
  Params p;
  p.q = static_cast<const __nv_bfloat16*>(a->q); p.q_st = a->q_stride_t; p.q_sh = a->q_stride_h;
  p.k_ext = static_cast<const __nv_bfloat16*>(a->k_ext); p.k_ext_st = a->k_ext_stride;
  p.v_ext = static_cast<const __nv_bfloat16*>(a->v_ext); p.v_ext_st = a->v_ext_stride;
  p.k_buf = static_cast<const __nv_bfloat16*>(a->k_buf); p.k_buf_st = a->k_buf_stride;
  p.qo_indptr = a->qo_indptr; p.qo_t = a->qo_indptr_type;
  p.kv_indptr = a->kv_indptr; p.kvp_t = a->kv_indptr_type;
  p.kv_indices = a->kv_indices; p.kvi_t = a->kv_indices_type;
  p.mask = a->mask; p.mask_indptr = a->mask_indptr; p.mi_t = a->mask_indptr_type;
  p.out = static_cast<__nv_bfloat16*>(a->out); p.o_st = a->out_stride_t; p.o_sh = a->out_stride_h;
  p.part_o = static_cast<float*>(a->workspace);
  p.part_lse = pl.ws_bytes ? p.part_o + static_cast<size_t>(a->batch) * pl.m_tiles * pl.splits * C::BM * DV : nullptr;
  p.counter = a->counter; p.counter_mirror = a->counter_mirror;
  p.scale_log2 = a->sm_scale * 1.4426950408889634f;
  p.H = a->num_heads; p.splits = pl.splits; p.m_tiles = pl.m_tiles;

  dim3 grid(pl.splits, pl.m_tiles, a->batch);
  tree_verify_kernel<C><<<grid, C::NT, C::SMEM, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return fail(KDTREE_ERR_CUDA, cudaGetErrorString(e));
  if (pl.splits > 1) {
    dim3 cgrid(pl.m_tiles * C::BM, a->batch);
    combine_kernel<C><<<cgrid, 128, 0, stream>>>(p);
    e = cudaGetLastError();
    if (e != cudaSuccess) return fail(KDTREE_ERR_CUDA, cudaGetErrorString(e));
  }
  return KDTREE_OK;
}

}  // namespace kdtree

using namespace kdtree;

extern "C" {

__attribute__((visibility("default"))) int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }

__attribute__((visibility("default"))) const char* kdtree_compiled_archs(void) { return KDTREE_ARCHS; }

__attribute__((visibility("default"))) const char* kdtree_last_error(void) { return g_error; }

__attribute__((visibility("default"))) int kdtree_verify_smem_bytes(int config) {
  return config == KDTREE_CONFIG_WIDE ? Wide::SMEM : config == KDTREE_CONFIG_COMPACT ? Compact::SMEM : 0;
}

__attribute__((visibility("default"))) int kdtree_verify_workspace_bytes(int batch, int num_heads, int max_q_len,
                                                                         int cta_slots, int config, size_t* bytes) {
  if (batch < 1 || num_heads < 1 || max_q_len < 1 || cta_slots < 1 || bytes == nullptr)
    return fail(KDTREE_ERR_ARGUMENT, "batch, num_heads, max_q_len and cta_slots must be >= 1");
  if (config == KDTREE_CONFIG_WIDE) *bytes = plan<Wide>(batch, num_heads, max_q_len, cta_slots).ws_bytes;
  else if (config == KDTREE_CONFIG_COMPACT) *bytes = plan<Compact>(batch, num_heads, max_q_len, cta_slots).ws_bytes;
  else return fail(KDTREE_ERR_ARGUMENT, "config must be KDTREE_CONFIG_WIDE or KDTREE_CONFIG_COMPACT");
  return KDTREE_OK;
}

__attribute__((visibility("default"))) int kdtree_verify_launch(const kdtree_verify_args* a, void* stream) {
  // kv_indices may be NULL when no request has a prefix (an empty tensor).
  if (a == nullptr || a->q == nullptr || a->k_ext == nullptr || a->k_buf == nullptr || a->out == nullptr ||
      a->qo_indptr == nullptr || a->kv_indptr == nullptr)
    return fail(KDTREE_ERR_ARGUMENT, "a required pointer is NULL");
  if (a->mask != nullptr && a->mask_indptr == nullptr) return fail(KDTREE_ERR_ARGUMENT, "mask needs mask_indptr");
  if (a->batch < 1 || a->num_heads < 1 || a->max_q_len < 1 || a->cta_slots < 1)
    return fail(KDTREE_ERR_ARGUMENT, "batch, num_heads, max_q_len and cta_slots must be >= 1");
  if (static_cast<long>(a->max_q_len) * a->num_heads > (1L << 24)) return fail(KDTREE_ERR_ARGUMENT, "max_q_len * num_heads too large");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (a->config == KDTREE_CONFIG_WIDE) return launch<Wide>(a, s);
  if (a->config == KDTREE_CONFIG_COMPACT) return launch<Compact>(a, s);
  return fail(KDTREE_ERR_ARGUMENT, "config must be KDTREE_CONFIG_WIDE or KDTREE_CONFIG_COMPACT");
}

}  // extern "C"
