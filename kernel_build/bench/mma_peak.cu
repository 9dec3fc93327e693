// Ceiling for the roofline: the rate of mma.sync.m16n8k16 bf16 (fp32 accumulate), the tensor instruction
// the kdtree kernel uses (and the one sm_120 has). 8 independent accumulators per warp, all SMs busy.
// usage: mma_peak [warps per SM]; with the argument, one block of that many warps per SM (4 = one warp
// per scheduler: the rate a lone warp reaches).
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>

__global__ void mma_loop(float* sink, int iters) {
  uint32_t a[4] = {0x3f803f80u ^ threadIdx.x, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u}, b0 = 0x3f803f80u, b1 = b0 ^ blockIdx.x;
  float c[8][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j)
      asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                   : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3])
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  float s = 0;
  for (int j = 0; j < 8; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  if (s == 12345.f) sink[threadIdx.x] = s;
}

int main(int argc, char** argv) {
  int dev = 0, sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  float* sink;
  cudaMalloc(&sink, 4096);
  const int wps = argc > 1 ? atoi(argv[1]) : 0;
  const int threads = wps > 0 ? 32 * wps : 256, blocks = wps > 0 ? sms : sms * 4, iters = 20000;
  mma_loop<<<blocks, threads>>>(sink, 100);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  float best = 1e30f;
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0);
    mma_loop<<<blocks, threads>>>(sink, iters);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms;
    cudaEventElapsedTime(&ms, e0, e1);
    if (ms < best) best = ms;
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) { fprintf(stderr, "%s\n", cudaGetErrorString(err)); return 1; }
  double flops = 2.0 * 16 * 8 * 16 * 8.0 * iters * (threads / 32) * (double)blocks;
  printf("%.1f\n", flops / (best * 1e-3) / 1e12);
  return 0;
}
