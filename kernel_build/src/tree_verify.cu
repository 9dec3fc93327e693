// MLA tree-verify attention: one pass over each request's prefix and draft keys, all of a request's
// (draft token x head) rows packed into the MMA M dimension so every key row is read once per row
// tile; the prefix is split across CTAs and merged by log-sum-exp (two splits on chip, in a cluster of
// two CTAs; more in a second kernel). Tensor cores through mma.sync m16n8k16 (bf16 in, fp32 accumulate),
// the instruction sm_90, sm_100 and sm_120 all have. An fp8 pool's prefix tiles take one of two paths (enum
// kdtree_fp8_path): widened exactly to f16 in shared memory once it lands, into the same instruction in f16
// (widen), or mma.sync m16n8k32 fp8 x fp8 with q and P quantised as SGLang's
// Triton kernel does (mma); its scales are applied in fp32.
// This file holds the main kernel (its key loop's two warp roles and its epilogue) and the host side; its parts:
// tile_config.cuh (Cfg, Wide, Compact), timeline.cuh (tuning stamps), fp8.cuh (the pool's type and fp8 conversion),
// cta.cuh (parameters, a CTA's work and shared memory), score_warp.cuh and output_warp.cuh (the two warp roles),
// epilogue.cuh (the merge of a request's splits: a cluster's pair, the combine kernel).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "cta.cuh"
#include "epilogue.cuh"
#include "fp8.cuh"
#include "kdtree_verify.h"
#include "output_warp.cuh"
#include "ptx.cuh"
#include "score_warp.cuh"
#include "status.cuh"
#include "tile_config.cuh"
#include "timeline.cuh"

namespace kdtree {

// MMA8: an fp8 pool's prefix tiles through fp8 x fp8 mma (KDTREE_FP8_MMA), else widened to f16 (KDTREE_FP8_WIDEN).
template <class C, Kv KV, bool MMA8>
__global__ void __launch_bounds__(C::NT, 1) tree_verify_kernel(const Params p) {
#ifdef __CUDA_ARCH__
  if constexpr (C::SMEM > SMEM_PER_BLOCK) return;  // a config this architecture cannot launch: no code
#endif
  extern __shared__ __align__(128) uint8_t smem_raw[];
  const Smem<C> sm(smem_raw);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.z;
  if (tid == 0) stamp(kEntry);

  if (p.counter != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && b == 0 && tid == 0) {
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
  w.rows = live_tokens(p.q_live, b, w.qlen) * p.H;  // the rows computed; the rest of the request's are zeros
  {  // the split-0 CTA of each row tile of the grid zeros the tile's rows past the live ones
    const int m0 = blockIdx.y * C::BM;
    if (blockIdx.x == 0 && m0 + C::BM > w.rows && m0 < w.qlen * p.H)
      zero_rows(p.out, p.o_st, p.o_sh, p.H, w.qs, max(m0, w.rows), min(m0 + C::BM, w.qlen * p.H));
  }
  const int splits = live_splits(p.splits, p.m_tiles, p.pair, w.rows, C::BM);
  const int c = blockIdx.y * p.splits + blockIdx.x;  // this CTA's place in the request's grid
  const int split = c % splits, mt = c / splits;
  w.m0 = mt * C::BM;
  if (w.m0 >= w.rows) return;
  w.P = static_cast<int>(kv_end - w.kv0);
  w.L = w.P + w.qlen;
  int used;
  split_range(w.L, splits, split, C::BN, w.k_lo, w.k_hi, used);
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
    sm.epi->row0 = (static_cast<int64_t>(b) * p.m_tiles * p.splits + mt * splits + split) * C::BM;
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
  // Split each request's keys s ways, s minimising waves(s) * (1/s + SPLIT_CTA_COST): waves(s) = ceil(base*s / slots)
  // rounds of CTAs, each reading 1/s of a prefix plus a fixed cost (Q's load, the partial rows, the combine's share).
  // The prefix is unknown here (a graph captured at a short one replays at a long one), so the cost is a fraction of
  // a whole prefix's CTA. Where base*s fits one wave this is the largest such s, as before; past half the slots it
  // is 3 to 5 splits over 2 or 3 waves instead of one split on half the device (NOTES.md, "DDTree's sizes").
  long best_s = 1;
  double best = 1e30;
  for (long s = 1; s <= MAX_SPLITS && (s == 1 || base * s <= MAX_SPLIT_WAVES * cta_slots); ++s) {
    const long waves = (base * s + cta_slots - 1) / cta_slots;
    const double cost = waves * (1.0 / s + SPLIT_CTA_COST);
    if (cost < best - 1e-9) best = cost, best_s = s;
  }
  pl.splits = static_cast<int>(best_s);
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
  p.q_live = a->q_live;

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

// The one place a kdtree_config becomes a tile configuration: f(Wide{}), f(Compact{}), ... by the rows of
// include/kdtree_tile_configs.h (f takes the type by value: `[&](auto c) { using C = decltype(c); ... }`),
// KDTREE_ERR_ARGUMENT for any other value.
template <class F>
int with_config(int config, F&& f) {
#define KDTREE_TILE_CONFIG(NAME, ID, Type, ...) \
  if (config == KDTREE_CONFIG_##NAME) return f(Type{});
#include "kdtree_tile_configs.h"
#undef KDTREE_TILE_CONFIG
#define KDTREE_TILE_CONFIG(NAME, ...) " KDTREE_CONFIG_" #NAME
  return fail(KDTREE_ERR_ARGUMENT, "config must be one of"
#include "kdtree_tile_configs.h"
  );
#undef KDTREE_TILE_CONFIG
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
