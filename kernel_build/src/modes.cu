// Live mode switching inside CUDA graphs. A graph captured with every mode holds, per verify call: the KV write,
// kdtree's kernel, and an IF node holding the original's kernel and kdtree_mode_post. Which of them does work is
// decided on the device at each replay, once per captured step, by kdtree_mode_gate: it reads the mode the host
// wrote into pinned memory (no CUDA call on the host), keeps it in device memory for the step's kernels, gives
// kdtree's kernel the step's extents (zeros in standby, where it returns at once) and sets every IF node of the
// step (skipped in on). In on the original's path costs a skipped node per call, not a kernel.
#include <algorithm>

#include "parity.cuh"

namespace {

template <class T>
__device__ __forceinline__ void gate_copy(const void* src, int n, void* dst, bool run) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) static_cast<T*>(dst)[i] = run ? static_cast<const T*>(src)[i] : T(0);
}

__global__ void __launch_bounds__(256)
    gate_kernel(const unsigned* host_mode, unsigned* mode, const void* qo_indptr, int qo_type, int n, void* qo_kdtree,
                const kdtree_branches* branches, unsigned long long* counter, unsigned long long* counter_mirror) {
  __shared__ unsigned m;
  __shared__ unsigned long long count;
  if (threadIdx.x == 0) {
    m = *reinterpret_cast<const volatile unsigned*>(host_mode);  // host memory: read once per step
    *mode = m;
    count = *reinterpret_cast<const volatile unsigned long long*>(&branches->count);
  }
  __syncthreads();
  const unsigned original = m != KDTREE_MODE_ON;
  for (unsigned long long i = threadIdx.x; i < count && i < KDTREE_MAX_BRANCHES; i += blockDim.x)
    cudaGraphSetConditional(reinterpret_cast<const volatile unsigned long long*>(branches->handles)[i], original);
  const bool run = m == KDTREE_MODE_ON || m == KDTREE_MODE_VALIDATE;
  if (qo_type == KDTREE_I64) gate_copy<long long>(qo_indptr, n, qo_kdtree, run);
  else gate_copy<int>(qo_indptr, n, qo_kdtree, run);
  if (threadIdx.x == 0 && !original && counter != nullptr) {  // on: each of the step's calls is served by kdtree
    const unsigned long long v = atomicAdd(counter, count) + count;
    if (counter_mirror != nullptr) *reinterpret_cast<volatile unsigned long long*>(counter_mirror) = v;
  }
}

__global__ void __launch_bounds__(kdtree_parity::THREADS)
    post_kernel(const unsigned* mode, __nv_bfloat16* ours, const __nv_bfloat16* orig, int64_t n,
                kdtree_parity::Stats* st, kdtree_parity_totals* mirror, float rtol) {
  if (*mode == KDTREE_MODE_VALIDATE) {  // latched by the gate before this step's first call: one value per grid
    kdtree_parity::compare(ours, orig, n, st, mirror, rtol, true);
    return;
  }
  // standby (or a branch that ran because kdtree's kernel did not set its handle): serve the original's result
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    ours[i] = orig[i];
}

int cuda_status(cudaError_t e) { return e == cudaSuccess ? KDTREE_OK : KDTREE_ERR_CUDA; }

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int kdtree_mode_gate(const unsigned* host_mode, unsigned* mode,
                                                            const void* qo_indptr, int qo_type, int n,
                                                            void* qo_kdtree, const kdtree_branches* branches,
                                                            unsigned long long* counter,
                                                            unsigned long long* counter_mirror, void* stream) {
  if (host_mode == nullptr || mode == nullptr || qo_indptr == nullptr || qo_kdtree == nullptr ||
      branches == nullptr || n < 2 || (qo_type != KDTREE_I32 && qo_type != KDTREE_I64))
    return KDTREE_ERR_ARGUMENT;
  gate_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream)>>>(host_mode, mode, qo_indptr, qo_type, n, qo_kdtree,
                                                                branches, counter, counter_mirror);
  return cuda_status(cudaGetLastError());
}

__attribute__((visibility("default"))) int kdtree_mode_post(const unsigned* mode, void* ours, const void* orig,
                                                            int64_t n, void* stats, kdtree_parity_totals* mirror,
                                                            float rtol, void* stream) {
  if (mode == nullptr || ours == nullptr || orig == nullptr || stats == nullptr || n < 1) return KDTREE_ERR_ARGUMENT;
  post_kernel<<<kdtree_parity::blocks_for(n), kdtree_parity::THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      mode, static_cast<__nv_bfloat16*>(ours), static_cast<const __nv_bfloat16*>(orig), n,
      static_cast<kdtree_parity::Stats*>(stats), mirror, rtol);
  return cuda_status(cudaGetLastError());
}

__attribute__((visibility("default"))) int kdtree_branch_handle(void* stream, unsigned long long* handle) {
  cudaStreamCaptureStatus status;
  cudaGraph_t graph;
  if (handle == nullptr) return KDTREE_ERR_ARGUMENT;
  if (int rc = cuda_status(cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, nullptr, &graph));
      rc != KDTREE_OK || status != cudaStreamCaptureStatusActive)
    return rc != KDTREE_OK ? rc : KDTREE_ERR_ARGUMENT;
  // Reset to 1 at every launch: a replay whose handle nobody set runs the original (the served result stays right).
  cudaGraphConditionalHandle h;
  int rc = cuda_status(cudaGraphConditionalHandleCreate(&h, graph, 1, cudaGraphCondAssignDefault));
  *handle = h;
  return rc;
}

__attribute__((visibility("default"))) int kdtree_branch_begin(void* stream, void* body_stream,
                                                              unsigned long long handle) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus status;
  cudaGraph_t graph;
  const cudaGraphNode_t* deps = nullptr;
  const cudaGraphEdgeData* edges = nullptr;
  size_t n = 0;
  if (int rc = cuda_status(cudaStreamGetCaptureInfo(s, &status, nullptr, &graph, &deps, &edges, &n));
      rc != KDTREE_OK || status != cudaStreamCaptureStatusActive)
    return rc != KDTREE_OK ? rc : KDTREE_ERR_ARGUMENT;
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
  if (int rc = cuda_status(cudaGraphAddNode(&node, graph, deps, edges, n, &params)); rc != KDTREE_OK) return rc;
  if (int rc = cuda_status(cudaStreamUpdateCaptureDependencies(s, &node, nullptr, 1, cudaStreamSetCaptureDependencies));
      rc != KDTREE_OK)
    return rc;
  return cuda_status(cudaStreamBeginCaptureToGraph(static_cast<cudaStream_t>(body_stream), params.conditional.phGraph_out[0],
                                                   nullptr, nullptr, 0, cudaStreamCaptureModeRelaxed));
}

__attribute__((visibility("default"))) int kdtree_branch_end(void* body_stream) {
  cudaGraph_t body;
  return cuda_status(cudaStreamEndCapture(static_cast<cudaStream_t>(body_stream), &body));
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
