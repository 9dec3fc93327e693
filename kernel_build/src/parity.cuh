// Validate mode's comparison of kdtree's output with the original's, accumulated on the device with no host
// synchronisation (capture-safe). Shared by kdtree_parity_update (eager calls) and kdtree_mode_post (calls
// captured with every mode). The last block of each call folds the call's sums into the totals, mirrors them
// to host-mapped memory (read by the status heartbeat without a CUDA call), and clears the per-call scratch.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kdtree_verify.h"

namespace kdtree_parity {

struct Scratch {
  double sum_sq_diff;
  double sum_sq_ref;
  unsigned int max_abs_bits;  // non-negative floats order like their bit patterns
  unsigned int nonfinite;
  unsigned int blocks_done;
  unsigned int pad;
};
struct Stats {
  Scratch call;
  kdtree_parity_totals totals;
};

constexpr int THREADS = 256;

// Blocks for n values: enough to stream them, few enough that the per-call fold stays cheap.
inline int blocks_for(int64_t n) {
  const int64_t b = (n + THREADS * 8 - 1) / (THREADS * 8);
  return static_cast<int>(b < 1 ? 1 : b > 264 ? 264 : b);
}

// Every block of the grid calls this once, all threads together.
__device__ __forceinline__ void compare(const __nv_bfloat16* ours, const __nv_bfloat16* ref, int64_t n, Stats* st,
                                        kdtree_parity_totals* mirror, float rtol) {
  float ssd = 0.f, ssr = 0.f, mabs = 0.f;
  unsigned int bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(THREADS) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * THREADS) {
    const float a = __bfloat162float(ours[i]), r = __bfloat162float(ref[i]);
    if (!isfinite(a)) {
      ++bad;
      continue;
    }
    const float d = a - r;
    ssd += d * d;
    ssr += r * r;
    mabs = fmaxf(mabs, fabsf(d));
  }
  __shared__ float s_ssd[THREADS / 32], s_ssr[THREADS / 32], s_max[THREADS / 32];
  __shared__ unsigned int s_bad[THREADS / 32];
  __shared__ bool s_last;
  for (int o = 16; o > 0; o >>= 1) {
    ssd += __shfl_xor_sync(0xffffffffu, ssd, o);
    ssr += __shfl_xor_sync(0xffffffffu, ssr, o);
    mabs = fmaxf(mabs, __shfl_xor_sync(0xffffffffu, mabs, o));
    bad += __shfl_xor_sync(0xffffffffu, bad, o);
  }
  const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) { s_ssd[w] = ssd; s_ssr[w] = ssr; s_max[w] = mabs; s_bad[w] = bad; }
  __syncthreads();
  if (threadIdx.x == 0) {
    double bssd = 0, bssr = 0;
    float bmax = 0.f;
    unsigned int bbad = 0;
    for (int i = 0; i < THREADS / 32; ++i) { bssd += s_ssd[i]; bssr += s_ssr[i]; bmax = fmaxf(bmax, s_max[i]); bbad += s_bad[i]; }
    atomicAdd(&st->call.sum_sq_diff, bssd);
    atomicAdd(&st->call.sum_sq_ref, bssr);
    atomicMax(&st->call.max_abs_bits, __float_as_uint(bmax));
    atomicAdd(&st->call.nonfinite, bbad);
    __threadfence();
    s_last = atomicAdd(&st->call.blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last || threadIdx.x != 0) return;
  __threadfence();
  volatile Scratch* c = &st->call;
  const double d = c->sum_sq_diff, r = c->sum_sq_ref;
  const float rel = r > 0 ? static_cast<float>(sqrt(d / r)) : (d > 0 ? INFINITY : 0.f);
  const float mabs_call = __uint_as_float(c->max_abs_bits);
  const bool nonfinite = c->nonfinite > 0;
  kdtree_parity_totals& t = st->totals;
  t.calls_compared += 1;
  t.nan_inf += nonfinite ? 1 : 0;
  t.calls_over_tol += (nonfinite || rel > rtol) ? 1 : 0;
  t.max_abs_err = fmaxf(t.max_abs_err, mabs_call);
  t.max_rel_l2 = fmaxf(t.max_rel_l2, rel);
  t.last_rel_l2 = rel;
  t.rtol = rtol;
  c->sum_sq_diff = 0; c->sum_sq_ref = 0; c->max_abs_bits = 0; c->nonfinite = 0; c->blocks_done = 0;
  if (mirror != nullptr) {
    volatile kdtree_parity_totals* m = mirror;
    m->max_abs_err = t.max_abs_err; m->max_rel_l2 = t.max_rel_l2; m->last_rel_l2 = t.last_rel_l2; m->rtol = t.rtol;
    m->calls_over_tol = t.calls_over_tol; m->nan_inf = t.nan_inf;
    m->calls_compared = t.calls_compared;  // last: a reader that sees the new count sees the rest
  }
}

}  // namespace kdtree_parity
