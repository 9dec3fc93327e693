// The kernel's tile configurations: the row and shared-memory geometry every part shares, Cfg (a tile shape and
// its derived sizes and barriers), the tuning knobs, and a type per configuration of include/kdtree_tile_configs.h.
#pragma once
#include "kdtree_verify.h"

namespace kdtree {

constexpr int QK = KDTREE_QK_DIM;  // 512 latent + 64 rope
constexpr int DV = KDTREE_V_DIM;
// A 576-dim row of Q or of a key stage in shared memory: 1152 bytes, 128-byte aligned. Chunk c (16 bytes) of
// row r sits at position (c ^ r) & 7 of its 128-byte group: the 8 rows one ldmatrix reads land in 8 bank
// groups, and every copy writes whole aligned lines (padded rows made the gathers' shared-memory writes
// straddle lines: 2.75x the ideal wavefronts).
constexpr int ROW_BYTES = QK * 2;
// Byte offset of chunk c within a row whose xor key is x (the row index, or for an ldmatrix address the
// lane's row and chunk parity combined).
__device__ __forceinline__ int swz_in_row(int c, int x) { return ((c >> 3) << 7) + (((c ^ x) & 7) << 4); }
__device__ __forceinline__ int swz(int r, int c) { return r * ROW_BYTES + swz_in_row(c, r); }
constexpr int ROPE_CHUNKS = (QK - DV) * 2 / 16;  // 8
constexpr int MIN_KEYS_PER_SPLIT = 128;  // keys per split below which partial-result traffic outweighs parallelism
constexpr int MAX_SPLITS = 128;
// A request cut by q_live (DDTREE's auto budget) leaves the row tiles past its live rows idle; their CTAs take more
// splits of the live tiles instead (live_splits in cta.cuh), at most this many (the combine sums them in one group).
constexpr int MAX_LIVE_SPLITS = 64;
// The split rule's fixed cost of a CTA, as a fraction of one reading a whole prefix: measured on the H200
// (bench/tuning/split_sweep.py) ~12 us against 1860 at 32k keys, ~10 against 480 at 8k; 1/50 keeps the 8k end.
constexpr double SPLIT_CTA_COST = 0.02;
// At most this many waves of split CTAs (it bounds the workspace: MAX_SPLIT_WAVES x slots partial tiles).
constexpr long MAX_SPLIT_WAVES = 3;

// Warp-specialised CTA: NS score warps (16 rows each, all BN keys of a tile) compute S = Q K^T and the
// softmax and hand P to NO output warps (all BM rows, DV/NO value dims each), which accumulate O += P V
// and load the key tiles. The two roles work on different tiles at once (scores of tile t+1 while the
// output warps multiply tile t), so the tensor pipe is fed by one role while the other waits on memory.
template <int BM_, int BN_, int STAGES_, int NO_, int QREG_, bool PIPELINE_, bool Q_DIRECT_>
struct Cfg {
  static constexpr int BM = BM_;  // packed (token, head) rows per CTA
  static constexpr int BN = BN_;  // keys per pipeline stage
  static constexpr int STAGES = STAGES_;  // >= 3: one tile in QK, one in PV, one loading
  static constexpr int NS = BM / 16;  // score warps
  static constexpr int NO = NO_;  // output warps
  static constexpr int NT = (NS + NO) * 32;
  static constexpr int QREG = QREG_;  // k-steps of Q a score warp keeps in registers (the rest: ldmatrix)
  // Score warps overlap tile t's softmax with tile t+1's mma. 15-20% faster for v7-v11's compact (32 rows,
  // 6 warps at 232 registers), but 5-20% slower for wide and 16-27% for today's compact: at 168 registers
  // the third score tile leaves the scheduler no room. No configuration uses it now (a tuning knob).
  static constexpr bool PIPELINE = PIPELINE_;
  // Q_DIRECT: the QREG k-steps held in registers are loaded straight from global memory, and shared memory
  // holds only the k-steps read by ldmatrix (32 KB for 64 rows with QREG 20, instead of 72 KB): what lets
  // 64-row tiles fit sm_120's 99 KB.
  static constexpr bool Q_DIRECT = Q_DIRECT_;
  static constexpr int Q_FROM = Q_DIRECT ? QREG : 0;  // the first k-step of Q in shared memory
  static constexpr int Q_ROW_BYTES = (QK / 16 - Q_FROM) * 32;  // whole 128-byte groups (asserted below)
  static constexpr int RB = BM / 16;
  static constexpr int NB_QK = BN / 8;
  static constexpr int DV_W = DV / NO;  // value dims per output warp
  static constexpr int NB_PV = DV_W / 8;
  static constexpr int CW = DV_W / 8;  // latent 16-byte chunks per key row an output warp loads (its dims)
  static constexpr int LAT_PER_LANE = BN * CW / 32;
  static constexpr int ROPE_PER_WARP = BN * ROPE_CHUNKS / NO;
  static constexpr int ROPE_PER_LANE = (ROPE_PER_WARP + 31) / 32;  // with fewer than 32 a warp, lanes idle
  static constexpr int P_ROW_BYTES = BN * 2 + 16;
  static constexpr int SMEM_Q = BM * Q_ROW_BYTES;
  static constexpr int SMEM_K = STAGES * BN * ROW_BYTES;
  static constexpr int SMEM_P = 2 * BM * P_ROW_BYTES;  // double-buffered: P of tile t+1 while PV reads t
  static constexpr int SMEM_STATS = 4 * BM * 4 + 16;  // alpha x 2 buffers; final row sum and max; Epilogue
  static constexpr int SMEM = SMEM_Q + SMEM_K + SMEM_P + SMEM_STATS;
  // Named barriers (0 is __syncthreads): key tile landed (per stage), P ready / P free (per buffer).
  // A producer never arrives twice at one barrier before its consumers took the first arrival: K[s] is
  // re-armed for tile t+STAGES only after P ready(t), which follows the score warps' sync on K[s] for t;
  // P ready(buf) only after P free(buf) of two tiles back; P free(buf) only after P ready(buf) of its tile.
  // BAR_EPILOGUE: the output warps' partial rows are staged in shared memory.
  static constexpr int BAR_K = 1, BAR_P_READY = BAR_K + STAGES, BAR_P_FREE = BAR_P_READY + 2;
  static constexpr int BAR_EPILOGUE = BAR_P_FREE + 2;
  static_assert(BM % 16 == 0 && STAGES >= 3 && BAR_EPILOGUE < 16, "tile shape");
  // Staged partial rows (fp32, +8 floats per row: the eight rows of one fragment store hit distinct
  // banks) reuse Q and the key stages; the row statistics after them stay intact.
  static constexpr int STAGED_ROW = DV + 8;
  // When all BM rows do not fit, they are staged and stored in rounds of BM / STAGE_ROUNDS rows, and a
  // request split in two goes through the combine (a pair's merge reads the other CTA's rows all at once).
  static constexpr int STAGE_ROUNDS = BM * STAGED_ROW * 4 <= SMEM_Q + SMEM_K ? 1 : 2;
  static constexpr bool PAIR = STAGE_ROUNDS == 1;
  static_assert(BM / STAGE_ROUNDS * STAGED_ROW * 4 <= SMEM_Q + SMEM_K && RB % STAGE_ROUNDS == 0,
                "staged partial rows fit below P and the statistics");
  static_assert(32 % BN == 0 && BN % 16 == 0, "one pool slot per lane and tile");
  static_assert(DV_W % 64 == 0 && 32 % CW == 0 && (BN * CW) % 32 == 0, "output warp split (whole 128-byte groups)");
  static_assert(BN * ROPE_CHUNKS % NO == 0 && (ROPE_PER_WARP % 32 == 0 || ROPE_PER_WARP < 32),
                "rope chunks spread evenly");
  static_assert(QREG <= QK / 16 && (QK / 16 - Q_FROM) % 4 == 0, "Q k-steps; Q's shared rows in 128-byte groups");
};
#ifndef KDTREE_RESCALE_SLACK  // tuning knob: how far (log2 units) a row's max may pass its reference unrescaled
#define KDTREE_RESCALE_SLACK 8.f
#endif
constexpr float RESCALE_SLACK = KDTREE_RESCALE_SLACK;
// An fp8 pool's P (<= 2^RESCALE_SLACK) is stored in f16 (widen) or e4m3 (mma, at most 448).
static_assert(RESCALE_SLACK <= 8.f, "P must stay within e4m3's range");
#ifndef KDTREE_WIDE_QREG  // a tuning knob: Q k-steps held in registers by wide's score warps
#define KDTREE_WIDE_QREG 16
#endif
#ifndef KDTREE_COMPACT_QREG  // tuning knobs: compact's Q k-steps in registers (a multiple of 4), key stages
#define KDTREE_COMPACT_QREG 20
#endif
#ifndef KDTREE_COMPACT_STAGES
#define KDTREE_COMPACT_STAGES 3
#endif
#ifndef KDTREE_COMPACT_PIPELINE
#define KDTREE_COMPACT_PIPELINE false
#endif
// The tile configurations (Wide, Compact, ...), one type per row of include/kdtree_tile_configs.h, each held to the
// shared memory its GPUs allow per block.
#define KDTREE_TILE_CONFIG(NAME, ID, Type, BM, BN, STAGES, NO, QREG, PIPELINE, Q_DIRECT, SMEM_LIMIT) \
  using Type = Cfg<BM, BN, STAGES, NO, QREG, PIPELINE, Q_DIRECT>;                                   \
  static_assert(Type::SMEM <= SMEM_LIMIT, #Type " needs more shared memory per block than its GPUs allow");
#include "kdtree_tile_configs.h"
#undef KDTREE_TILE_CONFIG
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1200
constexpr int SMEM_PER_BLOCK = 101376;  // sm_120
#else
constexpr int SMEM_PER_BLOCK = 232448;
#endif

}  // namespace kdtree
