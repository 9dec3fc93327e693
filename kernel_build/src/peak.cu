// The ceiling the benchmarks' roofline uses: the rate of mma.sync.m16n8k16 bf16 with fp32 accumulate, the tensor
// instruction of the verify kernel (and the one sm_120 has), measured on the current device. It lives in the
// library so that the server image, which has no nvcc, measures it with the code that ships (python -m kdtree.bench).
// 8 independent accumulators per warp, so the loop is bound by the tensor pipe and not by one mma's latency.
#include <cuda_runtime.h>

#include <cstdint>

#include "kdtree_verify.h"
#include "status.cuh"

namespace {

__global__ void mma_loop(float* sink, int iters) {
  // Operands are bf16 ones with a per-thread / per-block bit flipped: nothing is constant-folded.
  uint32_t a[4] = {0x3f803f80u ^ threadIdx.x, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}, b0 = 0x3f803f80u,
           b1 = b0 ^ blockIdx.x;
  float c[8][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
          "{%0,%1,%2,%3};\n"
          : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  float s = 0;
  for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (s == 12345.f) sink[threadIdx.x] = s;  // never true; keeps the loop alive
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int kdtree_mma_peak(int warps_per_sm, float* tflops, void* stream) {
  if (tflops == nullptr || warps_per_sm < 0 || warps_per_sm > 32)
    return kdtree::fail(KDTREE_ERR_ARGUMENT, "tflops is NULL or warps_per_sm is not in 0..32");
  *tflops = 0.f;
  int dev = 0, sms = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return kdtree::fail_cuda(e, "the current device");
  // Default: 4 blocks of 8 warps per SM (every scheduler busy with several warps). With warps_per_sm, one block of
  // that many warps per SM: 4 is one warp per scheduler, the rate a lone warp reaches.
  const int threads = warps_per_sm > 0 ? 32 * warps_per_sm : 256, blocks = warps_per_sm > 0 ? sms : sms * 4;
  const int iters = 20000;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  float* sink = nullptr;
  cudaEvent_t e0 = nullptr, e1 = nullptr;
  float best = 1e30f;
  bool ok = cudaMalloc(&sink, 4096) == cudaSuccess && cudaEventCreate(&e0) == cudaSuccess &&
            cudaEventCreate(&e1) == cudaSuccess;
  if (ok) {
    mma_loop<<<blocks, threads, 0, s>>>(sink, 100);  // warm-up: clocks up, code loaded
    for (int r = 0; ok && r < 5; ++r) {
      float ms = 0.f;
      ok = cudaEventRecord(e0, s) == cudaSuccess;
      mma_loop<<<blocks, threads, 0, s>>>(sink, iters);
      ok = ok && cudaGetLastError() == cudaSuccess && cudaEventRecord(e1, s) == cudaSuccess &&
           cudaEventSynchronize(e1) == cudaSuccess && cudaEventElapsedTime(&ms, e0, e1) == cudaSuccess;
      if (ok && ms < best) best = ms;
    }
  }
  if (e0 != nullptr) cudaEventDestroy(e0);
  if (e1 != nullptr) cudaEventDestroy(e1);
  if (sink != nullptr) cudaFree(sink);
  if (!ok) return kdtree::fail_cuda(cudaGetLastError(), "a CUDA call of the measurement");
  if (best <= 0.f || best >= 1e30f) return kdtree::fail(KDTREE_ERR_CUDA, "no timing measured");
  const double flops = 2.0 * 16 * 8 * 16 * 8.0 * iters * (threads / 32) * static_cast<double>(blocks);
  *tflops = static_cast<float>(flops / (best * 1e-3) / 1e12);
  return KDTREE_OK;
}
