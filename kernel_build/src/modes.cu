// Live mode switching inside CUDA graphs. A graph captured with every mode holds, per verify call, kdtree's kernel
// twice (on: into the call's output, on a side stream; validate: into a scratch buffer), the original's kernel and
// kdtree_mode_post. Which of them does work is decided on the device at each replay, once per captured step, by
// kdtree_mode_gate: it reads the mode the host wrote into pinned memory (no CUDA call on the host), keeps it for
// the step's kernels, and gives each launch the step's extents or zeros; with no draft tokens a kernel returns at
// once. In on, the original's path (its early exits) runs beside kdtree's kernel, not after it.
#include <algorithm>

#include "parity.cuh"
#include "status.cuh"

namespace {

template <class T>
__device__ __forceinline__ void gate_copy(const void* src, int n, void* dst, bool on, bool validate, bool original) {
  const T* s = static_cast<const T*>(src);
  T* d = static_cast<T*>(dst);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T v = s[i];
    d[i] = on ? v : T(0);
    d[n + i] = validate ? v : T(0);
    d[2 * n + i] = original ? v : T(0);
  }
}

__global__ void __launch_bounds__(256)
    gate_kernel(const unsigned* host_mode, unsigned* mode, const void* qo_indptr, int qo_type, int n, void* qo_gated,
                const unsigned long long* step_calls, unsigned long long* counter, unsigned long long* counter_mirror) {
  __shared__ unsigned m;
  if (threadIdx.x == 0) {
    m = *reinterpret_cast<const volatile unsigned*>(host_mode);  // host memory: read once per step
    *mode = m;
  }
  __syncthreads();
  const bool on = m == KDTREE_MODE_ON, validate = m == KDTREE_MODE_VALIDATE;
  if (qo_type == KDTREE_I64) gate_copy<long long>(qo_indptr, n, qo_gated, on, validate, !on);
  else gate_copy<int>(qo_indptr, n, qo_gated, on, validate, !on);
  if (threadIdx.x == 0 && on && counter != nullptr) {  // each of the step's captured calls is served by kdtree
    const unsigned long long calls = *reinterpret_cast<const volatile unsigned long long*>(step_calls);
    const unsigned long long v = atomicAdd(counter, calls) + calls;
    if (counter_mirror != nullptr) *reinterpret_cast<volatile unsigned long long*>(counter_mirror) = v;
  }
}

__global__ void __launch_bounds__(kdtree_parity::THREADS)
    post_kernel(const unsigned* mode, const __nv_bfloat16* ours, const __nv_bfloat16* orig, int64_t n,
                kdtree_parity::Stats* st, kdtree_parity_totals* mirror, float rtol) {
  if (*mode != KDTREE_MODE_VALIDATE) return;  // latched by the step's gate: one value for the whole grid
  kdtree_parity::compare(ours, orig, n, st, mirror, rtol);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int kdtree_mode_gate(const unsigned* host_mode, unsigned* mode,
                                                            const void* qo_indptr, int qo_type, int n,
                                                            void* qo_gated, const unsigned long long* step_calls,
                                                            unsigned long long* counter,
                                                            unsigned long long* counter_mirror, void* stream) {
  if (host_mode == nullptr || mode == nullptr || qo_indptr == nullptr || qo_gated == nullptr ||
      step_calls == nullptr || n < 2 || (qo_type != KDTREE_I32 && qo_type != KDTREE_I64))
    return kdtree::fail(KDTREE_ERR_ARGUMENT,
                        "a required pointer is NULL, n < 2, or qo_type is not KDTREE_I32/KDTREE_I64");
  gate_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(host_mode, mode, qo_indptr, qo_type, n, qo_gated,
                                                                step_calls, counter, counter_mirror);
  return kdtree::check_cuda(cudaGetLastError(), "launch");
}

__attribute__((visibility("default"))) int kdtree_mode_post(const unsigned* mode, const void* ours, const void* orig,
                                                            int64_t n, void* stats, kdtree_parity_totals* mirror,
                                                            float rtol, void* stream) {
  if (mode == nullptr || ours == nullptr || orig == nullptr || stats == nullptr || n < 1)
    return kdtree::fail(KDTREE_ERR_ARGUMENT, "a required pointer is NULL or n < 1");
  post_kernel<<<kdtree_parity::blocks_for(n), kdtree_parity::THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      mode, static_cast<const __nv_bfloat16*>(ours), static_cast<const __nv_bfloat16*>(orig), n,
      static_cast<kdtree_parity::Stats*>(stats), mirror, rtol);
  return kdtree::check_cuda(cudaGetLastError(), "launch");
}

__attribute__((visibility("default"))) int kdtree_capture_id(void* stream, unsigned long long* id) {
  if (id == nullptr) return kdtree::fail(KDTREE_ERR_ARGUMENT, "id is NULL");
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  const cudaError_t e = cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &capture);
  if (e != cudaSuccess) return kdtree::fail_cuda(e, "cudaStreamGetCaptureInfo");
  *id = status == cudaStreamCaptureStatusActive ? capture : 0;
  return KDTREE_OK;
}

}  // extern "C"
