// The score warps: S = Q K^T, the online softmax, and P handed to the output warps.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cta.cuh"
#include "fp8.cuh"
#include "ptx.cuh"
#include "tile_config.cuh"
#include "timeline.cuh"

namespace kdtree {

// Score warp `sw`: rows sw*16.., every key of each tile. Row max / sum stay in registers (the warp owns
// whole rows); P (bf16, as SGLang's Triton kernel feeds its P.V product) and the rescale factor go to
// shared memory for the output warps.
template <class C, Kv KV, bool MMA8>
__device__ __forceinline__ void score_warp(const Params& p, const Work& w, const Smem<C>& sm, int sw, int lane) {
  // The warp's 16 Q rows, consecutive lanes on consecutive chunks of a row; rows past this request's rows
  // are zero-filled. One row address per row, stepped from the first: a division by H per chunk made Q
  // land ~4 us after the first key tile at launch.
  // Only k-steps Q_FROM.. (Q_ROW_BYTES of each row) go to shared memory.
  int tok = (w.m0 + sw * 16) / p.H, head = (w.m0 + sw * 16) % p.H;
#pragma unroll 4  // fully unrolled, it moved the output warps' loop allocation
  for (int i = 0; i < 16; ++i) {
    const int r = sw * 16 + i;
    const bool ok = w.m0 + r < w.rows;
    const __nv_bfloat16* row = ok ? p.q + (w.qs + tok) * p.q_st + head * p.q_sh + C::Q_FROM * 16 : p.q;
#pragma unroll
    for (int c = lane; c < C::Q_ROW_BYTES / 16; c += 32)
      cp_async16(sm.q + r * C::Q_ROW_BYTES + swz_in_row(c, r), ok ? row + c * 8 : p.q, ok);
    if (++head == p.H) head = 0, ++tok;
  }
  cp_async_commit();
  uint32_t qf[C::QREG > 0 && !MMA8 ? C::QREG : 1][4];
  if constexpr (C::Q_DIRECT && !MMA8) {  // the register part of Q as mma A fragments, straight from global memory
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = w.m0 + sw * 16 + (lane >> 2) + 8 * h;
      const bool ok = gr < w.rows;
      const __nv_bfloat16* base = p.q + (ok ? (w.qs + gr / p.H) * p.q_st + (gr % p.H) * p.q_sh : 0);
      if constexpr (is_fp8(KV)) {  // f16, de-interleaved: slots 2q, 2q+1 are dims 4q, 4q+2; slots 8+2q, 9+2q 4q+1, 4q+3
        const uint2* row = reinterpret_cast<const uint2*>(base) + (lane & 3);
#pragma unroll
        for (int ks = 0; ks < C::QREG; ++ks) {
          const uint2 v = ok ? __ldg(row + ks * 4) : make_uint2(0u, 0u);
          uint4 even, odd;  // only .x of each is used: the lane's four dims
          bf16x16_to_f16_deinterleaved(make_uint4(v.x, v.y, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), even, odd);
          qf[ks][h] = even.x;
          qf[ks][2 + h] = odd.x;
        }
      } else {
        const uint32_t* row = reinterpret_cast<const uint32_t*>(base) + (lane & 3);
#pragma unroll
        for (int ks = 0; ks < C::QREG; ++ks) {
          qf[ks][h] = ok ? __ldg(row + ks * 8) : 0u;
          qf[ks][2 + h] = ok ? __ldg(row + ks * 8 + 4) : 0u;
        }
      }
    }
  }
  // MMA8: this lane's rows of Q (g = lane / 4 and g + 8 of the warp's 16) in global memory, and Q as the pool's fp8
  // type, every 32-dim k-step an m16n8k32 A fragment in registers (72 of them).
  const __nv_bfloat16* q_g[2];
  bool q_ok[2];
  uint32_t q8[MMA8 ? QK / 32 : 1][4];
  if constexpr (MMA8) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = w.m0 + sw * 16 + (lane >> 2) + 8 * h;
      q_ok[h] = gr < w.rows;
      q_g[h] = p.q + (q_ok[h] ? (w.qs + gr / p.H) * p.q_st + (gr % p.H) * p.q_sh : 0);
    }
    auto fp8x4 = [](uint2 v) {  // four bf16 (dims d..d+3) as fp8, exactly as a float's cast
      return f32x4_to_fp8x4<KV == kKvE4m3>(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u),
                                           __uint_as_float(v.y << 16), __uint_as_float(v.y & 0xffff0000u));
    };
#pragma unroll
    for (int ks = 0; ks < QK / 32; ++ks)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint2* row = reinterpret_cast<const uint2*>(q_g[h] + ks * 32) + (lane & 3);  // dims 32ks + 4t..
        q8[ks][h] = fp8x4(q_ok[h] ? __ldg(row) : make_uint2(0u, 0u));
        q8[ks][2 + h] = fp8x4(q_ok[h] ? __ldg(row + 4) : make_uint2(0u, 0u));  // dims 32ks + 16 + 4t..
      }
  }
  // MMA8 with Q_DIRECT: a draft tile's f16 k-step below Q_FROM (not in shared memory), from global memory.
  auto q_f16_global = [&](int ks, uint32_t (&a)[4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2* row = reinterpret_cast<const uint2*>(q_g[h]) + (lane & 3);
      const uint2 v = q_ok[h] ? __ldg(row + ks * 4) : make_uint2(0u, 0u);
      uint4 even, odd;
      bf16x16_to_f16_deinterleaved(make_uint4(v.x, v.y, 0u, 0u), make_uint4(0u, 0u, 0u, 0u), even, odd);
      a[h] = even.x;
      a[2 + h] = odd.x;
    }
  };
  cp_async_wait<0>();
  __syncwarp();
  if constexpr (is_fp8(KV)) {  // the warp's Q rows in shared memory as f16, each 16-dim block de-interleaved
    constexpr int BLOCKS = C::Q_ROW_BYTES / 32;
#pragma unroll 2
    for (int i = lane; i < 16 * BLOCKS; i += 32) {
      const int r = sw * 16 + i / BLOCKS, blk = i % BLOCKS;
      uint4* c0 = reinterpret_cast<uint4*>(sm.q + r * C::Q_ROW_BYTES + swz_in_row(2 * blk, r));
      uint4* c1 = reinterpret_cast<uint4*>(sm.q + r * C::Q_ROW_BYTES + swz_in_row(2 * blk + 1, r));
      uint4 even, odd;
      bf16x16_to_f16_deinterleaved(*c0, *c1, even, odd);
      *c0 = even;
      *c1 = odd;
    }
    __syncwarp();
  }
  if (sw == 0 && lane == 0) stamp(kQLanded);
  // Lane l reads row sw*16 + (l & 15), chunk 2*ks + (l >> 4) of Q. With 2*ks even, the chunk's low bit
  // (l >> 4) goes into the xor key q_x with the row (the same holds for the K and V addresses below).
  const uint32_t q_row = smem_u32(sm.q + (sw * 16 + (lane & 15)) * C::Q_ROW_BYTES);
  const int q_x = ((lane >> 4) ^ lane) & 7;
  auto q_at = [&](int ks) { return q_row + swz_in_row(2 * (ks - C::Q_FROM), q_x); };
  if constexpr (!C::Q_DIRECT && !MMA8) {
#pragma unroll
    for (int ks = 0; ks < C::QREG; ++ks) ldmatrix_x4(qf[ks], q_at(ks));
  }

  const int r0 = sw * 16 + (lane >> 2);
  int qi[2];
  bool qrow_ok[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = w.m0 + r0 + 8 * h;
    qrow_ok[h] = gr < w.rows;
    qi[h] = qrow_ok[h] ? gr / p.H : 0;
  }
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};

  // S = Q K^T of tile t (16 rows x BN keys, raw scores) in two accumulator sets (even / odd k-steps:
  // half the mma dependency chain); straight-line code, so it can interleave with other work.
  auto q_frag = [&](int ks, uint32_t (&a)[4]) {
    if constexpr (MMA8) {  // a draft tile's: Q's f16 k-steps are in shared memory from Q_FROM on
      if (ks >= C::Q_FROM) ldmatrix_x4(a, q_at(ks));
      else q_f16_global(ks, a);
    } else if (ks < C::QREG) {
#pragma unroll
      for (int e = 0; e < 4; ++e) a[e] = qf[ks < C::QREG ? ks : 0][e];
    } else {
      ldmatrix_x4(a, q_at(ks));
    }
  };
  auto scores = [&](int t, float (&sc)[C::NB_QK][4], float (&s2)[C::NB_QK][4], auto&& side) {
    const int stage = t % C::STAGES;
    bar_sync(C::BAR_K + stage, C::NT);
    const uint8_t* Kt = sm.k + stage * C::BN * ROW_BYTES;
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[j][e] = s2[j][e] = 0.f;
    if constexpr (MMA8) {
      if (!w.draft_tile(t)) {  // fp8 x fp8, addressed as the bf16 rows below (a k-step is 32 fp8 dims, two chunks):
        // the x4 gives b0, b1 of n-tiles nb and nb + 1
        const uint32_t k_row = smem_u32(Kt + (((lane >> 4) << 3) + (lane & 7)) * ROW_BYTES);
        const int k_x = (((lane >> 3) & 1) ^ lane) & 7;
#pragma unroll
        for (int ks = 0; ks < QK / 32; ++ks) {
          side(ks);
          float(&acc)[C::NB_QK][4] = (ks & 1) ? s2 : sc;
#pragma unroll
          for (int nb = 0; nb < C::NB_QK; nb += 2) {
            uint32_t bb[4];
            ldmatrix_x4(bb, k_row + nb * 8 * ROW_BYTES + swz_in_row(2 * ks, k_x));
            mma_fp8<KV == kKvE4m3, KV == kKvE4m3>(acc[nb], q8[ks], bb[0], bb[1]);
            mma_fp8<KV == kKvE4m3, KV == kKvE4m3>(acc[nb + 1], q8[ks], bb[2], bb[3]);
          }
        }
        return;
      }
    }
    // bf16 key rows, or an fp8 pool's tile as f16, de-interleaved (a draft tile, or a widened prefix tile).
    // Lane l reads key row nb*8 + ((l >> 4) << 3) + (l & 7), chunk 2*ks + ((l >> 3) & 1).
    const uint32_t k_row = smem_u32(Kt + (((lane >> 4) << 3) + (lane & 7)) * ROW_BYTES);
    const int k_x = (((lane >> 3) & 1) ^ lane) & 7;
#pragma unroll
    for (int ks = 0; ks < QK / 16; ++ks) {
      side(ks);
      uint32_t a[4];
      q_frag(ks, a);
      float(&acc)[C::NB_QK][4] = (ks & 1) ? s2 : sc;
#pragma unroll
      for (int nb = 0; nb < C::NB_QK; nb += 2) {
        uint32_t bb[4];
        ldmatrix_x4(bb, k_row + nb * 8 * ROW_BYTES + swz_in_row(2 * ks, k_x));
        if constexpr (is_fp8(KV)) {
          mma_f16(acc[nb], a, bb[0], bb[1]);
          mma_f16(acc[nb + 1], a, bb[2], bb[3]);
        } else {
          mma_bf16(acc[nb], a, bb[0], bb[1]);
          mma_bf16(acc[nb + 1], a, bb[2], bb[3]);
        }
      }
    }
  };

  // Sum the two sets; mask draft keys (tree or causal) and keys past the range. An fp8 pool's prefix keys were
  // widened without their scale: it goes into the softmax's scale of their tiles (s_log2, in fp32), and those tiles
  // hold no draft key (past P they are masked).
  float s_log2 = p.scale_log2;  // the tile's: set by mask, read by its softmax
  auto mask = [&](int t, float (&sc)[C::NB_QK][4], const float (&s2)[C::NB_QK][4]) {
    const int kt0 = w.template start<is_fp8(KV)>(t, C::BN);
    const bool edge = kt0 + C::BN > w.P;
    bool prefix8 = false;
    if constexpr (is_fp8(KV)) prefix8 = !w.draft_tile(t);
    s_log2 = prefix8 ? p.scale_log2 * p.k_scale : p.scale_log2;
#pragma unroll
    for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = sc[j][e] + s2[j][e];
        if (edge) {
          const int h = e >> 1;
          const int kp = kt0 + j * 8 + 2 * (lane & 3) + (e & 1);
          bool vis = kp < w.P;
          if (!vis && kp < w.k_hi && !prefix8) {
            if (!qrow_ok[h]) vis = true;
            else if (p.mask != nullptr) vis = p.mask[w.mbase + static_cast<int64_t>(qi[h]) * w.L + kp] != 0;
            else vis = kp - w.P <= qi[h];
          }
          if (!vis) v = -INFINITY;
        }
        sc[j][e] = v;
      }
  };

  // Online softmax of one tile's scores, in place (-> unnormalised P), cut into steps so that they can be
  // spread over the next tile's k-steps: each step needs only results of the one before it, whose
  // latency (shuffles, exp2) the mma of the k-step between them covers. The max is taken on raw scores
  // and the scale (> 0, as k_scale: checked at launch) folded into the exponent: exp2(s * scale - m * scale).
  constexpr int SOFTMAX_STEPS = 5 + C::NB_QK;
  float tm[2], tx[2], m_use[2];
  auto softmax_step = [&](int step, float (&sc)[C::NB_QK][4], float (&alpha)[2]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (step == 0) {  // row max of the tile, pairwise
        float mx[C::NB_QK];
#pragma unroll
        for (int j = 0; j < C::NB_QK; ++j) mx[j] = fmaxf(sc[j][2 * h], sc[j][2 * h + 1]);
#pragma unroll
        for (int d = 1; d < C::NB_QK; d *= 2)
#pragma unroll
          for (int j = 0; j + d < C::NB_QK; j += 2 * d) mx[j] = fmaxf(mx[j], mx[j + d]);
        tm[h] = mx[0] * s_log2;
      } else if (step == 1) {  // across the four lanes of a row
        tx[h] = __shfl_xor_sync(0xffffffffu, tm[h], 1);
      } else if (step == 2) {
        tm[h] = fmaxf(tm[h], tx[h]);
        tx[h] = __shfl_xor_sync(0xffffffffu, tm[h], 2);
      } else if (step == 3) {
        // The exponent's reference m_run moves only when a tile's max passes it by more than RESCALE_SLACK
        // (log2 units), as in FlashAttention-4: P stays <= 2^SLACK (bf16 keeps its relative precision at any
        // scale; l and O are fp32) and the output warps' rescale is skipped on almost every tile.
        const float m_tile = fmaxf(tm[h], tx[h]);
        const bool move = m_tile > m_run[h] + RESCALE_SLACK;  // true at the first visible key: m_run is -inf
        alpha[h] = move ? exp2f(m_run[h] - m_tile) : 1.f;
        if (move) m_run[h] = m_tile;
        m_use[h] = m_run[h] == -INFINITY ? 0.f : m_run[h];  // no visible key so far: keep zeros, no NaN
      } else if (step < 4 + C::NB_QK) {
        const int j = step - 4;
        sc[j][2 * h] = exp2f(fmaf(sc[j][2 * h], s_log2, -m_use[h]));
        sc[j][2 * h + 1] = exp2f(fmaf(sc[j][2 * h + 1], s_log2, -m_use[h]));
      } else if (step == 4 + C::NB_QK) {
        float sum[C::NB_QK];
#pragma unroll
        for (int j = 0; j < C::NB_QK; ++j) sum[j] = sc[j][2 * h] + sc[j][2 * h + 1];
#pragma unroll
        for (int d = 1; d < C::NB_QK; d *= 2)
#pragma unroll
          for (int j = 0; j + d < C::NB_QK; j += 2 * d) sum[j] += sum[j + d];
        l_run[h] = l_run[h] * alpha[h] + sum[0];
      }
    }
  };

  // P (bf16; f16 for an fp8 pool, e4m3 in an MMA8 prefix tile) and the rescale factor of tile t into P buffer t & 1
  // for the output warps. An fp8 pool's value scale goes onto O once, after its prefix tiles: in the rescale factor
  // of the first draft tile (or, with none, in the epilogue's normalisation), never into P.
  auto publish = [&](int t, const float (&pr)[C::NB_QK][4], const float (&alpha)[2]) {
    const int buf = t & 1;
    if (t >= 2) bar_sync(C::BAR_P_FREE + buf, C::NT);  // the output warps are done with tile t-2's P
    uint8_t* Pt = sm.p + buf * C::BM * C::P_ROW_BYTES;
    bool fp8_p = false;
    if constexpr (MMA8) fp8_p = !w.draft_tile(t);
    if (fp8_p) {
      // Slot 16m + 4q + i of a row = key 16m + {2q, 2q + 1, 8 + 2q, 9 + 2q}[i]: n-tiles 2m and 2m + 1 of this lane.
#pragma unroll
      for (int m = 0; m < C::NB_QK / 2; ++m) {
        const int at = 16 * m + 4 * (lane & 3);
        *reinterpret_cast<uint32_t*>(Pt + r0 * C::P_ROW_BYTES + at) =
            f32x4_to_fp8x4<true>(pr[2 * m][0], pr[2 * m][1], pr[2 * m + 1][0], pr[2 * m + 1][1]);
        *reinterpret_cast<uint32_t*>(Pt + (r0 + 8) * C::P_ROW_BYTES + at) =
            f32x4_to_fp8x4<true>(pr[2 * m][2], pr[2 * m][3], pr[2 * m + 1][2], pr[2 * m + 1][3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < C::NB_QK; ++j) {
        const int col = j * 8 + 2 * (lane & 3);
        if constexpr (is_fp8(KV)) {  // f16 P for the f16 mma (<= 2^RESCALE_SLACK)
          *reinterpret_cast<__half2*>(Pt + r0 * C::P_ROW_BYTES + col * 2) = __floats2half2_rn(pr[j][0], pr[j][1]);
          *reinterpret_cast<__half2*>(Pt + (r0 + 8) * C::P_ROW_BYTES + col * 2) =
              __floats2half2_rn(pr[j][2], pr[j][3]);
        } else {
          *reinterpret_cast<__nv_bfloat162*>(Pt + r0 * C::P_ROW_BYTES + col * 2) =
              __floats2bfloat162_rn(pr[j][0], pr[j][1]);
          *reinterpret_cast<__nv_bfloat162*>(Pt + (r0 + 8) * C::P_ROW_BYTES + col * 2) =
              __floats2bfloat162_rn(pr[j][2], pr[j][3]);
        }
      }
    }
    if ((lane & 3) == 0) {
      float f = 1.f;
      if constexpr (is_fp8(KV)) f = t == w.np && t > 0 ? p.v_scale : 1.f;
      sm.alpha[buf * C::BM + r0] = alpha[0] * f;
      sm.alpha[buf * C::BM + r0 + 8] = alpha[1] * f;
    }
    bar_arrive(C::BAR_P_READY + buf, C::NT);
    if (t == 0 && r0 == 0 && lane == 0) stamp(kFirstP);
  };

  // PIPELINE: software-pipelined by one tile, tile t's softmax steps placed between the k-steps of tile
  // t+1's mma (which do not depend on them), so the warp is not idle through the softmax's dependency
  // chains. Otherwise tile by tile.
  constexpr int SOFTMAX_SPACING = 2;  // a softmax step every second k-step
  static_assert(SOFTMAX_STEPS * SOFTMAX_SPACING <= QK / 16, "softmax steps fit in the k-steps");
  static_assert(!(C::PIPELINE && MMA8) || (SOFTMAX_STEPS - 1) * SOFTMAX_SPACING < QK / 32,
                "softmax steps fit in an MMA8 prefix tile's 32-dim k-steps");
  float cur[C::NB_QK][4], nxt[C::NB_QK][4], nxt2[C::NB_QK][4], alpha[2];
  auto no_side_work = [](int) {};
  auto whole_softmax = [&] {
#pragma unroll
    for (int step = 0; step < SOFTMAX_STEPS; ++step) softmax_step(step, cur, alpha);
  };
  if constexpr (C::PIPELINE) {
    scores(0, cur, nxt2, no_side_work);
    mask(0, cur, nxt2);
    for (int t = 0; t + 1 < w.ntiles; ++t) {
      scores(t + 1, nxt, nxt2, [&](int ks) {
        if (ks % SOFTMAX_SPACING == 0 && ks / SOFTMAX_SPACING < SOFTMAX_STEPS) softmax_step(ks / SOFTMAX_SPACING, cur, alpha);
      });
      publish(t, cur, alpha);
      mask(t + 1, nxt, nxt2);
#pragma unroll
      for (int j = 0; j < C::NB_QK; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) cur[j][e] = nxt[j][e];
    }
    whole_softmax();
    publish(w.ntiles - 1, cur, alpha);
  } else {
    for (int t = 0; t < w.ntiles; ++t) {
      scores(t, cur, nxt2, no_side_work);
      mask(t, cur, nxt2);
      whole_softmax();
      publish(t, cur, alpha);
    }
  }
  // Take the last (up to two) P-free arrivals so every named barrier ends balanced.
  for (int t = max(w.ntiles, 2); t < w.ntiles + 2; ++t) bar_sync(C::BAR_P_FREE + (t & 1), C::NT);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  if ((lane & 3) == 0) {
    sm.l_fin[r0] = l_run[0];
    sm.l_fin[r0 + 8] = l_run[1];
    sm.m_fin[r0] = m_run[0];
    sm.m_fin[r0 + 8] = m_run[1];
  }
}

}  // namespace kdtree
