// The output warps: the key tiles' loads and O = O * alpha + P V.
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

// Output warp `ow`: loads its share of every key tile (its own value dims of each key row, so no other
// output warp reads what it overwrites, plus an even share of the rope dims), then O = O * alpha + P V
// for all BM rows x its DV_W dims.
template <class C, Kv KV, bool MMA8>
__device__ __forceinline__ void output_warp(const Params& p, const Work& w, const Smem<C>& sm, int ow, int lane,
                                            float (&o)[C::RB][C::NB_PV][4]) {
  // Lane k reads the pool slot of key row k of a tile (a tile ahead); the copies themselves go out in
  // 16-byte chunks with consecutive lanes on consecutive chunks of a row, so each request is whole lines.
  const int key = lane % C::BN;
  auto slot_of = [&](int t) -> int {  // a pool holds fewer than 2^31 rows (that would be 2.4 TB)
    const int kp = w.template start<is_fp8(KV)>(t, C::BN) + key;
    return kp < w.P && kp < w.k_hi ? static_cast<int>(load_idx(p.kv_indices, p.kvi_t, w.kv0 + kp)) : 0;
  };
  // An fp8 pool's tiles. Lane `idx` of copy i takes the 16-dim block idx % (CW / 2) of the warp's own dims of row
  // idx / (CW / 2), then its share of the rope blocks: the same rows and dims as its bf16 copies, so every 128-byte
  // group of a 16-bit stage has one owning warp. A block is the f16 chunk pair (c, c + 1) in the key loops, which
  // read it de-interleaved (its even dims, then its odd dims), and comes from
  // - a draft tile: k_ext's bf16 chunks c, c + 1, copied as they are, then rewritten in place (convert_tile);
  // - a prefix tile of the widen path: the pool's fp8 chunk c / 2, landed in the slot of chunk c + 1 and widened in
  //   place (convert_tile);
  // - a prefix tile of the mma path: the pool's fp8 chunk c / 2 at chunk slot c / 2 (the first 640 bytes of the
  //   row), read as fp8 by the key loops.
  // The lane that copies a block rewrites it: cp.async's wait covers only the copies of the thread that waits.
  constexpr int CW8 = C::CW / 2;  // fp8 chunks of a key row a warp owns
  constexpr int LAT_PAIRS = C::BN * C::CW / 2 / 32, ROPE_PAIRS = C::ROPE_PER_WARP / 2;
  static_assert(!is_fp8(KV) || (C::CW % 2 == 0 && (C::BN * C::CW / 2) % 32 == 0 && ROPE_PAIRS <= 32),
                "fp8 pool blocks spread evenly over the lanes");
  auto pair_of = [](int lane, int ow, int i, int& r, int& c, bool& mine) {
    if (i < LAT_PAIRS) {
      const int idx = lane + 32 * i;
      r = idx / (C::CW / 2), c = ow * C::CW + 2 * (idx % (C::CW / 2)), mine = true;
    } else {
      const int g = ow * ROPE_PAIRS + lane;
      r = g / (ROPE_CHUNKS / 2), c = DV / 8 + 2 * (g % (ROPE_CHUNKS / 2)), mine = lane < ROPE_PAIRS;
    }
  };
  auto pair_at = [&](int i, int& r, int& c, bool& mine) { pair_of(lane, ow, i, r, c, mine); };
  auto load_fp8_pool = [&](int t, int slot) {
    const int k0 = w.template start<is_fp8(KV)>(t, C::BN);
    uint8_t* stage = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
    if (w.draft_tile(t)) {
#pragma unroll
      for (int i = 0; i < LAT_PAIRS + 1; ++i) {
        int r, c;
        bool mine;
        pair_at(i, r, c, mine);
        const int kp = k0 + r;
        const bool ok = kp < w.k_hi;  // past the range: zero-filled, then masked
        const __nv_bfloat16* src = ok ? p.k_ext + (w.qs + kp - w.P) * p.k_ext_st + c * 8 : p.k_ext;
        if (mine) {
          cp_async16(stage + swz(r, c), src, ok);
          cp_async16(stage + swz(r, c + 1), ok ? src + 8 : src, ok);
        }
      }
      return;
    }
    const uint8_t* pool = reinterpret_cast<const uint8_t*>(p.k_buf);
    const uint32_t st = static_cast<uint32_t>(p.k_buf_st);  // bytes (an fp8 row), < 2^31, checked at launch
    // Every row a pool slot (all but the last prefix tile): the copies without a source size. With one (the
    // zero-filling form) each lane's 16 bytes went as a request of its own: 2x the L2 sectors and 8x the
    // shared-memory wavefronts of the copy (Nsight Compute, H200). The mma path keeps the one form: the second
    // moved its registers past the spill allowance on sm_90 and into spills on sm_120.
    const bool full = !MMA8 && k0 + C::BN <= w.P;
#pragma unroll
    for (int i = 0; i < LAT_PAIRS + 1; ++i) {
      int r, c;
      bool mine;
      pair_at(i, r, c, mine);
      const uint32_t sl = static_cast<uint32_t>(__shfl_sync(0xffffffffu, slot, r));  // every lane shuffles
      uint8_t* dst = stage + swz(r, MMA8 ? c / 2 : c + 1);
      if (full) {
        if (mine) cp_async16(dst, pool + static_cast<uint64_t>(sl) * st + c * 8, true);
        continue;
      }
      const bool ok = k0 + r < w.P;  // the last prefix tile past P: zero-filled (0 in fp8 and f16), then masked
      if (mine) cp_async16(dst, ok ? pool + static_cast<uint64_t>(sl) * st + c * 8 : pool, ok);
    }
  };
  // After a tile has landed (this lane's copies): its blocks as f16, de-interleaved. Block (r, c) is the f16 chunk
  // pair at swz(r, c) and swz(r, c) ^ 16 (c even); a lane's latent blocks are 32 / CW8 rows apart (whole xor
  // periods: the same place in their 128-byte groups), so one offset and a stride address them.
  static_assert(32 / CW8 % 8 == 0, "a lane's latent blocks keep their place in the swizzle");
  auto convert_tile = [&](int t) {
    if constexpr (is_fp8(KV)) {
      const bool draft = w.draft_tile(t);
      if (MMA8 && !draft) return;  // read as fp8
      uint8_t* stage = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
      auto block = [&](int at) {
        uint4* lo = reinterpret_cast<uint4*>(stage + at);
        uint4* hi = reinterpret_cast<uint4*>(stage + (at ^ 16));
        uint4 even, odd;
        if (!MMA8 && !draft) {  // the pool's fp8 block, landed in the second chunk
          const uint4 v = *hi;
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.x, even.x, odd.x);
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.y, even.y, odd.y);
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.z, even.z, odd.z);
          fp8x4_to_f16x2x2<KV == kKvE4m3>(v.w, even.w, odd.w);
        } else {  // k_ext's bf16 chunks
          bf16x16_to_f16_deinterleaved(*lo, *hi, even, odd);
        }
        *lo = even;
        *hi = odd;
      };
      // The offsets from the lane and warp, once a tile: held through the key loop, they cost spills.
      int ln = lane, o = ow, r, c;
      asm volatile("" : "+r"(ln), "+r"(o));
      bool mine;
      pair_of(ln, o, 0, r, c, mine);
      const int lat = swz(r, c);
#pragma unroll 1
      for (int i = 0; i < LAT_PAIRS; ++i) block(lat + i * (32 / CW8) * ROW_BYTES);
      pair_of(ln, o, LAT_PAIRS, r, c, mine);
      if (mine) block(swz(r, c));
    }
  };
  auto load_tile = [&](int t, int slot) {
    if constexpr (is_fp8(KV)) {
      load_fp8_pool(t, slot);
      return;
    }
    const int k0 = w.k_lo + t * C::BN;
    uint8_t* stage = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
    // Lane `idx` of copy i takes chunk idx % CW of key row idx / CW (its own dims), then the rope chunks.
    // The mapping is spelled out in both paths below: one shared helper moved the output warps' register
    // allocation (6 more loop instructions and 2 more spill loads per tile, bench/tuning/sass_loops.py).
    if (k0 + C::BN <= min(w.P, w.k_hi)) {
      // Every key of the tile is a pool slot (all but a split's last tile): straight-line code, one
      // shuffle, one address multiply and one copy per chunk.
      const uint32_t st = static_cast<uint32_t>(p.k_buf_st);  // < 2^31, checked at launch
#pragma unroll
      for (int i = 0; i < C::LAT_PER_LANE + C::ROPE_PER_LANE; ++i) {
        int r, col;
        bool mine = true;
        if (i < C::LAT_PER_LANE) {
          const int idx = lane + 32 * i;
          r = idx / C::CW, col = ow * C::CW + idx % C::CW;
        } else {
          const int k = lane + 32 * (i - C::LAT_PER_LANE), g = ow * C::ROPE_PER_WARP + k % C::ROPE_PER_WARP;
          r = g / ROPE_CHUNKS, col = DV / 8 + g % ROPE_CHUNKS;
          mine = C::ROPE_PER_WARP % 32 == 0 || k < C::ROPE_PER_WARP;
        }
        // Every lane takes part in the shuffle; only the copy is predicated.
        const uint32_t sl = static_cast<uint32_t>(__shfl_sync(0xffffffffu, slot, r));
        if (mine) cp_async16(stage + swz(r, col), p.k_buf + static_cast<uint64_t>(sl) * st + col * 8, true);
      }
      return;
    }
    auto copy = [&](int r, int col, bool mine) {  // chunk `col` of key row r
      const int64_t sl = __shfl_sync(0xffffffffu, slot, r);
      const int kp = k0 + r;
      const bool ok = kp < w.k_hi;  // past the range: zero-filled, then masked
      const __nv_bfloat16* src = p.k_buf;
      if (ok) src = kp < w.P ? p.k_buf + sl * p.k_buf_st : p.k_ext + (w.qs + kp - w.P) * p.k_ext_st;
      if (mine) cp_async16(stage + swz(r, col), ok ? src + col * 8 : src, ok);
    };
#pragma unroll
    for (int i = 0; i < C::LAT_PER_LANE; ++i) {
      const int idx = lane + 32 * i;
      copy(idx / C::CW, ow * C::CW + idx % C::CW, true);
    }
#pragma unroll
    for (int i = 0; i < C::ROPE_PER_LANE; ++i) {
      const int k = lane + 32 * i, g = ow * C::ROPE_PER_WARP + k % C::ROPE_PER_WARP;
      copy(g / ROPE_CHUNKS, DV / 8 + g % ROPE_CHUNKS, C::ROPE_PER_WARP % 32 == 0 || k < C::ROPE_PER_WARP);
    }
  };

  // Tile 0 alone first: at launch every CTA also loads its Q rows, and with the next tiles in the same
  // queue tile 0 and Q landed ~2 us later. The next tiles are requested once tile 0 is in, a tile's mma
  // ahead of their use.
  load_tile(0, slot_of(0));  // ntiles >= 1
  cp_async_commit();
  cp_async_wait<0>();
  convert_tile(0);
  if (ow == 0 && lane == 0) stamp(kTile0Landed);
  bar_arrive(C::BAR_K, C::NT);  // tile 0 (this warp's part of it) landed
#pragma unroll
  for (int s = 1; s < C::STAGES; ++s) {
    if (s < w.ntiles) load_tile(s, slot_of(s));
    cp_async_commit();
  }
  int next_slot = slot_of(C::STAGES);

  const int d0 = ow * C::DV_W;
  for (int t = 0; t < w.ntiles; ++t) {
    if (t + 1 < w.ntiles) {
      cp_async_wait<C::STAGES - 2>();
      convert_tile(t + 1);
      bar_arrive(C::BAR_K + (t + 1) % C::STAGES, C::NT);
    }
    const int buf = t & 1;
    bar_sync(C::BAR_P_READY + buf, C::NT);  // P of tile t written; the score warps are done with its keys
    uint8_t* Kt = sm.k + (t % C::STAGES) * C::BN * ROW_BYTES;
    const int kt0 = w.template start<is_fp8(KV)>(t, C::BN);

    // Draft values from a separate tensor replace this warp's dims of the staged draft rows (an fp8 pool's: as
    // f16, de-interleaved, as convert_draft wrote the keys; only in its draft tiles: a prefix tile past P holds
    // zero-filled fp8 rows, which f16 bytes would turn into NaN).
    if (p.v_ext != nullptr && (is_fp8(KV) ? w.draft_tile(t) : kt0 + C::BN > w.P)) {
      const int d_lo = max(kt0, w.P), d_hi = min(kt0 + C::BN, w.k_hi);
      if constexpr (is_fp8(KV)) {
        for (int c = lane; c < (d_hi - d_lo) * (C::CW / 2); c += 32) {
          const int kp = d_lo + c / (C::CW / 2), col = ow * C::CW + 2 * (c % (C::CW / 2));
          const uint4* src = reinterpret_cast<const uint4*>(p.v_ext + (w.qs + kp - w.P) * p.v_ext_st + col * 8);
          uint4 even, odd;
          bf16x16_to_f16_deinterleaved(src[0], src[1], even, odd);
          *reinterpret_cast<uint4*>(Kt + swz(kp - kt0, col)) = even;
          *reinterpret_cast<uint4*>(Kt + swz(kp - kt0, col + 1)) = odd;
        }
      } else {
        for (int c = lane; c < (d_hi - d_lo) * C::CW; c += 32) {
          const int kp = d_lo + c / C::CW, col = ow * C::CW + c % C::CW;
          const uint4 v = *reinterpret_cast<const uint4*>(p.v_ext + (w.qs + kp - w.P) * p.v_ext_st + col * 8);
          *reinterpret_cast<uint4*>(Kt + swz(kp - kt0, col)) = v;
        }
      }
      __syncwarp();
    }

    const float* alpha = sm.alpha + buf * C::BM;
#pragma unroll
    for (int rb = 0; rb < C::RB; ++rb) {
      const float a0 = alpha[rb * 16 + (lane >> 2)], a1 = alpha[rb * 16 + (lane >> 2) + 8];
      if (a0 != 1.f || a1 != 1.f) {  // the running max rarely moves once a few tiles are in
#pragma unroll
        for (int j = 0; j < C::NB_PV; ++j) {
          o[rb][j][0] *= a0; o[rb][j][1] *= a0; o[rb][j][2] *= a1; o[rb][j][3] *= a1;
        }
      }
    }
    const uint8_t* Pt = sm.p + buf * C::BM * C::P_ROW_BYTES;
    bool fp8_mma = false;
    if constexpr (MMA8) fp8_mma = !w.draft_tile(t);
    if (fp8_mma) {
      // One m16n8k32 over the tile's keys (16-key tiles: slots 16..31 zero). A: the e4m3 P rows as the score warps
      // stored them (in slot order). B: per fp8 chunk i (16 dims) of this warp's own, ldmatrix.trans of 8 keys
      // each (lane l = key l), whose bytes 0, 2 of two key groups are the even dims' slots and bytes 1, 3 the
      // odd dims': n-tiles 2i and 2i + 1, as the widen path lays them out.
      constexpr bool FULL = C::BN == 32;
      static_assert(C::BN == 32 || C::BN == 16, "an m16n8k32 over one or half a tile");
      uint32_t a[C::RB][4];
#pragma unroll
      for (int rb = 0; rb < C::RB; ++rb) {
        const uint32_t at = smem_u32(Pt + (rb * 16 + (lane & 15)) * C::P_ROW_BYTES + (lane >> 4) * 16);
        if constexpr (FULL) {
          ldmatrix_x4(a[rb], at);
        } else {
          uint32_t h[2];
          ldmatrix_x2(h, at);
          a[rb][0] = h[0], a[rb][1] = h[1], a[rb][2] = a[rb][3] = 0u;
        }
      }
      const int key = FULL ? lane : lane & 15;
      const uint32_t v8_row = smem_u32(Kt + key * ROW_BYTES);
#pragma unroll
      for (int i = 0; i < CW8; ++i) {
        uint32_t r[4] = {0u, 0u, 0u, 0u};
        if constexpr (FULL) {
          ldmatrix_x4_trans(r, v8_row + swz_in_row(d0 / 16 + i, key));
        } else {
          uint32_t h[2];
          ldmatrix_x2_trans(h, v8_row + swz_in_row(d0 / 16 + i, key));
          r[0] = h[0], r[1] = h[1];
        }
        const uint32_t e0 = prmt(r[0], r[1], 0x6420), e1 = prmt(r[2], r[3], 0x6420);
        const uint32_t o0 = prmt(r[0], r[1], 0x7531), o1 = prmt(r[2], r[3], 0x7531);
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb) {
          mma_fp8<true, KV == kKvE4m3>(o[rb][2 * i], a[rb], e0, e1);
          mma_fp8<true, KV == kKvE4m3>(o[rb][2 * i + 1], a[rb], o0, o1);
        }
      }
    } else {
#pragma unroll
      for (int kk = 0; kk < C::BN / 16; ++kk) {
        uint32_t a[C::RB][4];
#pragma unroll
        for (int rb = 0; rb < C::RB; ++rb)
          ldmatrix_x4(a[rb], smem_u32(Pt + (rb * 16 + (lane & 15)) * C::P_ROW_BYTES + kk * 32 + (lane >> 4) * 16));
        // Lane l reads key row kk*16 + ((l >> 3) & 1)*8 + (l & 7), chunk d0/8 + nb + (l >> 4) (d0/8 is a
        // multiple of 8, nb even).
        const uint32_t v_row = smem_u32(Kt + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * ROW_BYTES);
        const int v_x = ((lane >> 4) ^ lane) & 7;
#pragma unroll
        for (int nb = 0; nb < C::NB_PV; nb += 2) {
          const uint32_t v_addr = v_row + swz_in_row(d0 / 8 + nb, v_x);
          uint32_t bb[4];
          ldmatrix_x4_trans(bb, v_addr);
#pragma unroll
          for (int rb = 0; rb < C::RB; ++rb) {
            if constexpr (is_fp8(KV)) {
              mma_f16(o[rb][nb], a[rb], bb[0], bb[1]);
              mma_f16(o[rb][nb + 1], a[rb], bb[2], bb[3]);
            } else {
              mma_bf16(o[rb][nb], a[rb], bb[0], bb[1]);
              mma_bf16(o[rb][nb + 1], a[rb], bb[2], bb[3]);
            }
          }
        }
      }
    }
    __syncwarp();  // every lane is done reading this stage before this warp refills it
    bar_arrive(C::BAR_P_FREE + buf, C::NT);
    if constexpr (MMA8) {
      // A stage going from an fp8 prefix tile (this warp's dims: 64 bytes of a row) to a draft tile (f16: 128 bytes)
      // is refilled over other output warps' fp8 dims: all of them must be done with this tile's PV first. At most
      // STAGES times a CTA, the same on every output warp.
      if (!w.draft_tile(t) && t + C::STAGES < w.ntiles && w.draft_tile(t + C::STAGES))
        bar_sync(C::BAR_EPILOGUE, C::NO * 32);
    }
    if (t + C::STAGES < w.ntiles) load_tile(t + C::STAGES, next_slot);
    cp_async_commit();
    next_slot = slot_of(t + C::STAGES + 1);
  }
  cp_async_wait<0>();
}

}  // namespace kdtree
