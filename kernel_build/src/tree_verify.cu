// MLA tree-verify attention: one pass over each request's prefix and draft keys, all of a request's
// (draft token x head) rows packed into the MMA M dimension so every key row is read once per row
// tile; the prefix is split across CTAs and merged by log-sum-exp (two splits on chip, in a cluster of
// two CTAs; more in a second kernel). Tensor cores through mma.sync m16n8k16 (bf16 in, fp32 accumulate),
// the instruction sm_90, sm_100 and sm_120 all have. An fp8 pool's prefix tiles take one of two paths (enum
// kdtree_fp8_path): widened exactly to f16 in shared memory once it lands, into the same instruction in f16
// (widen), or mma.sync m16n8k32 fp8 x fp8 with q and P quantised as SGLang's
// Triton kernel does (mma); its scales are applied in fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "kdtree_verify.h"
#include "ptx.cuh"
#include "status.cuh"

namespace kdtree {

constexpr int QK = KDTREE_QK_DIM;  // 512 latent + 64 rope
constexpr int DV = KDTREE_V_DIM;
// A 576-dim row of Q or of a key stage in shared memory: 1152 bytes, 128-byte aligned. Chunk c (16 bytes) of
// row r sits at position (c ^ r) & 7 of its 128-byte group: the 8 rows one ldmatrix reads land in 8 bank
// groups, and every copy writes whole aligned lines (padded rows made the gathers' shared-memory writes
// straddle lines: 2.75x the ideal wavefronts).
constexpr int ROW_BYTES = QK * 2;
// Byte offset of chunk c within a row whose xor key is x (the row index, or for an ldmatrix address the
// lane's row and chunk parity combined).
__device__ __forceinline__ int swz_in_row(int c, int x) { return ((c >> 3) << 7) + (((c ^ x) & 7) << 4); }
__device__ __forceinline__ int swz(int r, int c) { return r * ROW_BYTES + swz_in_row(c, r); }
constexpr int ROPE_CHUNKS = (QK - DV) * 2 / 16;  // 8
constexpr int MIN_KEYS_PER_SPLIT = 128;  // keys per split below which partial-result traffic outweighs parallelism
constexpr int MAX_SPLITS = 128;

// Warp-specialised CTA: NS score warps (16 rows each, all BN keys of a tile) compute S = Q K^T and the
// softmax and hand P to NO output warps (all BM rows, DV/NO value dims each), which accumulate O += P V
// and load the key tiles. The two roles work on different tiles at once (scores of tile t+1 while the
// output warps multiply tile t), so the tensor pipe is fed by one role while the other waits on memory.
template <int BM_, int BN_, int STAGES_, int NO_, int QREG_, bool PIPELINE_, bool Q_DIRECT_>
struct Cfg {
  static constexpr int BM = BM_;  // packed (token, head) rows per CTA
  static constexpr int BN = BN_;  // keys per pipeline stage
  static constexpr int STAGES = STAGES_;  // >= 3: one tile in QK, one in PV, one loading
  static constexpr int NS = BM / 16;  // score warps
  static constexpr int NO = NO_;  // output warps
  static constexpr int NT = (NS + NO) * 32;
  static constexpr int QREG = QREG_;  // k-steps of Q a score warp keeps in registers (the rest: ldmatrix)
  // Score warps overlap tile t's softmax with tile t+1's mma. 15-20% faster for v7-v11's compact (32 rows,
  // 6 warps at 232 registers), but 5-20% slower for wide and 16-27% for today's compact: at 168 registers
  // the third score tile leaves the scheduler no room. No configuration uses it now (a tuning knob).
  static constexpr bool PIPELINE = PIPELINE_;
  // Q_DIRECT: the QREG k-steps held in registers are loaded straight from global memory, and shared memory
  // holds only the k-steps read by ldmatrix (32 KB for 64 rows with QREG 20, instead of 72 KB): what lets
  // 64-row tiles fit sm_120's 99 KB.
  static constexpr bool Q_DIRECT = Q_DIRECT_;
  static constexpr int Q_FROM = Q_DIRECT ? QREG : 0;  // the first k-step of Q in shared memory
  static constexpr int Q_ROW_BYTES = (QK / 16 - Q_FROM) * 32;  // whole 128-byte groups (asserted below)
  static constexpr int RB = BM / 16;
  static constexpr int NB_QK = BN / 8;
  static constexpr int DV_W = DV / NO;  // value dims per output warp
  static constexpr int NB_PV = DV_W / 8;
  static constexpr int CW = DV_W / 8;  // latent 16-byte chunks per key row an output warp loads (its dims)
  static constexpr int LAT_PER_LANE = BN * CW / 32;
  static constexpr int ROPE_PER_WARP = BN * ROPE_CHUNKS / NO;
  static constexpr int ROPE_PER_LANE = (ROPE_PER_WARP + 31) / 32;  // with fewer than 32 a warp, lanes idle
  static constexpr int P_ROW_BYTES = BN * 2 + 16;
  static constexpr int SMEM_Q = BM * Q_ROW_BYTES;
  static constexpr int SMEM_K = STAGES * BN * ROW_BYTES;
  static constexpr int SMEM_P = 2 * BM * P_ROW_BYTES;  // double-buffered: P of tile t+1 while PV reads t
  static constexpr int SMEM_STATS = 4 * BM * 4 + 16;  // alpha x 2 buffers; final row sum and max; Epilogue
  static constexpr int SMEM = SMEM_Q + SMEM_K + SMEM_P + SMEM_STATS;
  // Named barriers (0 is __syncthreads): key tile landed (per stage), P ready / P free (per buffer).
  // A producer never arrives twice at one barrier before its consumers took the first arrival: K[s] is
  // re-armed for tile t+STAGES only after P ready(t), which follows the score warps' sync on K[s] for t;
  // P ready(buf) only after P free(buf) of two tiles back; P free(buf) only after P ready(buf) of its tile.
  // BAR_EPILOGUE: the output warps' partial rows are staged in shared memory.
  static constexpr int BAR_K = 1, BAR_P_READY = BAR_K + STAGES, BAR_P_FREE = BAR_P_READY + 2;
  static constexpr int BAR_EPILOGUE = BAR_P_FREE + 2;
  static_assert(BM % 16 == 0 && STAGES >= 3 && BAR_EPILOGUE < 16, "tile shape");
  // Staged partial rows (fp32, +8 floats per row: the eight rows of one fragment store hit distinct
  // banks) reuse Q and the key stages; the row statistics after them stay intact.
  static constexpr int STAGED_ROW = DV + 8;
  // When all BM rows do not fit, they are staged and stored in rounds of BM / STAGE_ROUNDS rows, and a
  // request split in two goes through the combine (a pair's merge reads the other CTA's rows all at once).
  static constexpr int STAGE_ROUNDS = BM * STAGED_ROW * 4 <= SMEM_Q + SMEM_K ? 1 : 2;
  static constexpr bool PAIR = STAGE_ROUNDS == 1;
  static_assert(BM / STAGE_ROUNDS * STAGED_ROW * 4 <= SMEM_Q + SMEM_K && RB % STAGE_ROUNDS == 0,
                "staged partial rows fit below P and the statistics");
  static_assert(32 % BN == 0 && BN % 16 == 0, "one pool slot per lane and tile");
  static_assert(DV_W % 64 == 0 && 32 % CW == 0 && (BN * CW) % 32 == 0, "output warp split (whole 128-byte groups)");
  static_assert(BN * ROPE_CHUNKS % NO == 0 && (ROPE_PER_WARP % 32 == 0 || ROPE_PER_WARP < 32),
                "rope chunks spread evenly");
  static_assert(QREG <= QK / 16 && (QK / 16 - Q_FROM) % 4 == 0, "Q k-steps; Q's shared rows in 128-byte groups");
};
#ifndef KDTREE_RESCALE_SLACK  // tuning knob: how far (log2 units) a row's max may pass its reference unrescaled
#define KDTREE_RESCALE_SLACK 8.f
#endif
constexpr float RESCALE_SLACK = KDTREE_RESCALE_SLACK;
// An fp8 pool's P (<= 2^RESCALE_SLACK) is stored in f16 (widen) or e4m3 (mma, at most 448).
static_assert(RESCALE_SLACK <= 8.f, "P must stay within e4m3's range");
#ifndef KDTREE_WIDE_QREG  // a tuning knob: Q k-steps held in registers by wide's score warps
#define KDTREE_WIDE_QREG 16
#endif
// sm_90 / sm_100: 12 warps (168 registers each), 191 KB shared, tile by tile.
using Wide = Cfg</*BM=*/64, /*BN=*/32, /*STAGES=*/3, /*NO=*/8, /*QREG=*/KDTREE_WIDE_QREG, /*PIPELINE=*/false,
                 /*Q_DIRECT=*/false>;
#ifndef KDTREE_COMPACT_QREG  // tuning knobs: compact's Q k-steps in registers (a multiple of 4), key stages
#define KDTREE_COMPACT_QREG 20
#endif
#ifndef KDTREE_COMPACT_STAGES
#define KDTREE_COMPACT_STAGES 3
#endif
#ifndef KDTREE_COMPACT_PIPELINE
#define KDTREE_COMPACT_PIPELINE false
#endif
// sm_120: wide's 64 rows and 12 warps in 99 KB: 16-key tiles, and only the ldmatrix part of Q in shared memory.
using Compact = Cfg</*BM=*/64, /*BN=*/16, /*STAGES=*/KDTREE_COMPACT_STAGES, /*NO=*/8, /*QREG=*/KDTREE_COMPACT_QREG,
                    /*PIPELINE=*/KDTREE_COMPACT_PIPELINE, /*Q_DIRECT=*/true>;
static_assert(Compact::SMEM <= 101376, "sm_120 allows 99 KB of shared memory per block");
static_assert(Wide::SMEM <= 232448, "sm_90 / sm_100 allow 227 KB of shared memory per block");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int SMEM_PER_BLOCK = 101376;  // sm_120
#else
constexpr int SMEM_PER_BLOCK = 232448;
#endif

// Tuning builds only (-DKDTREE_TIMELINE, read by bench/timeline.py): %globaltimer stamps per CTA of the
// main kernel, and the first and last of each stamp over the combine's blocks. Other builds compile none.
enum Stamp {
  kEntry, kIndices, kQLanded, kTile0Landed, kFirstP, kOutputLoopDone, kScoreLoopDone,
  kStaged, kPeerReady, kMerged, kEpilogueDone  // epilogue: rows staged; pair: other CTA staged, merged
};
#ifdef KDTREE_TIMELINE
constexpr int TIMELINE_CTAS = 4096, TIMELINE_STAMPS = kEpilogueDone + 1;
__device__ unsigned long long g_timeline[TIMELINE_CTAS][TIMELINE_STAMPS];
__device__ unsigned long long g_timeline_combine[3][2];
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp(Stamp s) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta < TIMELINE_CTAS) g_timeline[cta][s] = globaltimer();
}
__device__ __forceinline__ void stamp_combine(int s) {
  if (threadIdx.x == 0) {
    const unsigned long long t = globaltimer();
    atomicMin(&g_timeline_combine[s][0], t);
    atomicMax(&g_timeline_combine[s][1], t);
  }
}
#else
__device__ __forceinline__ void stamp(Stamp) {}
__device__ __forceinline__ void stamp_combine(int) {}
#endif

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
};

__device__ __forceinline__ int64_t load_idx(const void* p, int t, int64_t i) {
  return t == KDTREE_I64 ? static_cast<const int64_t*>(p)[i] : static_cast<int64_t>(static_cast<const int32_t*>(p)[i]);
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

// What one CTA works on: rows [m0, m0 + BM) of request b, keys [k_lo, k_hi) of prefix ++ draft, in ntiles tiles.
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
static_assert(sizeof(SmemLayout<Wide>) == Wide::SMEM && sizeof(SmemLayout<Compact>) == Compact::SMEM,
              "Cfg::SMEM is the layout's size: no padding between its parts");

// Score warp `sw`: rows sw*16.., every key of each tile. Row max / sum stay in registers (the warp owns
// whole rows); P (bf16, as SGLang's Triton kernel feeds its P.V product) and the rescale factor go to
// shared memory for the output warps.
template <class C, Kv KV, bool MMA8>
__device__ __forceinline__ void score_warp(const Params& p, const Work& w, const Smem<C>& sm, int sw, int lane) {
  // The warp's 16 Q rows, consecutive lanes on consecutive chunks of a row; rows past this request's rows
  // are zero-filled. One row address per row, stepped from the first: a division by H per chunk made Q
  // land ~4 us after the first key tile at launch.
  // Only k-steps Q_FROM.. (Q_ROW_BYTES of each row) go to shared memory.
  int tok = (w.m0 + sw * 16) / p.H, head = (w.m0 + sw * 16) % p.H;
#pragma unroll 4  // fully unrolled, it moved the output warps' loop allocation
  for (int i = 0; i < 16; ++i) {
    const int r = sw * 16 + i;
    const bool ok = w.m0 + r < w.rows;
    const __nv_bfloat16* row = ok ? p.q + (w.qs + tok) * p.q_st + head * p.q_sh + C::Q_FROM * 16 : p.q;
#pragma unroll
    for (int c = lane; c < C::Q_ROW_BYTES / 16; c += 32)
      cp_async16(sm.q + r * C::Q_ROW_BYTES + swz_in_row(c, r), ok ? row + c * 8 : p.q, ok);
    if (++head == p.H) head = 0, ++tok;
  }
  cp_async_commit();
  uint32_t qf[C::QREG > 0 && !MMA8 ? C::QREG : 1][4];
  if constexpr (C::Q_DIRECT && !MMA8) {  // the register part of Q as mma A fragments, straight from global memory
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = w.m0 + sw * 16 + (lane >> 2) + 8 * h;
      const bool ok = gr < w.rows;
      const __nv_bfloat16* base = p.q + (ok ? (w.qs + gr / p.H) * p.q_st + (gr % p.H) * p.q_sh : 0);
      if constexpr (is_fp8(KV)) {  // f16, de-interleaved: slots 2q, 2q+1 are dims 4q, 4q+2; slots 8+2q, 9+2q 4q+1, 4q+3
        const uint2* row = reinterpret_cast<const uint2*>(base) + (lane & 3);
#pragma unroll
        for (int ks = 0; ks < C::QREG; ++ks) {
          const uint2 v = ok ? __ldg(row + ks * 4) : make_uint2(0u, 0u);
          uint4 even, odd;  // only .x of each is used: the lane's four dims
          bf16x16_to_f16_deinterleaved(make_uint4(v.x, v.y, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), even, odd);
          qf[ks][h] = even.x;
          qf[ks][2 + h] = odd.x;
        }
      } else {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(base) + (lane & 3);
#pragma unroll
        for (int ks = 0; ks < C::QREG; ++ks) {
          qf[ks][h] = ok ? __ldg(row + ks * 8) : 0u;
          qf[ks][2 + h] = ok ? __ldg(row + ks * 8 + 4) : 0u;
        }
      }
    }
  }
  // MMA8: this lane's rows of Q (g = lane / 4 and g + 8 of the warp's 16) in global memory, and Q as the pool's fp8
  // type, every 32-dim k-step an m16n8k32 A fragment in registers (72 of them).
  const __nv_bfloat16* q_g[2];
  bool q_ok[2];
  uint32_t q8[MMA8 ? QK / 32 : 1][4];
  if constexpr (MMA8) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = w.m0 + sw * 16 + (lane >> 2) + 8 * h;
      q_ok[h] = gr < w.rows;
      q_g[h] = p.q + (q_ok[h] ? (w.qs + gr / p.H) * p.q_st + (gr % p.H) * p.q_sh : 0);
    }
    auto fp8x4 = [](uint2 v) {  // four bf16 (dims d..d+3) as fp8, exactly as a float's cast
      return f32x4_to_fp8x4<KV == kKvE4m3>(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                           __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    };
#pragma unroll
    for (int ks = 0; ks < QK / 32; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2* row = reinterpret_cast<const uint2*>(q_g[h] + ks * 32) + (lane & 3);  // dims 32ks + 4t..
        q8[ks][h] = fp8x4(q_ok[h] ? __ldg(row) : make_uint2(0u, 0u));
        q8[ks][2 + h] = fp8x4(q_ok[h] ? __ldg(row + 4) : make_uint2(0u, 0u));  // dims 32ks + 16 + 4t..
      }
  }
  // MMA8 with Q_DIRECT: a draft tile's f16 k-step below Q_FROM (not in shared memory), from global memory.
  auto q_f16_global = [&](int ks, uint32_t (&a)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2* row = reinterpret_cast<const uint2*>(q_g[h]) + (lane & 3);
      const uint2 v = q_ok[h] ? __ldg(row + ks * 4) : make_uint2(0u, 0u);
      uint4 even, odd;
      bf16x16_to_f16_deinterleaved(make_uint4(v.x, v.y, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), even, odd);
      a[h] = even.x;
      a[2 + h] = odd.x;
    }
  };
  cp_async_wait<0>();
  __syncwarp();
  if constexpr (is_fp8(KV)) {  // the warp's Q rows in shared memory as f16, each 16-dim block de-interleaved
    constexpr int BLOCKS = C::Q_ROW_BYTES / 32;
#pragma unroll 2
    for (int i = lane; i < 16 * BLOCKS; i += 32) {
      const int r = sw * 16 + i / BLOCKS, blk = i % BLOCKS;
      uint4* c0 = reinterpret_cast<uint4*>(sm.q + r * C::Q_ROW_BYTES + swz_in_row(2 * blk, r));
      uint4* c1 = reinterpret_cast<uint4*>(sm.q + r * C::Q_ROW_BYTES + swz_in_row(2 * blk + 1, r));
      uint4 even, odd;
      bf16x16_to_f16_deinterleaved(*c0, *c1, even, odd);
      *c0 = even;
      *c1 = odd;
    }
    __syncwarp();
  }
  if (sw == 0 && lane == 0) stamp(kQLanded);
  // Lane l reads row sw*16 + (l & 15), chunk 2*ks + (l >> 4) of Q. With 2*ks even, the chunk's low bit
  // (l >> 4) goes into the xor key q_x with the row (the same holds for the K and V addresses below).
  const uint32_t q_row = smem_u32(sm.q + (sw * 16 + (lane & 15)) * C::Q_ROW_BYTES);
  const int q_x = ((lane >> 4) ^ lane) & 7;
  auto q_at = [&](int ks) { return q_row + swz_in_row(2 * (ks - C::Q_FROM), q_x); };
  if constexpr (!C::Q_DIRECT && !MMA8) {
#pragma unroll
    for (int ks = 0; ks < C::QREG; ++ks) ldmatrix_x4(qf[ks], q_at(ks));
  }

  const int r0 = sw * 16 + (lane >> 2);
  int qi[2];
  bool qrow_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = w.m0 + r0 + 8 * h;
    qrow_ok[h] = gr < w.rows;
    qi[h] = qrow_ok[h] ? gr / p.H : 0;
  }
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  // S = Q K^T of tile t (16 rows x BN keys, raw scores) in two accumulator sets (even / odd k-steps:
  // half the mma dependency chain); straight-line code, so it can interleave with other work.
  auto q_frag = [&](int ks, uint32_t (&a)[4]) {
    if constexpr (MMA8) {  // a draft tile's: Q's f16 k-steps are in shared memory from Q_FROM on
      if (ks >= C::Q_FROM) ldmatrix_x4(a, q_at(ks));
      else q_f16_global(ks, a);
    } else if (ks < C::QREG) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = qf[ks < C::QREG ? ks : 0][e];
    } else {
      ldmatrix_x4(a, q_at(ks));
    }
  };
  auto scores = [&](int t, float (&sc)[C::NB_QK][4], float (&s2)[C::NB_QK][4], auto&& side) {
    const int stage = t % C::STAGES;
    bar_sync(C::BAR_K + stage, C::NT);
    const uint8_t* Kt = sm.k + stage * C::BN * ROW_BYTES;
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[j][e] = s2[j][e] = 0.f;
    if constexpr (MMA8) {
      if (!w.draft_tile(t)) {  // fp8 x fp8, addressed as the bf16 rows below (a k-step is 32 fp8 dims, two chunks):
        // the x4 gives b0, b1 of n-tiles nb and nb + 1
        const uint32_t k_row = smem_u32(Kt + (((lane >> 4) << 3) + (lane & 7)) * ROW_BYTES);
        const int k_x = (((lane >> 3) & 1) ^ lane) & 7;
#pragma unroll
        for (int ks = 0; ks < QK / 32; ++ks) {
          side(ks);
          float(&acc)[C::NB_QK][4] = (ks & 1) ? s2 : sc;
#pragma unroll
          for (int nb = 0; nb < C::NB_QK; nb += 2) {
            uint32_t bb[4];
            ldmatrix_x4(bb, k_row + nb * 8 * ROW_BYTES + swz_in_row(2 * ks, k_x));
            mma_fp8<KV == kKvE4m3, KV == kKvE4m3>(acc[nb], q8[ks], bb[0], bb[1]);
            mma_fp8<KV == kKvE4m3, KV == kKvE4m3>(acc[nb + 1], q8[ks], bb[2], bb[3]);
          }
        }
        return;
      }
    }
    // bf16 key rows, or an fp8 pool's tile as f16, de-interleaved (a draft tile, or a widened prefix tile).
    // Lane l reads key row nb*8 + ((l >> 4) << 3) + (l & 7), chunk 2*ks + ((l >> 3) & 1).
    const uint32_t k_row = smem_u32(Kt + (((lane >> 4) << 3) + (lane & 7)) * ROW_BYTES);
    const int k_x = (((lane >> 3) & 1) ^ lane) & 7;
#pragma unroll
    for (int ks = 0; ks < QK / 16; ++ks) {
      side(ks);
      uint32_t a[4];
      q_frag(ks, a);
      float(&acc)[C::NB_QK][4] = (ks & 1) ? s2 : sc;
#pragma unroll
      for (int nb = 0; nb < C::NB_QK; nb += 2) {
        uint32_t bb[4];
        ldmatrix_x4(bb, k_row + nb * 8 * ROW_BYTES + swz_in_row(2 * ks, k_x));
        if constexpr (is_fp8(KV)) {
          mma_f16(acc[nb], a, bb[0], bb[1]);
          mma_f16(acc[nb + 1], a, bb[2], bb[3]);
        } else {
          mma_bf16(acc[nb], a, bb[0], bb[1]);
          mma_bf16(acc[nb + 1], a, bb[2], bb[3]);
        }
      }
    }
  };

  // Sum the two sets; mask draft keys (tree or causal) and keys past the range. An fp8 pool's prefix keys were
  // widened without their scale: it goes into the softmax's scale of their tiles (s_log2, in fp32), and those tiles
  // hold no draft key (past P they are masked).
  float s_log2 = p.scale_log2;  // the tile's: set by mask, read by its softmax
  auto mask = [&](int t, float (&sc)[C::NB_QK][4], const float (&s2)[C::NB_QK][4]) {
    const int kt0 = w.template start<is_fp8(KV)>(t, C::BN);
    const bool edge = kt0 + C::BN > w.P;
    bool prefix8 = false;
    if constexpr (is_fp8(KV)) prefix8 = !w.draft_tile(t);
    s_log2 = prefix8 ? p.scale_log2 * p.k_scale : p.scale_log2;
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = sc[j][e] + s2[j][e];
        if (edge) {
          const int h = e >> 1;
          const int kp = kt0 + j * 8 + 2 * (lane & 3) + (e & 1);
          bool vis = kp < w.P;
          if (!vis && kp < w.k_hi && !prefix8) {
            if (!qrow_ok[h]) vis = true;
            else if (p.mask != nullptr) vis = p.mask[w.mbase + static_cast<int64_t>(qi[h]) * w.L + kp] != 0;
            else vis = kp - w.P <= qi[h];
          }
          if (!vis) v = -INFINITY;
        }
        sc[j][e] = v;
      }
  };

  // Online softmax of one tile's scores, in place (-> unnormalised P), cut into steps so that they can be
  // spread over the next tile's k-steps: each step needs only results of the one before it, whose
  // latency (shuffles, exp2) the mma of the k-step between them covers. The max is taken on raw scores
  // and the scale (> 0, as k_scale: checked at launch) folded into the exponent: exp2(s * scale - m * scale).
  constexpr int SOFTMAX_STEPS = 5 + C::NB_QK;
  float tm[2], tx[2], m_use[2];
  auto softmax_step = [&](int step, float (&sc)[C::NB_QK][4], float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (step == 0) {  // row max of the tile, pairwise
        float mx[C::NB_QK];
#pragma unroll
        for (int j = 0; j < C::NB_QK; ++j) mx[j] = fmaxf(sc[j][2 * h], sc[j][2 * h + 1]);
#pragma unroll
        for (int d = 1; d < C::NB_QK; d *= 2)
#pragma unroll
          for (int j = 0; j + d < C::NB_QK; j += 2 * d) mx[j] = fmaxf(mx[j], mx[j + d]);
        tm[h] = mx[0] * s_log2;
      } else if (step == 1) {  // across the four lanes of a row
        tx[h] = __shfl_xor_sync(0xffffffffu, tm[h], 1);
      } else if (step == 2) {
        tm[h] = fmaxf(tm[h], tx[h]);
        tx[h] = __shfl_xor_sync(0xffffffffu, tm[h], 2);
      } else if (step == 3) {
        // The exponent's reference m_run moves only when a tile's max passes it by more than RESCALE_SLACK
        // (log2 units), as in FlashAttention-4: P stays <= 2^SLACK (bf16 keeps its relative precision at any
        // scale; l and O are fp32) and the output warps' rescale is skipped on almost every tile.
        const float m_tile = fmaxf(tm[h], tx[h]);
        const bool move = m_tile > m_run[h] + RESCALE_SLACK;  // true at the first visible key: m_run is -inf
        alpha[h] = move ? exp2f(m_run[h] - m_tile) : 1.f;
        if (move) m_run[h] = m_tile;
        m_use[h] = m_run[h] == -INFINITY ? 0.f : m_run[h];  // no visible key so far: keep zeros, no NaN
      } else if (step < 4 + C::NB_QK) {
        const int j = step - 4;
        sc[j][2 * h] = exp2f(fmaf(sc[j][2 * h], s_log2, -m_use[h]));
        sc[j][2 * h + 1] = exp2f(fmaf(sc[j][2 * h + 1], s_log2, -m_use[h]));
      } else if (step == 4 + C::NB_QK) {
        float sum[C::NB_QK];
#pragma unroll
        for (int j = 0; j < C::NB_QK; ++j) sum[j] = sc[j][2 * h] + sc[j][2 * h + 1];
#pragma unroll
        for (int d = 1; d < C::NB_QK; d *= 2)
#pragma unroll
          for (int j = 0; j + d < C::NB_QK; j += 2 * d) sum[j] += sum[j + d];
        l_run[h] = l_run[h] * alpha[h] + sum[0];
      }
    }
  };

  // P (bf16; f16 for an fp8 pool, e4m3 in an MMA8 prefix tile) and the rescale factor of tile t into P buffer t & 1
  // for the output warps. An fp8 pool's value scale goes onto O once, after its prefix tiles: in the rescale factor
  // of the first draft tile (or, with none, in the epilogue's normalisation), never into P.
  auto publish = [&](int t, const float (&pr)[C::NB_QK][4], const float (&alpha)[2]) {
    const int buf = t & 1;
    if (t >= 2) bar_sync(C::BAR_P_FREE + buf, C::NT);  // the output warps are done with tile t-2's P
    uint8_t* Pt = sm.p + buf * C::BM * C::P_ROW_BYTES;
    bool fp8_p = false;
    if constexpr (MMA8) fp8_p = !w.draft_tile(t);
    if (fp8_p) {
      // Slot 16m + 4q + i of a row = key 16m + {2q, 2q + 1, 8 + 2q, 9 + 2q}[i]: n-tiles 2m and 2m + 1 of this lane.
#pragma unroll
      for (int m = 0; m < C::NB_QK / 2; ++m) {
        const int at = 16 * m + 4 * (lane & 3);
        *reinterpret_cast<uint32_t*>(Pt + r0 * C::P_ROW_BYTES + at) =
            f32x4_to_fp8x4<true>(pr[2 * m][0], pr[2 * m][1], pr[2 * m + 1][0], pr[2 * m + 1][1]);
        *reinterpret_cast<uint32_t*>(Pt + (r0 + 8) * C::P_ROW_BYTES + at) =
            f32x4_to_fp8x4<true>(pr[2 * m][2], pr[2 * m][3], pr[2 * m + 1][2], pr[2 * m + 1][3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < C::NB_QK; ++j) {
        const int col = j * 8 + 2 * (lane & 3);
        if constexpr (is_fp8(KV)) {  // f16 P for the f16 mma (<= 2^RESCALE_SLACK)
          *reinterpret_cast<__half2*>(Pt + r0 * C::P_ROW_BYTES + col * 2) = __floats2half2_rn(pr[j][0], pr[j][1]);
          *reinterpret_cast<__half2*>(Pt + (r0 + 8) * C::P_ROW_BYTES + col * 2) =
              __floats2half2_rn(pr[j][2], pr[j][3]);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(Pt + r0 * C::P_ROW_BYTES + col * 2) =
              __floats2bfloat162_rn(pr[j][0], pr[j][1]);
          *reinterpret_cast<__nv_bfloat162*>(Pt + (r0 + 8) * C::P_ROW_BYTES + col * 2) =
              __floats2bfloat162_rn(pr[j][2], pr[j][3]);
        }
      }
    }
    if ((lane & 3) == 0) {
      float f = 1.f;
      if constexpr (is_fp8(KV)) f = t == w.np && t > 0 ? p.v_scale : 1.f;
      sm.alpha[buf * C::BM + r0] = alpha[0] * f;
      sm.alpha[buf * C::BM + r0 + 8] = alpha[1] * f;
    }
    bar_arrive(C::BAR_P_READY + buf, C::NT);
    if (t == 0 && r0 == 0 && lane == 0) stamp(kFirstP);
  };

  // PIPELINE: software-pipelined by one tile, tile t's softmax steps placed between the k-steps of tile
  // t+1's mma (which do not depend on them), so the warp is not idle through the softmax's dependency
  // chains. Otherwise tile by tile.
  constexpr int SOFTMAX_SPACING = 2;  // a softmax step every second k-step
  static_assert(SOFTMAX_STEPS * SOFTMAX_SPACING <= QK / 16, "softmax steps fit in the k-steps");
  static_assert(!(C::PIPELINE && MMA8) || (SOFTMAX_STEPS - 1) * SOFTMAX_SPACING < QK / 32,
                "softmax steps fit in an MMA8 prefix tile's 32-dim k-steps");
  float cur[C::NB_QK][4], nxt[C::NB_QK][4], nxt2[C::NB_QK][4], alpha[2];
  auto no_side_work = [](int) {};
  auto whole_softmax = [&] {
#pragma unroll
    for (int step = 0; step < SOFTMAX_STEPS; ++step) softmax_step(step, cur, alpha);
  };
  if constexpr (C::PIPELINE) {
    scores(0, cur, nxt2, no_side_work);
    mask(0, cur, nxt2);
    for (int t = 0; t + 1 < w.ntiles; ++t) {
      scores(t + 1, nxt, nxt2, [&](int ks) {
        if (ks % SOFTMAX_SPACING == 0 && ks / SOFTMAX_SPACING < SOFTMAX_STEPS) softmax_step(ks / SOFTMAX_SPACING, cur, alpha);
      });
      publish(t, cur, alpha);
      mask(t + 1, nxt, nxt2);
#pragma unroll
      for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) cur[j][e] = nxt[j][e];
    }
    whole_softmax();
    publish(w.ntiles - 1, cur, alpha);
  } else {
    for (int t = 0; t < w.ntiles; ++t) {
      scores(t, cur, nxt2, no_side_work);
      mask(t, cur, nxt2);
      whole_softmax();
      publish(t, cur, alpha);
    }
  }
  // Take the last (up to two) P-free arrivals so every named barrier ends balanced.
  for (int t = max(w.ntiles, 2); t < w.ntiles + 2; ++t) bar_sync(C::BAR_P_FREE + (t & 1), C::NT);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if ((lane & 3) == 0) {
    sm.l_fin[r0] = l_run[0];
    sm.l_fin[r0 + 8] = l_run[1];
    sm.m_fin[r0] = m_run[0];
    sm.m_fin[r0 + 8] = m_run[1];
  }
}

// Output warp `ow`: loads its share of every key tile (its own value dims of each key row, so no other
// output warp reads what it overwrites, plus an even share of the rope dims), then O = O * alpha + P V
// for all BM rows x its DV_W dims.
template <class C, Kv KV, bool MMA8>
__device__ __forceinline__ void output_warp(const Params& p, const Work& w, const Smem<C>& sm, int ow, int lane,
                                            float (&o)[C::RB][C::NB_PV][4]) {
  // Lane k reads the pool slot of key row k of a tile (a tile ahead); the copies themselves go out in
  // 16-byte chunks with consecutive lanes on consecutive chunks of a row, so each request is whole lines.
  const int key = lane % C::BN;
  auto slot_of = [&](int t) -> int {  // a pool holds fewer than 2^31 rows (that would be 2.4 TB)
    const int kp = w.template start<is_fp8(KV)>(t, C::BN) + key;
    return kp < w.P && kp < w.k_hi ? static_cast<int>(load_idx(p.kv_indices, p.kvi_t, w.kv0 + kp)) : 0;
  };
  // An fp8 pool's tiles. Lane `idx` of copy i takes the 16-dim block idx % (CW / 2) of the warp's own dims of row
  // idx / (CW / 2), then its share of the rope blocks: the same rows and dims as its bf16 copies, so every 128-byte
  // group of a 16-bit stage has one owning warp. A block is the f16 chunk pair (c, c + 1) in the key loops, which
  // read it de-interleaved (its even dims, then its odd dims), and comes from
  // - a draft tile: k_ext's bf16 chunks c, c + 1, copied as they are, then rewritten in place (convert_tile);
  // - a prefix tile of the widen path: the pool's fp8 chunk c / 2, landed in the slot of chunk c + 1 and widened in
  //   place (convert_tile);
  // - a prefix tile of the mma path: the pool's fp8 chunk c / 2 at chunk slot c / 2 (the first 640 bytes of the
  //   row), read as fp8 by the key loops.
  // The lane that copies a block rewrites it: cp.async's wait covers only the copies of the thread that waits.
  constexpr int CW8 = C::CW / 2;  // fp8 chunks of a key row a warp owns
  constexpr int LAT_PAIRS = C::BN * C::CW / 2 / 32, ROPE_PAIRS = C::ROPE_PER_WARP / 2;
  static_assert(!is_fp8(KV) || (C::CW % 2 == 0 && (C::BN * C::CW / 2) % 32 == 0 && ROPE_PAIRS <= 32),
                "fp8 pool blocks spread evenly over the lanes");
  auto pair_of = [](int lane, int ow, int i, int& r, int& c, bool& mine) {
    if (i < LAT_PAIRS) {
      const int idx = lane + 32 * i;
      r = idx / (C::CW / 2), c = ow * C::CW + 2 * (idx % (C::CW / 2)), mine = true;
    } else {
      const int g = ow * ROPE_PAIRS + lane;
      r = g / (ROPE_CHUNKS / 2), c = DV / 8 + 2 * (g % (ROPE_CHUNKS / 2)), mine = lane < ROPE_PAIRS;
    }
  };
  auto pair_at = [&](int i, int& r, int& c, bool& mine) { pair_of(lane, ow, i, r, c, mine); };
  auto load_fp8_pool = [&](int t, int slot) {
    const int k0 = w.template start<is_fp8(KV)>(t, C::BN);
    uint8_t* stage = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
    if (w.draft_tile(t)) {
#pragma unroll
      for (int i = 0; i < LAT_PAIRS + 1; ++i) {
        int r, c;
        bool mine;
        pair_at(i, r, c, mine);
        const int kp = k0 + r;
        const bool ok = kp < w.k_hi;  // past the range: zero-filled, then masked
        const __nv_bfloat16* src = ok ? p.k_ext + (w.qs + kp - w.P) * p.k_ext_st + c * 8 : p.k_ext;
        if (mine) {
          cp_async16(stage + swz(r, c), src, ok);
          cp_async16(stage + swz(r, c + 1), ok ? src + 8 : src, ok);
        }
      }
      return;
    }
    const uint8_t* pool = reinterpret_cast<const uint8_t*>(p.k_buf);
    const uint32_t st = static_cast<uint32_t>(p.k_buf_st);  // bytes (an fp8 row), < 2^31, checked at launch
    // Every row a pool slot (all but the last prefix tile): the copies without a source size. With one (the
    // zero-filling form) each lane's 16 bytes went as a request of its own: 2x the L2 sectors and 8x the
    // shared-memory wavefronts of the copy (Nsight Compute, H200). The mma path keeps the one form: the second
    // moved its registers past the spill allowance on sm_90 and into spills on sm_120.
    const bool full = !MMA8 && k0 + C::BN <= w.P;
#pragma unroll
    for (int i = 0; i < LAT_PAIRS + 1; ++i) {
      int r, c;
      bool mine;
      pair_at(i, r, c, mine);
      const uint32_t sl = static_cast<uint32_t>(__shfl_sync(0xffffffffu, slot, r));  // every lane shuffles
      uint8_t* dst = stage + swz(r, MMA8 ? c / 2 : c + 1);
      if (full) {
        if (mine) cp_async16(dst, pool + static_cast<uint64_t>(sl) * st + c * 8, true);
        continue;
      }
      const bool ok = k0 + r < w.P;  // the last prefix tile past P: zero-filled (0 in fp8 and f16), then masked
      if (mine) cp_async16(dst, ok ? pool + static_cast<uint64_t>(sl) * st + c * 8 : pool, ok);
    }
  };
  // After a tile has landed (this lane's copies): its blocks as f16, de-interleaved. Block (r, c) is the f16 chunk
  // pair at swz(r, c) and swz(r, c) ^ 16 (c even); a lane's latent blocks are 32 / CW8 rows apart (whole xor
  // periods: the same place in their 128-byte groups), so one offset and a stride address them.
  static_assert(32 / CW8 % 8 == 0, "a lane's latent blocks keep their place in the swizzle");
  auto convert_tile = [&](int t) {
    if constexpr (is_fp8(KV)) {
      const bool draft = w.draft_tile(t);
      if (MMA8 && !draft) return;  // read as fp8
      uint8_t* stage = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
      auto block = [&](int at) {
        uint4* lo = reinterpret_cast<uint4*>(stage + at);
        uint4* hi = reinterpret_cast<uint4*>(stage + (at ^ 16));
        uint4 even, odd;
        if (!MMA8 && !draft) {  // the pool's fp8 block, landed in the second chunk
          const uint4 v = *hi;
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.x, even.x, odd.x);
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.y, even.y, odd.y);
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.z, even.z, odd.z);
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.w, even.w, odd.w);
        } else {  // k_ext's bf16 chunks
          bf16x16_to_f16_deinterleaved(*lo, *hi, even, odd);
        }
        *lo = even;
        *hi = odd;
      };
      // The offsets from the lane and warp, once a tile: held through the key loop, they cost spills.
      int ln = lane, o = ow, r, c;
      asm volatile("" : "+r"(ln), "+r"(o));
      bool mine;
      pair_of(ln, o, 0, r, c, mine);
      const int lat = swz(r, c);
#pragma unroll 1
      for (int i = 0; i < LAT_PAIRS; ++i) block(lat + i * (32 / CW8) * ROW_BYTES);
      pair_of(ln, o, LAT_PAIRS, r, c, mine);
      if (mine) block(swz(r, c));
    }
  };
  auto load_tile = [&](int t, int slot) {
    if constexpr (is_fp8(KV)) {
      load_fp8_pool(t, slot);
      return;
    }
    const int k0 = w.k_lo + t * C::BN;
    uint8_t* stage = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
    // Lane `idx` of copy i takes chunk idx % CW of key row idx / CW (its own dims), then the rope chunks.
    // The mapping is spelled out in both paths below: one shared helper moved the output warps' register
    // allocation (6 more loop instructions and 2 more spill loads per tile, bench/sass_loops.py).
    if (k0 + C::BN <= min(w.P, w.k_hi)) {
      // Every key of the tile is a pool slot (all but a split's last tile): straight-line code, one
      // shuffle, one address multiply and one copy per chunk.
      const uint32_t st = static_cast<uint32_t>(p.k_buf_st);  // < 2^31, checked at launch
#pragma unroll
      for (int i = 0; i < C::LAT_PER_LANE + C::ROPE_PER_LANE; ++i) {
        int r, col;
        bool mine = true;
        if (i < C::LAT_PER_LANE) {
          const int idx = lane + 32 * i;
          r = idx / C::CW, col = ow * C::CW + idx % C::CW;
        } else {
          const int k = lane + 32 * (i - C::LAT_PER_LANE), g = ow * C::ROPE_PER_WARP + k % C::ROPE_PER_WARP;
          r = g / ROPE_CHUNKS, col = DV / 8 + g % ROPE_CHUNKS;
          mine = C::ROPE_PER_WARP % 32 == 0 || k < C::ROPE_PER_WARP;
        }
        // Every lane takes part in the shuffle; only the copy is predicated.
        const uint32_t sl = static_cast<uint32_t>(__shfl_sync(0xffffffffu, slot, r));
        if (mine) cp_async16(stage + swz(r, col), p.k_buf + static_cast<uint64_t>(sl) * st + col * 8, true);
      }
      return;
    }
    auto copy = [&](int r, int col, bool mine) {  // chunk `col` of key row r
      const int64_t sl = __shfl_sync(0xffffffffu, slot, r);
      const int kp = k0 + r;
      const bool ok = kp < w.k_hi;  // past the range: zero-filled, then masked
      const __nv_bfloat16* src = p.k_buf;
      if (ok) src = kp < w.P ? p.k_buf + sl * p.k_buf_st : p.k_ext + (w.qs + kp - w.P) * p.k_ext_st;
      if (mine) cp_async16(stage + swz(r, col), ok ? src + col * 8 : src, ok);
    };
#pragma unroll
    for (int i = 0; i < C::LAT_PER_LANE; ++i) {
      const int idx = lane + 32 * i;
      copy(idx / C::CW, ow * C::CW + idx % C::CW, true);
    }
#pragma unroll
    for (int i = 0; i < C::ROPE_PER_LANE; ++i) {
      const int k = lane + 32 * i, g = ow * C::ROPE_PER_WARP + k % C::ROPE_PER_WARP;
      copy(g / ROPE_CHUNKS, DV / 8 + g % ROPE_CHUNKS, C::ROPE_PER_WARP % 32 == 0 || k < C::ROPE_PER_WARP);
    }
  };

  // Tile 0 alone first: at launch every CTA also loads its Q rows, and with the next tiles in the same
  // queue tile 0 and Q landed ~2 us later. The next tiles are requested once tile 0 is in, a tile's mma
  // ahead of their use.
  load_tile(0, slot_of(0));  // ntiles >= 1
  cp_async_commit();
  cp_async_wait<0>();
  convert_tile(0);
  if (ow == 0 && lane == 0) stamp(kTile0Landed);
  bar_arrive(C::BAR_K, C::NT);  // tile 0 (this warp's part of it) landed
#pragma unroll
  for (int s = 1; s < C::STAGES; ++s) {
    if (s < w.ntiles) load_tile(s, slot_of(s));
    cp_async_commit();
  }
  int next_slot = slot_of(C::STAGES);

  const int d0 = ow * C::DV_W;
  for (int t = 0; t < w.ntiles; ++t) {
    if (t + 1 < w.ntiles) {
      cp_async_wait<C::STAGES - 2>();
      convert_tile(t + 1);
      bar_arrive(C::BAR_K + (t + 1) % C::STAGES, C::NT);
    }
    const int buf = t & 1;
    bar_sync(C::BAR_P_READY + buf, C::NT);  // P of tile t written; the score warps are done with its keys
    uint8_t* Kt = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
    const int kt0 = w.template start<is_fp8(KV)>(t, C::BN);

    // Draft values from a separate tensor replace this warp's dims of the staged draft rows (an fp8 pool's: as
    // f16, de-interleaved, as convert_draft wrote the keys; only in its draft tiles: a prefix tile past P holds
    // zero-filled fp8 rows, which f16 bytes would turn into NaN).
    if (p.v_ext != nullptr && (is_fp8(KV) ? w.draft_tile(t) : kt0 + C::BN > w.P)) {
      const int d_lo = max(kt0, w.P), d_hi = min(kt0 + C::BN, w.k_hi);
      if constexpr (is_fp8(KV)) {
        for (int c = lane; c < (d_hi - d_lo) * (C::CW / 2); c += 32) {
          const int kp = d_lo + c / (C::CW / 2), col = ow * C::CW + 2 * (c % (C::CW / 2));
          const uint4* src = reinterpret_cast<const uint4*>(p.v_ext + (w.qs + kp - w.P) * p.v_ext_st + col * 8);
          uint4 even, odd;
          bf16x16_to_f16_deinterleaved(src[0], src[1], even, odd);
          *reinterpret_cast<uint4*>(Kt + swz(kp - kt0, col)) = even;
          *reinterpret_cast<uint4*>(Kt + swz(kp - kt0, col + 1)) = odd;
        }
      } else {
        for (int c = lane; c < (d_hi - d_lo) * C::CW; c += 32) {
          const int kp = d_lo + c / C::CW, col = ow * C::CW + c % C::CW;
          const uint4 v = *reinterpret_cast<const uint4*>(p.v_ext + (w.qs + kp - w.P) * p.v_ext_st + col * 8);
          *reinterpret_cast<uint4*>(Kt + swz(kp - kt0, col)) = v;
        }
      }
      __syncwarp();
    }

    const float* alpha = sm.alpha + buf * C::BM;
#pragma unroll
    for (int rb = 0; rb < C::RB; ++rb) {
      const float a0 = alpha[rb * 16 + (lane >> 2)], a1 = alpha[rb * 16 + (lane >> 2) + 8];
      if (a0 != 1.f || a1 != 1.f) {  // the running max rarely moves once a few tiles are in
#pragma unroll
        for (int j = 0; j < C::NB_PV; ++j) {
          o[rb][j][0] *= a0; o[rb][j][1] *= a0; o[rb][j][2] *= a1; o[rb][j][3] *= a1;
        }
      }
    }
    const uint8_t* Pt = sm.p + buf * C::BM * C::P_ROW_BYTES;
    bool fp8_mma = false;
    if constexpr (MMA8) fp8_mma = !w.draft_tile(t);
    if (fp8_mma) {
      // One m16n8k32 over the tile's keys (16-key tiles: slots 16..31 zero). A: the e4m3 P rows as the score warps
      // stored them (in slot order). B: per fp8 chunk i (16 dims) of this warp's own, ldmatrix.trans of 8 keys
      // each (lane l = key l), whose bytes 0, 2 of two key groups are the even dims' slots and bytes 1, 3 the
      // odd dims': n-tiles 2i and 2i + 1, as the widen path lays them out.
      constexpr bool FULL = C::BN == 32;
      static_assert(C::BN == 32 || C::BN == 16, "an m16n8k32 over one or half a tile");
      uint32_t a[C::RB][4];
#pragma unroll
      for (int rb = 0; rb < C::RB; ++rb) {
        const uint32_t at = smem_u32(Pt + (rb * 16 + (lane & 15)) * C::P_ROW_BYTES + (lane >> 4) * 16);
        if constexpr (FULL) {
          ldmatrix_x4(a[rb], at);
        } else {
          uint32_t h[2];
          ldmatrix_x2(h, at);
          a[rb][0] = h[0], a[rb][1] = h[1], a[rb][2] = a[rb][3] = 0u;
        }
      }
      const int key = FULL ? lane : lane & 15;
      const uint32_t v8_row = smem_u32(Kt + key * ROW_BYTES);
#pragma unroll
      for (int i = 0; i < CW8; ++i) {
        uint32_t r[4] = {0u, 0u, 0u, 0u};
        if constexpr (FULL) {
          ldmatrix_x4_trans(r, v8_row + swz_in_row(d0 / 16 + i, key));
        } else {
          uint32_t h[2];
          ldmatrix_x2_trans(h, v8_row + swz_in_row(d0 / 16 + i, key));
          r[0] = h[0], r[1] = h[1];
        }
        const uint32_t e0 = prmt(r[0], r[1], 0x6420), e1 = prmt(r[2], r[3], 0x6420);
        const uint32_t o0 = prmt(r[0], r[1], 0x7531), o1 = prmt(r[2], r[3], 0x7531);
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb) {
          mma_fp8<true, KV == kKvE4m3>(o[rb][2 * i], a[rb], e0, e1);
          mma_fp8<true, KV == kKvE4m3>(o[rb][2 * i + 1], a[rb], o0, o1);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < C::BN / 16; ++kk) {
        uint32_t a[C::RB][4];
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb)
          ldmatrix_x4(a[rb], smem_u32(Pt + (rb * 16 + (lane & 15)) * C::P_ROW_BYTES + kk * 32 + (lane >> 4) * 16));
        // Lane l reads key row kk*16 + ((l >> 3) & 1)*8 + (l & 7), chunk d0/8 + nb + (l >> 4) (d0/8 is a
        // multiple of 8, nb even).
        const uint32_t v_row = smem_u32(Kt + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_BYTES);
        const int v_x = ((lane >> 4) ^ lane) & 7;
#pragma unroll
        for (int nb = 0; nb < C::NB_PV; nb += 2) {
          const uint32_t v_addr = v_row + swz_in_row(d0 / 8 + nb, v_x);
          uint32_t bb[4];
          ldmatrix_x4_trans(bb, v_addr);
#pragma unroll
          for (int rb = 0; rb < C::RB; ++rb) {
            if constexpr (is_fp8(KV)) {
              mma_f16(o[rb][nb], a[rb], bb[0], bb[1]);
              mma_f16(o[rb][nb + 1], a[rb], bb[2], bb[3]);
            } else {
              mma_bf16(o[rb][nb], a[rb], bb[0], bb[1]);
              mma_bf16(o[rb][nb + 1], a[rb], bb[2], bb[3]);
            }
          }
        }
      }
    }
    __syncwarp();  // every lane is done reading this stage before this warp refills it
    bar_arrive(C::BAR_P_FREE + buf, C::NT);
    if constexpr (MMA8) {
      // A stage going from an fp8 prefix tile (this warp's dims: 64 bytes of a row) to a draft tile (f16: 128 bytes)
      // is refilled over other output warps' fp8 dims: all of them must be done with this tile's PV first. At most
      // STAGES times a CTA, the same on every output warp.
      if (!w.draft_tile(t) && t + C::STAGES < w.ntiles && w.draft_tile(t + C::STAGES))
        bar_sync(C::BAR_EPILOGUE, C::NO * 32);
    }
    if (t + C::STAGES < w.ntiles) load_tile(t + C::STAGES, next_slot);
    cp_async_commit();
    next_slot = slot_of(t + C::STAGES + 1);
  }
  cp_async_wait<0>();
}

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

// MMA8: an fp8 pool's prefix tiles through fp8 x fp8 mma (KDTREE_FP8_MMA), else widened to f16 (KDTREE_FP8_WIDEN).
template <class C, Kv KV, bool MMA8>
__global__ void __launch_bounds__(C::NT, 1) tree_verify_kernel(const Params p) {
#ifdef __CUDA_ARCH__
  if constexpr (C::SMEM > SMEM_PER_BLOCK) return;  // a config this architecture cannot launch: no code
#endif
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const Smem<C> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = blockIdx.x, mt = blockIdx.y, b = blockIdx.z;
  if (tid == 0) stamp(kEntry);

  if (p.counter != nullptr && split == 0 && mt == 0 && b == 0 && tid == 0) {
    unsigned long long v = atomicAdd(p.counter, 1ull) + 1ull;
    if (p.counter_mirror != nullptr) *reinterpret_cast<volatile unsigned long long*>(p.counter_mirror) = v;
  }

  asm volatile("griddepcontrol.launch_dependents;\n");  // the combine may be scheduled as CTAs retire
  // The request's indices, all requested before any is used: one round trip, not three in series.
  Work w;
  w.qs = load_idx(p.qo_indptr, p.qo_t, b);
  const int64_t qs_end = load_idx(p.qo_indptr, p.qo_t, b + 1);
  w.kv0 = load_idx(p.kv_indptr, p.kvp_t, b);
  const int64_t kv_end = load_idx(p.kv_indptr, p.kvp_t, b + 1);
  w.mbase = p.mask != nullptr ? load_idx(p.mask_indptr, p.mi_t, b) : 0;
  w.qlen = static_cast<int>(qs_end - w.qs);
  w.rows = w.qlen * p.H;
  w.m0 = mt * C::BM;
  if (w.m0 >= w.rows) return;
  w.P = static_cast<int>(kv_end - w.kv0);
  w.L = w.P + w.qlen;
  int used;
  split_range(w.L, p.splits, split, C::BN, w.k_lo, w.k_hi, used);
  if (split >= used) return;
  if constexpr (is_fp8(KV)) {  // prefix tiles, then draft tiles from P on (see Work)
    const int p_hi = min(w.P, w.k_hi);
    w.np = p_hi > w.k_lo ? (p_hi - w.k_lo + C::BN - 1) / C::BN : 0;
    w.d_lo = max(w.k_lo, w.P);
    w.ntiles = w.np + (w.k_hi > w.d_lo ? (w.k_hi - w.d_lo + C::BN - 1) / C::BN : 0);
  } else {
    w.ntiles = (w.k_hi - w.k_lo + C::BN - 1) / C::BN;
  }
  if (tid == 0) {  // read after the key loop, behind its __syncthreads
    stamp(kIndices);
    // Two splits (p.pair) and both have keys (the same on both CTAs of the cluster: same request, same
    // `used`): they merge their partial rows through distributed shared memory and store the output, each
    // half of the rows. A request whose keys fit one split stores directly, as with no split at all.
    sm.epi->mode = p.pair && used == 2 ? Epilogue::kPair
                   : p.splits == 1 || p.pair ? Epilogue::kStore : Epilogue::kPartial;
    sm.epi->r_lo = split * (C::BM / 2);
    sm.epi->row0 = ((static_cast<int64_t>(b) * p.m_tiles + mt) * p.splits + split) * C::BM;
  }

  if (warp < C::NS) {
    score_warp<C, KV, MMA8>(p, w, sm, warp, lane);
    if (tid == 0) stamp(kScoreLoopDone);
    __syncthreads();  // row sums and maxima are in shared memory
    if (sm.epi->mode == Epilogue::kPair) {  // the cluster barriers count every thread of both CTAs
      cluster_sync();
      cluster_sync();
    }
    return;
  }
  const int ow = warp - C::NS;
  float o[C::RB][C::NB_PV][4];
#pragma unroll
  for (int i = 0; i < C::RB; ++i)
#pragma unroll
    for (int j = 0; j < C::NB_PV; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
  output_warp<C, KV, MMA8>(p, w, sm, ow, lane, o);
  if (ow == 0 && lane == 0) stamp(kOutputLoopDone);
  __syncthreads();
  const Epilogue epi = *sm.epi;

  // Normalise and store (no split), or write the split's partial O and log-sum-exp for the combine. The
  // partial rows (fp32) go through shared memory, free now that every key tile is consumed, so that each
  // global store is 512 contiguous bytes of one row instead of 32-byte pieces of eight rows; in
  // STAGE_ROUNDS rounds of rows when all of them do not fit at once.
  const int d0 = ow * C::DV_W;
  float* staged = reinterpret_cast<float*>(smem_raw);
  float o_scale = 1.f;  // an fp8 pool's value scale when no draft tile's rescale carried it (see publish)
  if constexpr (is_fp8(KV)) o_scale = w.np == w.ntiles ? p.v_scale : 1.f;
  constexpr int ROUND_RB = C::RB / C::STAGE_ROUNDS, ROUND_ROWS = ROUND_RB * 16;
#pragma unroll
  for (int round = 0; round < C::STAGE_ROUNDS; ++round) {
#pragma unroll
    for (int rb = round * ROUND_RB; rb < (round + 1) * ROUND_RB; ++rb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = rb * 16 + (lane >> 2) + 8 * h;
        const int gr = w.m0 + r;
        const float l = sm.l_fin[r];
        float inv = l > 0.f ? 1.f / l : 0.f;  // no visible key: zeros, as the Triton kernel writes
        if constexpr (is_fp8(KV)) inv *= o_scale;
        // An fp8 pool's n-tile pair (2i, 2i + 1) holds 16-dim block i interleaved (the f16 fragments' order, see
        // bf16x16_to_f16_deinterleaved): this lane's four values of the pair are dims 16i + 4q .. 16i + 4q + 3.
        if (epi.mode == Epilogue::kStore) {
          if (gr < w.rows) {
            __nv_bfloat16* row = p.out + (w.qs + gr / p.H) * p.o_st + (gr % p.H) * p.o_sh + d0;
            if constexpr (is_fp8(KV)) {
#pragma unroll
              for (int i = 0; i < C::NB_PV / 2; ++i) {
                const __nv_bfloat162 lo = __floats2bfloat162_rn(o[rb][2 * i][2 * h] * inv, o[rb][2 * i + 1][2 * h] * inv);
                const __nv_bfloat162 hi =
                    __floats2bfloat162_rn(o[rb][2 * i][2 * h + 1] * inv, o[rb][2 * i + 1][2 * h + 1] * inv);
                *reinterpret_cast<uint2*>(row + 16 * i + 4 * (lane & 3)) =
                    make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
              }
            } else {
#pragma unroll
              for (int j = 0; j < C::NB_PV; ++j)
                *reinterpret_cast<__nv_bfloat162*>(row + j * 8 + 2 * (lane & 3)) =
                    __floats2bfloat162_rn(o[rb][j][2 * h] * inv, o[rb][j][2 * h + 1] * inv);
            }
          }
        } else {
          float* row = staged + (r - round * ROUND_ROWS) * C::STAGED_ROW + d0;
          if constexpr (is_fp8(KV)) {
#pragma unroll
            for (int i = 0; i < C::NB_PV / 2; ++i)
              *reinterpret_cast<float4*>(row + 16 * i + 4 * (lane & 3)) =
                  make_float4(o[rb][2 * i][2 * h] * inv, o[rb][2 * i + 1][2 * h] * inv, o[rb][2 * i][2 * h + 1] * inv,
                              o[rb][2 * i + 1][2 * h + 1] * inv);
          } else {
#pragma unroll
            for (int j = 0; j < C::NB_PV; ++j)
              *reinterpret_cast<float2*>(row + j * 8 + 2 * (lane & 3)) =
                  make_float2(o[rb][j][2 * h] * inv, o[rb][j][2 * h + 1] * inv);
          }
        }
      }
    if (ow == 0 && lane == 0) stamp(kStaged);
    if (epi.mode == Epilogue::kStore) continue;
    if constexpr (C::PAIR) {
      if (epi.mode == Epilogue::kPair) {
        cluster_sync();  // both CTAs' partial rows staged (and both CTAs running)
        if (ow == 0 && lane == 0) stamp(kPeerReady);
        merge_pair<C>(p.out, p.o_st, p.o_sh, p.H, w.qs, w.m0, w.rows, epi.r_lo, ow, lane, staged, sm.l_fin, sm.m_fin);
        if (ow == 0 && lane == 0) stamp(kMerged);
        cluster_sync();  // the other CTA is done reading this one's shared memory
        if (ow == 0 && lane == 0) stamp(kEpilogueDone);
        return;
      }
    }
    bar_sync(C::BAR_EPILOGUE, C::NO * 32);
    const int64_t row0 = epi.row0;
    for (int r = round * ROUND_ROWS + ow; r < (round + 1) * ROUND_ROWS; r += C::NO) {
      const float4* src = reinterpret_cast<const float4*>(staged + (r - round * ROUND_ROWS) * C::STAGED_ROW);
      float4* dst = reinterpret_cast<float4*>(p.part_o + (row0 + r) * DV);
#pragma unroll
      for (int c = lane; c < DV / 4; c += 32) dst[c] = src[c];
      if (lane == 0) {
        const float l = sm.l_fin[r];
        p.part_lse[row0 + r] = l > 0.f ? sm.m_fin[r] + log2f(l) : -INFINITY;
      }
    }
    if (round + 1 < C::STAGE_ROUNDS) bar_sync(C::BAR_EPILOGUE, C::NO * 32);  // read before the next round's rows
  }
  if (ow == 0 && lane == 0) stamp(kEpilogueDone);
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
  if (gr >= qlen * p.H) return;
  const int P = static_cast<int>(load_idx(p.kv_indptr, p.kvp_t, b + 1) - load_idx(p.kv_indptr, p.kvp_t, b));
  int lo, hi, used;
  split_range(P + qlen, p.splits, 0, C::BN, lo, hi, used);
  const int mt = gr / C::BM, r = gr % C::BM;
  const int64_t base = (static_cast<int64_t>(b) * p.m_tiles + mt) * p.splits * C::BM + r;
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

// ---------------------------------------------------------------------------------------------------
// Host side.

struct Plan {
  int m_tiles, splits;
  bool pair;  // two splits in clusters of two CTAs that merge on chip (no combine launch)
  size_t ws_bytes;
};

// pair_slots: clusters of two CTAs the device runs at once (0: no pairs). The workspace does not depend on
// it, so that its size is a function of the sizes alone: a two-split plan that cannot pair uses it.
template <class C>
static Plan plan(int batch, int H, int max_q_len, int cta_slots, int pair_slots) {
  Plan pl;
  pl.m_tiles = (max_q_len * H + C::BM - 1) / C::BM;
  const long base = static_cast<long>(batch) * pl.m_tiles;
  // Split each request's keys so the grid fills the device's resident CTA slots in one wave
  // (rounding up would leave a second, nearly empty wave).
  pl.splits = static_cast<int>(std::max<long>(1, std::min<long>(MAX_SPLITS, cta_slots / base)));
  pl.pair = C::PAIR && pl.splits == 2 && base <= pair_slots;
  pl.ws_bytes = pl.splits == 1 ? 0 : static_cast<size_t>(base) * pl.splits * C::BM * (DV + 1) * sizeof(float);
  return pl;
}

// The launch attribute of a pair plan: clusters of two CTAs (the two splits of a row tile, along x).
static cudaLaunchAttribute pair_cluster() {
  cudaLaunchAttribute a;
  a.id = cudaLaunchAttributeClusterDimension;
  a.val.clusterDim.x = 2;
  a.val.clusterDim.y = a.val.clusterDim.z = 1;
  return a;
}

// Once per thread and device (outside the steady state): raise the kernel's dynamic shared memory limit,
// and count the clusters of two CTAs the device holds at once. A cluster's CTAs share a GPC, so that can be
// fewer than half the CTA slots (a GPC with an odd number of SMs, a MIG slice); pairs are only planned
// when all of them fit in one wave.
template <class C, Kv KV, bool MMA8>
static int prepare(int* pair_slots) {
  static thread_local int prepared_device = -1, pairs = 0;
  int dev = 0;
  cudaGetDevice(&dev);
  if (prepared_device != dev) {
    cudaError_t e =
        cudaFuncSetAttribute(tree_verify_kernel<C, KV, MMA8>, cudaFuncAttributeMaxDynamicSharedMemorySize, C::SMEM);
    if (e != cudaSuccess) return fail_cuda(e, "cudaFuncSetAttribute (the kernel's shared memory)");
    pairs = 0;  // a config that stages its rows in rounds does not pair (Cfg::PAIR)
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2);
    cfg.blockDim = dim3(C::NT);
    cfg.dynamicSmemBytes = C::SMEM;
    cudaLaunchAttribute cluster = pair_cluster();
    cfg.attrs = &cluster;
    cfg.numAttrs = 1;
    if (C::PAIR && cudaOccupancyMaxActiveClusters(&pairs, tree_verify_kernel<C, KV, MMA8>, &cfg) != cudaSuccess) {
      pairs = 0;  // no clusters here: two splits go through the combine, as more do
      cudaGetLastError();
    }
    prepared_device = dev;
  }
  if (pair_slots != nullptr) *pair_slots = pairs;
  return KDTREE_OK;
}

// CTAs of this config one multiprocessor of the current device holds at once (shared memory, registers
// and threads all counted): the split sizing fills exactly one wave of them.
template <class C>
static int resident_ctas(int* ctas) {
  if (int rc = prepare<C, kKvBf16, false>(nullptr); rc != KDTREE_OK) return rc;
  // The fp8 kernels have the same threads and shared memory, and the launch bounds cap every one's registers.
  cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, tree_verify_kernel<C, kKvBf16, false>, C::NT,
                                                               C::SMEM);
  if (e != cudaSuccess) return fail_cuda(e, "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  if (*ctas < 1) return fail(KDTREE_ERR_CUDA, "the kernel does not fit on this device");
  return KDTREE_OK;
}

template <class C, Kv KV, bool MMA8>
static int launch(const kdtree_verify_args* a, cudaStream_t stream) {
  int pair_slots = 0;
  if (int rc = prepare<C, KV, MMA8>(&pair_slots); rc != KDTREE_OK) return rc;
  const Plan pl = plan<C>(a->batch, a->num_heads, a->max_q_len, a->cta_slots, pair_slots);
  if (a->workspace_bytes < pl.ws_bytes || (pl.ws_bytes > 0 && a->workspace == nullptr))
    return fail(KDTREE_ERR_WORKSPACE, "workspace is smaller than kdtree_verify_workspace_bytes()");
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
  p.k_scale = a->k_scale; p.v_scale = a->v_scale;
  p.H = a->num_heads; p.splits = pl.splits; p.m_tiles = pl.m_tiles; p.pair = pl.pair;

  cudaLaunchConfig_t main_cfg = {};
  main_cfg.gridDim = dim3(pl.splits, pl.m_tiles, a->batch);
  main_cfg.blockDim = dim3(C::NT);
  main_cfg.dynamicSmemBytes = C::SMEM;
  main_cfg.stream = stream;
  cudaLaunchAttribute cluster = pair_cluster();
  main_cfg.attrs = &cluster;
  main_cfg.numAttrs = pl.pair ? 1 : 0;
  cudaError_t e = cudaLaunchKernelEx(&main_cfg, tree_verify_kernel<C, KV, MMA8>, p);
  if (e != cudaSuccess) return fail_cuda(e, "launching the verify kernel");
  if (pl.splits > 1 && !pl.pair) {  // a pair merged on chip
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(pl.m_tiles * C::BM, a->batch);
    const int groups = pl.splits >= COMBINE_SPLITS_8 ? 8 : pl.splits >= COMBINE_SPLITS_4 ? 4 : 1;
    cfg.blockDim = dim3(128 * groups);
    cfg.stream = stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    e = groups == 8   ? cudaLaunchKernelEx(&cfg, combine_kernel<C, 8>, p)
        : groups == 4 ? cudaLaunchKernelEx(&cfg, combine_kernel<C, 4>, p)
                      : cudaLaunchKernelEx(&cfg, combine_kernel<C, 1>, p);
    if (e != cudaSuccess) return fail_cuda(e, "launching the combine kernel");
  }
  return KDTREE_OK;
}

template <class C>
static int launch_kv(const kdtree_verify_args* a, cudaStream_t stream) {
  const bool mma = a->fp8_path == KDTREE_FP8_MMA;
  if (a->kv_dtype == KDTREE_KV_FP8_E4M3)
    return mma ? launch<C, kKvE4m3, true>(a, stream) : launch<C, kKvE4m3, false>(a, stream);
  if (a->kv_dtype == KDTREE_KV_FP8_E5M2)
    return mma ? launch<C, kKvE5m2, true>(a, stream) : launch<C, kKvE5m2, false>(a, stream);
  return launch<C, kKvBf16, false>(a, stream);
}

// The one place a kdtree_config becomes a tile configuration: f(Wide{}) or f(Compact{}) (f takes the type by value:
// `[&](auto c) { using C = decltype(c); ... }`), KDTREE_ERR_ARGUMENT for any other value.
template <class F>
int with_config(int config, F&& f) {
  if (config == KDTREE_CONFIG_WIDE) return f(Wide{});
  if (config == KDTREE_CONFIG_COMPACT) return f(Compact{});
  return fail(KDTREE_ERR_ARGUMENT, "config must be KDTREE_CONFIG_WIDE or KDTREE_CONFIG_COMPACT");
}

}  // namespace kdtree

using namespace kdtree;

extern "C" {

__attribute__((visibility("default"))) int kdtree_abi_version(void) { return KDTREE_ABI_VERSION; }

__attribute__((visibility("default"))) const char* kdtree_compiled_archs(void) { return KDTREE_ARCHS; }

__attribute__((visibility("default"))) int kdtree_verify_smem_bytes(int config) {
  int smem = 0;  // stays 0 for an unknown config
  with_config(config, [&](auto c) {
    smem = decltype(c)::SMEM;
    return KDTREE_OK;
  });
  return smem;
}

__attribute__((visibility("default"))) int kdtree_verify_ctas_per_sm(int config, int* ctas) {
  if (ctas == nullptr) return fail(KDTREE_ERR_ARGUMENT, "ctas is NULL");
  return with_config(config, [&](auto c) { return resident_ctas<decltype(c)>(ctas); });
}

__attribute__((visibility("default"))) int kdtree_verify_workspace_bytes(int batch, int num_heads, int max_q_len,
                                                                         int cta_slots, int config, size_t* bytes) {
  if (batch < 1 || num_heads < 1 || max_q_len < 1 || cta_slots < 1 || bytes == nullptr)
    return fail(KDTREE_ERR_ARGUMENT, "batch, num_heads, max_q_len and cta_slots must be >= 1");
  return with_config(config, [&](auto c) {
    *bytes = plan<decltype(c)>(batch, num_heads, max_q_len, cta_slots, 0).ws_bytes;
    return KDTREE_OK;
  });
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
  if (!(a->sm_scale > 0.f) || !std::isfinite(a->sm_scale)) return fail(KDTREE_ERR_ARGUMENT, "sm_scale must be positive and finite");
  if (a->k_buf_stride <= 0 || a->k_buf_stride >= (1L << 31)) return fail(KDTREE_ERR_ARGUMENT, "k_buf_stride must be in 1..2^31-1");
  if (a->kv_dtype != KDTREE_KV_BF16 && a->kv_dtype != KDTREE_KV_FP8_E4M3 && a->kv_dtype != KDTREE_KV_FP8_E5M2)
    return fail(KDTREE_ERR_ARGUMENT, "kv_dtype must be KDTREE_KV_BF16, KDTREE_KV_FP8_E4M3 or KDTREE_KV_FP8_E5M2");
  if (!(a->k_scale > 0.f) || !std::isfinite(a->k_scale) || !(a->v_scale > 0.f) || !std::isfinite(a->v_scale))
    return fail(KDTREE_ERR_ARGUMENT, "k_scale and v_scale must be positive and finite");
  if (a->kv_dtype == KDTREE_KV_BF16 && (a->k_scale != 1.f || a->v_scale != 1.f))
    return fail(KDTREE_ERR_ARGUMENT, "a bf16 pool is read unscaled: k_scale and v_scale must be 1");
  if (a->fp8_path != KDTREE_FP8_WIDEN && a->fp8_path != KDTREE_FP8_MMA)
    return fail(KDTREE_ERR_ARGUMENT, "fp8_path must be KDTREE_FP8_WIDEN or KDTREE_FP8_MMA");
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return with_config(a->config, [&](auto c) { return launch_kv<decltype(c)>(a, s); });
}

#ifdef KDTREE_TIMELINE
// Clear the stamps (the combine's first/last to their identities) before the launch to be read.
__attribute__((visibility("default"))) int kdtree_timeline_reset(void) {
  static const unsigned long long zero[TIMELINE_CTAS * TIMELINE_STAMPS] = {};
  const unsigned long long identity[6] = {~0ull, 0, ~0ull, 0, ~0ull, 0};
  if (cudaMemcpyToSymbol(g_timeline, zero, sizeof(zero)) != cudaSuccess) return fail(KDTREE_ERR_CUDA, "timeline reset");
  if (cudaMemcpyToSymbol(g_timeline_combine, identity, sizeof(identity)) != cudaSuccess)
    return fail(KDTREE_ERR_CUDA, "timeline reset");
  return KDTREE_OK;
}
// Copy out [TIMELINE_CTAS][TIMELINE_STAMPS] main-kernel stamps (0: not reached) and [3][first, last] of
// the combine's (first ~0: no combine ran). Nanoseconds of %globaltimer.
__attribute__((visibility("default"))) int kdtree_timeline(unsigned long long* main_stamps,
                                                           unsigned long long* combine_stamps) {
  if (cudaMemcpyFromSymbol(main_stamps, g_timeline, sizeof(g_timeline)) != cudaSuccess ||
      cudaMemcpyFromSymbol(combine_stamps, g_timeline_combine, sizeof(g_timeline_combine)) != cudaSuccess)
    return fail(KDTREE_ERR_CUDA, "timeline read");
  return KDTREE_OK;
}
#endif

}  // extern "C"
