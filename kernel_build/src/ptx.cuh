// Thin wrappers over the PTX instructions the kernel is built from: cp.async, ldmatrix, mma.sync
// m16n8k16 bf16 and f16 (sm_80 and later), mma.sync m16n8k32 fp8 and the fp8 conversions (sm_89 and later), and the
// thread-block-cluster ones (sm_90 and later, sm_120 included).
#pragma once
#include <cstdint>

namespace kdtree {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global->shared copy; when !valid the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// c += a (16x16, row) * b (16x8, col); bf16 inputs, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a * b as mma_bf16, f16 inputs.
__device__ __forceinline__ void mma_f16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a (16x32, row) * b (32x8, col); fp8 inputs (A_E4M3 / B_E4M3: e4m3, else e5m2), fp32 accumulate. Lane l
// (g = l / 4, t = l % 4) holds a[0] = row g, k 4t..4t+3; a[1] row g + 8; a[2], a[3] the same rows, k 16 + 4t..;
// b0 = k 4t..4t+3 and b1 = k 16 + 4t.. of column g; c as mma_bf16's.
template <bool A_E4M3, bool B_E4M3>
__device__ __forceinline__ void mma_fp8(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#define KDTREE_MMA_FP8(AT, BT)                                                                      \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." AT "." BT ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
               "{%8,%9}, {%0,%1,%2,%3};\n"                                                          \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                     \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
  if constexpr (A_E4M3 && B_E4M3) KDTREE_MMA_FP8("e4m3", "e4m3");
  else if constexpr (A_E4M3) KDTREE_MMA_FP8("e4m3", "e5m2");
  else if constexpr (B_E4M3) KDTREE_MMA_FP8("e5m2", "e4m3");
  else KDTREE_MMA_FP8("e5m2", "e5m2");
#undef KDTREE_MMA_FP8
}

// Four floats as four fp8 values (byte i = x_i; e4m3 when E4M3, else e5m2), rounded to nearest even and saturated
// to the type's largest finite value, as a cast to torch's float8 types of an in-range value (cvt.rn.satfinite).
template <bool E4M3>
__device__ __forceinline__ uint32_t f32x4_to_fp8x4(float x0, float x1, float x2, float x3) {
  uint16_t lo, hi;
  if constexpr (E4M3) {  // cvt's first source goes to the upper byte
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  } else {
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
  }
  return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
}

// prmt.b32: byte i of the result is byte (sel >> 4i) & 7 of {y, x} (x: bytes 0-3, y: bytes 4-7).
__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t y, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(sel));
  return r;
}

// Four fp8 values (bytes 0..3 of w, e4m3 when E4M3, else e5m2) as two f16x2, exactly (every e4m3 and e5m2 value is
// an f16 value): lo = (byte 0, byte 2), hi = (byte 1, byte 3). e5m2 is an f16's high byte: one prmt each (inf and NaN
// too). e4m3: one prmt and two F2FP; the integer form (sign kept, exponent and mantissa shifted down one bit: the
// value times 2^-8, the scales carrying 2^8) issues seven operations for the three and measured slower on the H200
// (kernel_build/BENCHMARKS.md, "The e5m2 widen as byte moves"): the conversions are the widen path's extra time.
template <bool E4M3>
__device__ __forceinline__ void fp8x4_to_f16x2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  if constexpr (E4M3) {
    const uint32_t t = prmt(w, 0, 0x3120);  // bytes 0, 2, 1, 3
    const uint16_t l = static_cast<uint16_t>(t), h = static_cast<uint16_t>(t >> 16);
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"(l));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"(h));
  } else {
    lo = prmt(w, 0, 0x2404);  // bytes 0 and 2 into the high bytes of the halves
    hi = prmt(w, 0, 0x3414);  // bytes 1 and 3
  }
}

// Every thread of the cluster's CTAs: writes before it (shared memory included) are visible after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// The address of the same shared-memory location in CTA `rank` of the cluster (distributed shared memory).
__device__ __forceinline__ uint32_t cluster_map(const void* p, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_u32(p)), "r"(rank));
  return r;
}
__device__ __forceinline__ float ld_cluster(uint32_t addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float4 ld_cluster4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

}  // namespace kdtree
