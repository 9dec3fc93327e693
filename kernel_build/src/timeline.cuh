// Tuning builds' per-CTA timestamps (-DKDTREE_TIMELINE); in every other build the stamps compile to nothing.
#pragma once

namespace kdtree {

// Tuning builds only (-DKDTREE_TIMELINE, read by bench/tuning/timeline.py): %globaltimer stamps per CTA of the
// main kernel, and the first and last of each stamp over the combine's blocks. Other builds compile none.
enum Stamp {
  kEntry, kIndices, kQLanded, kTile0Landed, kFirstP, kOutputLoopDone, kScoreLoopDone,
  kStaged, kPeerReady, kMerged, kEpilogueDone  // epilogue: rows staged; pair: other CTA staged, merged
};
#ifdef KDTREE_TIMELINE
constexpr int TIMELINE_CTAS = 4096, TIMELINE_STAMPS = kEpilogueDone + 1;
__device__ unsigned long long g_timeline[TIMELINE_CTAS][TIMELINE_STAMPS];
__device__ unsigned long long g_timeline_combine[3][2];
__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void stamp(Stamp s) {
  const unsigned cta = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (cta < TIMELINE_CTAS) g_timeline[cta][s] = globaltimer();
}
__device__ __forceinline__ void stamp_combine(int s) {
  if (threadIdx.x == 0) {
    const unsigned long long t = globaltimer();
    atomicMin(&g_timeline_combine[s][0], t);
    atomicMax(&g_timeline_combine[s][1], t);
  }
}
#else
__device__ __forceinline__ void stamp(Stamp) {}
__device__ __forceinline__ void stamp_combine(int) {}
#endif

}  // namespace kdtree
