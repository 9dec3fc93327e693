// Live mode switching inside CUDA graphs. A graph captured with every mode holds, per verify call: the KV write,
// kdtree's kernel and the original's, and kdtree_mode_post. Which of them does work is decided on the device at
// replay time: once per captured step kdtree_mode_gate reads the mode the host wrote into pinned memory (no CUDA
// call on the host), keeps it in device memory for the step, and gives each path extents that are either the
// step's real ones or all zeros; both attention kernels return at once when a request has no draft tokens.
#include <algorithm>

#include "parity.cuh"

namespace {

template <class T>
__device__ __forceinline__ void gate_copy(const void* src, int n, void* kdtree, void* original, bool run_kdtree,
                                          bool run_original) {
  const T* s = static_cast<const T*>(src);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T v = s[i];
    static_cast<T*>(kdtree)[i] = run_kdtree ? v : T(0);
    static_cast<T*>(original)[i] = run_original ? v : T(0);
  }
}

__global__ void __launch_bounds__(256) gate_kernel(const unsigned* host_mode, unsigned* mode, const void* qo_indptr,
                                                   int qo_type, int n, void* qo_kdtree, void* qo_original) {
  __shared__ unsigned m;
  if (threadIdx.x == 0) {
    m = *reinterpret_cast<const volatile unsigned*>(host_mode);  // one read of host memory per step
    *mode = m;
  }
  __syncthreads();
  const bool kdtree = m == KDTREE_MODE_ON || m == KDTREE_MODE_VALIDATE;
  const bool original = m != KDTREE_MODE_ON;
  if (qo_type == KDTREE_I64) gate_copy<long long>(qo_indptr, n, qo_kdtree, qo_original, kdtree, original);
  else gate_copy<int>(qo_indptr, n, qo_kdtree, qo_original, kdtree, original);
}

__global__ void __launch_bounds__(kdtree_parity::THREADS)
    post_kernel(const unsigned* mode, __nv_bfloat16* ours, const __nv_bfloat16* orig, int64_t n,
                kdtree_parity::Stats* st, kdtree_parity_totals* mirror, float rtol, unsigned long long* counter,
                unsigned long long* counter_mirror) {
  // Launched as a programmatic dependent of the kernel before it (kdtree's, which lets dependents launch at its
  // start): its blocks are scheduled early and wait here for that kernel to complete and flush its output.
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const unsigned m = *mode;  // written by the gate before this step's first call: the same for every block
  if (m == KDTREE_MODE_ON) {
    if (counter != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
      const unsigned long long v = atomicAdd(counter, 1ull) + 1ull;
      if (counter_mirror != nullptr) *reinterpret_cast<volatile unsigned long long*>(counter_mirror) = v;
    }
    return;
  }
  if (m == KDTREE_MODE_VALIDATE) {
    kdtree_parity::compare(ours, orig, n, st, mirror, rtol, true);
    return;
  }
  // standby: the original served; hand its result to the tensor the call returns
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    ours[i] = orig[i];
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int kdtree_mode_gate(const unsigned* host_mode, unsigned* mode,
                                                            const void* qo_indptr, int qo_type, int n,
                                                            void* qo_kdtree, void* qo_original, void* stream) {
  if (host_mode == nullptr || mode == nullptr || qo_indptr == nullptr || qo_kdtree == nullptr ||
      qo_original == nullptr || n < 2 || (qo_type != KDTREE_I32 && qo_type != KDTREE_I64))
    return KDTREE_ERR_ARGUMENT;
  gate_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(host_mode, mode, qo_indptr, qo_type, n, qo_kdtree,
                                                                qo_original);
  return cudaGetLastError() == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

__attribute__((visibility("default"))) int kdtree_mode_post(const unsigned* mode, void* ours, const void* orig,
                                                            int64_t n, void* stats, kdtree_parity_totals* mirror,
                                                            float rtol, unsigned long long* counter,
                                                            unsigned long long* counter_mirror, void* stream) {
  if (mode == nullptr || ours == nullptr || orig == nullptr || stats == nullptr || n < 1) return KDTREE_ERR_ARGUMENT;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(kdtree_parity::blocks_for(n));
  cfg.blockDim = dim3(kdtree_parity::THREADS);
  cfg.stream = static_cast<cudaStream_t>(stream);
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, post_kernel, mode, static_cast<__nv_bfloat16*>(ours),
                                           static_cast<const __nv_bfloat16*>(orig), n,
                                           static_cast<kdtree_parity::Stats*>(stats), mirror, rtol, counter,
                                           counter_mirror);
  return e == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA;
}

__attribute__((visibility("default"))) int kdtree_capture_id(void* stream, unsigned long long* id) {
  if (id == nullptr) return KDTREE_ERR_ARGUMENT;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  if (cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &capture) != cudaSuccess)
    return KDTREE_ERR_CUDA;
  *id = status == cudaStreamCaptureStatusActive ? capture : 0;
  return KDTREE_OK;
}

}  // extern "C"
