// How fast the two CTAs of a cluster exchange their halves of the partial rows (the pair epilogue's merge):
// every CTA of a one-wave grid of 2-CTA clusters sends BYTES of its shared memory to the other and
// consumes what it receives, by four transports, and two ways to hand data over before a pull:
//   pull   ld.shared::cluster.v4 from the other CTA, every load of a thread issued before the first use
//   push   st.shared::cluster.v4 into the other CTA, then a cluster barrier
//   bulk   cp.async.bulk shared::cta -> shared::cluster (the copy engine), completion on the receiver's
//          mbarrier, one copy per warp
//   global st.global, a cluster barrier, ld.global.cg (through L2)
//   flag+pull  a cluster-scope fence, a CTA barrier and a flag stored into the other CTA, then pull
//   pass+pull  a pass over twice the bytes in local shared memory (fp32 rows packed to half), a cluster
//              barrier, then pull
// Time: %globaltimer per CTA from a cluster barrier before the exchange to the data consumed;
// printed: median over CTAs and the span from the first start to the last end (us).
// On the GPU machine: nvcc -O3 -arch=sm_90 -std=c++17 kernel_build/bench/tuning/dsmem_probe.cu -o /tmp/dsmem_probe &&
// /tmp/dsmem_probe (a table for 64 KB and 32 KB per CTA; every received value is checked). Results: NOTES.md.
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

constexpr int THREADS = 256, MAX_PER_THREAD = 16, REGION = 64 * 1024, SMEM = 3 * REGION + 64;  // src, dst/scratch (2 regions), flags

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t peer_of(uint32_t addr) {
  uint32_t rank, r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank ^ 1u));
  return r;
}
__device__ __forceinline__ uint64_t now() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

// What CTA blockIdx.x ^ 1 wrote at index i (the source fill below); a mismatch counts in *bad.
__device__ __forceinline__ float check(float4 a, int i, int* bad) {
  if (a.x != float(blockIdx.x ^ 1) || a.y != float(i) || a.z != 1.f || a.w != 2.f) atomicAdd(bad, 1);
  return a.z;
}

// Every value of the other CTA's `src` this thread consumes, all loads issued before the first use.
__device__ __forceinline__ float pull(const float4* src, int per, int* bad) {
  const uint32_t other = peer_of(smem_u32(src));
  const int tid = threadIdx.x;
  float4 v[MAX_PER_THREAD];
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < MAX_PER_THREAD; ++j)
    if (j < per)
      asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                   : "=f"(v[j].x), "=f"(v[j].y), "=f"(v[j].z), "=f"(v[j].w)
                   : "r"(other + (tid + j * THREADS) * 16)
                   : "memory");
#pragma unroll
  for (int j = 0; j < MAX_PER_THREAD; ++j)
    if (j < per) acc += check(v[j], tid + j * THREADS, bad);
  return acc;
}

__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(THREADS, 1)
    exchange(int mode, int bytes, float4* gbuf, uint64_t* times, float* sink, int* bad) {
  extern __shared__ __align__(128) uint8_t smem[];
  float4* src = reinterpret_cast<float4*>(smem);
  float4* dst = reinterpret_cast<float4*>(smem + REGION);
  uint64_t* bar = reinterpret_cast<uint64_t*>(smem + 3 * REGION);
  const int tid = threadIdx.x, n = bytes / 16, per = n / THREADS;
  for (int i = tid; i < n; i += THREADS) src[i] = make_float4(blockIdx.x, i, 1.f, 2.f);
  if (tid == 0) bar[1] = 0;  // mode 4's flag
  if (tid == 0 && mode == 2) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(smem_u32(bar)));
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes));
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();
  cluster_sync();
  const uint64_t t0 = now();
  float acc = 0.f;
  if (mode == 0) {  // pull
    acc += pull(src, per, bad);
  } else if (mode == 1) {  // push
    const uint32_t other = peer_of(smem_u32(dst));
#pragma unroll
    for (int j = 0; j < MAX_PER_THREAD; ++j)
      if (j < per) {
        const float4 a = src[tid + j * THREADS];
        asm volatile("st.shared::cluster.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"r"(other + (tid + j * THREADS) * 16),
                     "f"(a.x), "f"(a.y), "f"(a.z), "f"(a.w)
                     : "memory");
      }
    cluster_sync();
#pragma unroll
    for (int j = 0; j < MAX_PER_THREAD; ++j)
      if (j < per) acc += check(dst[tid + j * THREADS], tid + j * THREADS, bad);
  } else if (mode == 2) {  // bulk: warp w sends its 1/8 of the bytes
    const int warp = tid / 32, share = bytes / (THREADS / 32);
    if ((tid & 31) == 0)
      asm volatile("cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                       peer_of(smem_u32(smem + REGION + warp * share))),
                   "r"(smem_u32(smem + warp * share)), "r"(share), "r"(peer_of(smem_u32(bar)))
                   : "memory");
    uint32_t done = 0;
    while (!done)
      asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\nselp.u32 %0, 1, 0, p;\n}\n"
                   : "=r"(done)
                   : "r"(smem_u32(bar))
                   : "memory");
#pragma unroll
    for (int j = 0; j < MAX_PER_THREAD; ++j)
      if (j < per) acc += check(dst[tid + j * THREADS], tid + j * THREADS, bad);
  } else if (mode == 4 || mode == 5) {  // 4: a flag handoff; 5: a local pass over 2x the bytes, a barrier; then pull
    if (mode == 4) {
      asm volatile("fence.acq_rel.cluster;\n" ::: "memory");
      __syncthreads();
      if (tid == 0)
        asm volatile("st.release.cluster.shared::cluster.b64 [%0], %1;\n" ::"r"(peer_of(smem_u32(bar + 1))), "l"(1ll) : "memory");
      long long f = 0;
      while (f != 1) asm volatile("ld.acquire.cluster.shared::cta.b64 %0, [%1];\n" : "=l"(f) : "r"(smem_u32(bar + 1)) : "memory");
    } else {
      float4* wide = reinterpret_cast<float4*>(smem + REGION);  // 2x the bytes, read and halved in place
      for (int i = tid; i < 2 * n; i += THREADS) {
        acc += wide[i].x;  // read, not checked (it is not initialised)
        if (i % 2 == 0) src[i / 2] = make_float4(blockIdx.x, i / 2, 1.f, 2.f);
      }
      cluster_sync();
    }
    acc += pull(src, per, bad);
  } else {  // 3: global
    float4* mine = gbuf + static_cast<int64_t>(blockIdx.x) * (REGION / 16);
    float4* theirs = gbuf + static_cast<int64_t>(blockIdx.x ^ 1) * (REGION / 16);
#pragma unroll
    for (int j = 0; j < MAX_PER_THREAD; ++j)
      if (j < per) mine[tid + j * THREADS] = src[tid + j * THREADS];
    cluster_sync();
    float4 v[MAX_PER_THREAD];
#pragma unroll
    for (int j = 0; j < MAX_PER_THREAD; ++j)
      if (j < per) v[j] = __ldcg(theirs + tid + j * THREADS);
#pragma unroll
    for (int j = 0; j < MAX_PER_THREAD; ++j)
      if (j < per) acc += check(v[j], tid + j * THREADS, bad);
  }
  __syncthreads();
  const uint64_t t1 = now();
  if (acc == 12345.f) sink[tid] = acc;
  if (tid == 0) times[2 * blockIdx.x] = t0, times[2 * blockIdx.x + 1] = t1;
  cluster_sync();  // no CTA leaves while the other may still read or write its shared memory
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaFuncSetAttribute(exchange, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  cudaLaunchConfig_t cfg = {};
  cfg.blockDim = dim3(THREADS);
  cfg.dynamicSmemBytes = SMEM;
  int clusters = 0;
  cfg.gridDim = dim3(2);
  cudaOccupancyMaxActiveClusters(&clusters, exchange, &cfg);
  const int blocks = 2 * std::min(clusters, sms / 2);
  cfg.gridDim = dim3(blocks);
  float4* gbuf;
  uint64_t* times;
  float* sink;
  int* bad;
  cudaMalloc(&bad, 4);
  cudaMemset(bad, 0, 4);
  cudaMalloc(&gbuf, static_cast<size_t>(blocks) * REGION);
  cudaMalloc(&times, blocks * 16);
  cudaMalloc(&sink, THREADS * 4);
  std::printf("%d CTAs (%d clusters of 2), %d threads; us per exchange: median CTA / first start to last end\n",
              blocks, blocks / 2, THREADS);
  const char* names[] = {"pull", "push", "bulk", "global", "flag+pull", "pass+pull"};
  for (int bytes : {REGION, REGION / 2}) {
    for (int mode = 0; mode < 6; ++mode) {
      std::vector<double> med, span;
      for (int rep = 0; rep < 20; ++rep) {
        cudaLaunchKernelEx(&cfg, exchange, mode, bytes, gbuf, times, sink, bad);
        std::vector<uint64_t> t(2 * blocks);
        if (cudaMemcpy(t.data(), times, t.size() * 8, cudaMemcpyDeviceToHost) != cudaSuccess) {
          std::printf("%s: %s\n", names[mode], cudaGetErrorString(cudaGetLastError()));
          return 1;
        }
        std::vector<double> d;
        uint64_t lo = UINT64_MAX, hi = 0;
        for (int b = 0; b < blocks; ++b) {
          d.push_back((t[2 * b + 1] - t[2 * b]) / 1e3);
          lo = std::min(lo, t[2 * b]);
          hi = std::max(hi, t[2 * b + 1]);
        }
        std::sort(d.begin(), d.end());
        med.push_back(d[blocks / 2]);
        span.push_back((hi - lo) / 1e3);
      }
      std::sort(med.begin(), med.end());
      std::sort(span.begin(), span.end());
      int nbad = 0;
      cudaMemcpy(&nbad, bad, 4, cudaMemcpyDeviceToHost);
      std::printf("%6d KB %-10s %7.2f %7.2f%s\n", bytes / 1024, names[mode], med[10], span[10], nbad ? "  WRONG DATA" : "");
      if (nbad) return 1;
    }
  }
  return 0;
}
