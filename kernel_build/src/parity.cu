// Validate mode: compare kdtree's output with the original's on the device and keep running totals,
// with no host synchronisation (capture-safe). The last block of each call folds the call's sums into
// the totals, mirrors them to host-mapped memory (read by the status heartbeat without a CUDA call),
// and clears the per-call scratch for the next call.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>

#include "kdtree_verify.h"

namespace {

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

__global__ void __launch_bounds__(THREADS) parity_kernel(const __nv_bfloat16* ours, const __nv_bfloat16* ref, int64_t n,
                                                         Stats* st, kdtree_parity_totals* mirror, float rtol) {
  float ssd = 0.f, ssr = 0.f, mabs = 0.f;
  unsigned int bad = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(THREADS) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * THREADS) {
    float a = __bfloat162float(ours[i]), r = __bfloat162float(ref[i]);
    if (!isfinite(a)) {
      ++bad;
      continue;
    }
    float d = a - r;
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

}  // namespace

extern "C" {

__attribute__((visibility("default"))) size_t kdtree_parity_stats_bytes(void) { return sizeof(Stats); }

__attribute__((visibility("default"))) int kdtree_parity_update(const void* ours, const void* ref, int64_t n,
                                                                void* stats, kdtree_parity_totals* mirror, float rtol,
                                                                void* stream) {
  if (ours == nullptr || ref == nullptr || stats == nullptr || n < 1) return KDTREE_ERR_ARGUMENT;
  int blocks = static_cast<int>(std::min<int64_t>(264, (n + THREADS * 8 - 1) / (THREADS * 8)));
  parity_kernel<<<blocks, THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(ours), static_cast<const __nv_bfloat16*>(ref), n, static_cast<Stats*>(stats),
      mirror, rtol);
  return cudaGetLastError() == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

}  // extern "C"

extern "C" __attribute__((visibility("default"))) int kdtree_host_device_pointer(void* host, void** device) {
  // Pinned host memory that the kernels write (counter and parity mirrors): its device-side address.
  return cudaHostGetDevicePointer(device, host, 0) == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}
