// Validate mode, eager calls: compare kdtree's output with the original's (parity.cuh does the work).
#include <algorithm>

#include "parity.cuh"
#include "status.cuh"

namespace {

__global__ void __launch_bounds__(kdtree_parity::THREADS)
    parity_kernel(const __nv_bfloat16* ours, const __nv_bfloat16* ref, int64_t n, kdtree_parity::Stats* st,
                  kdtree_parity_totals* mirror, float rtol) {
  kdtree_parity::compare(ours, ref, n, st, mirror, rtol);
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) size_t kdtree_parity_stats_bytes(void) { return sizeof(kdtree_parity::Stats); }

__attribute__((visibility("default"))) int kdtree_parity_update(const void* ours, const void* ref, int64_t n,
                                                                void* stats, kdtree_parity_totals* mirror, float rtol,
                                                                void* stream) {
  if (ours == nullptr || ref == nullptr || stats == nullptr || n < 1)
    return kdtree::fail(KDTREE_ERR_ARGUMENT, "a required pointer is NULL or n < 1");
  parity_kernel<<<kdtree_parity::blocks_for(n), kdtree_parity::THREADS, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(ours), static_cast<const __nv_bfloat16*>(ref), n,
      static_cast<kdtree_parity::Stats*>(stats), mirror, rtol);
  return kdtree::check_cuda(cudaGetLastError(), "launch");
}

}  // extern "C"

extern "C" __attribute__((visibility("default"))) int kdtree_host_device_pointer(void* host, void** device) {
  // Pinned host memory that the kernels read or write (mode word, counter and parity mirrors): its device address.
  if (host == nullptr || device == nullptr)
    return kdtree::fail(KDTREE_ERR_ARGUMENT, "host or device is NULL");
  return kdtree::check_cuda(cudaHostGetDevicePointer(device, host, 0), "cudaHostGetDevicePointer");
}
