/* kdtree: MLA tree-verify attention, C ABI (no libtorch), launched on a caller's stream.
 *
 * Semantics: SGLang 0.5.23 extend_attention_fwd for absorbed MLA target-verify. For request b,
 * draft token i and head h, attend over the committed prefix (pool rows kv_indices[kv_indptr[b]..]),
 * all visible, followed by the request's draft tokens (rows of k_ext), visible where
 * mask[mask_indptr[b] + i*(P+N) + P + j] != 0 (SGLang's FULL layout), or j <= i when mask is NULL.
 * Values are the first 512 dims of each key row (the pool) or v_ext rows (the draft tokens).
 * An fp8 pool (SGLang's --kv-cache-dtype fp8_e4m3 / fp8_e5m2) is read as its values times k_scale (keys) and
 * v_scale (values), the per-layer scales SGLang's Triton path applies; the draft rows are bf16 and unscaled.
 */
#ifndef KDTREE_VERIFY_H
#define KDTREE_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDTREE_ABI_VERSION 8
#define KDTREE_QK_DIM 576
#define KDTREE_V_DIM 512

enum kdtree_index_type { KDTREE_I32 = 0, KDTREE_I64 = 1 };
/* Verify modes as the device reads them (kdtree.config.Mode). */
enum kdtree_mode { KDTREE_MODE_OFF = 0, KDTREE_MODE_VALIDATE = 1, KDTREE_MODE_ON = 2, KDTREE_MODE_STANDBY = 3 };
/* Tile configurations, one per row of kdtree_tile_configs.h: KDTREE_CONFIG_WIDE = 1 needs ~191 KB of shared memory
 * per block (sm_90, sm_100); KDTREE_CONFIG_COMPACT = 2 fits the 99 KB of sm_120. All use only mma.sync, cp.async and
 * ldmatrix. */
enum kdtree_config {
#define KDTREE_TILE_CONFIG(NAME, ID, ...) KDTREE_CONFIG_##NAME = ID,
#include "kdtree_tile_configs.h"
#undef KDTREE_TILE_CONFIG
};
/* The pool's element type. An fp8 pool's draft rows and q are converted to f16 (exactly within f16's range,
 * |x| <= 65504: SGLang's Triton kernel casts q to the pool's fp8 type, whose range is smaller) for mma.sync in f16;
 * its prefix rows take the fp8_path; the scales are applied in fp32 to the prefix's scores (k_scale) and values
 * (v_scale). */
enum kdtree_kv_dtype { KDTREE_KV_BF16 = 0, KDTREE_KV_FP8_E4M3 = 1, KDTREE_KV_FP8_E5M2 = 2 };
/* An fp8 pool's prefix: WIDEN, its rows widened to f16 (exactly) in shared memory for the f16 mma; MMA, fp8 x fp8
 * mma.sync (m16n8k32) with q cast to the pool's type and P to e4m3, as SGLang's Triton kernel quantises them (it
 * casts P to the pool's type). Checked for every pool; a bf16 pool's kernels do not read it. */
enum kdtree_fp8_path { KDTREE_FP8_WIDEN = 0, KDTREE_FP8_MMA = 1 };

enum kdtree_status {
  KDTREE_OK = 0,
  KDTREE_ERR_ARGUMENT = 1, /* a pointer, stride, size or flag is invalid */
  KDTREE_ERR_WORKSPACE = 2, /* workspace smaller than kdtree_verify_workspace_bytes() */
  KDTREE_ERR_CUDA = 3 /* a CUDA call failed; kdtree_last_error() names it and CUDA's error */
};

typedef struct {
  const void* q; /* bf16 [T, H, 576], last dim contiguous */
  int64_t q_stride_t, q_stride_h; /* in elements */
  const void* k_ext; /* bf16 [T, 1, 576] draft keys */
  int64_t k_ext_stride;
  const void* v_ext; /* bf16 [T, 1, 512] draft values, or NULL: values are k_ext[..., :512] */
  int64_t v_ext_stride;
  const void* k_buf; /* pool [S, 1, 576] of kv_dtype; prefix values are k_buf[..., :512] */
  int64_t k_buf_stride;
  const void* qo_indptr; int qo_indptr_type; /* [B+1] */
  const void* kv_indptr; int kv_indptr_type; /* [B+1] */
  const void* kv_indices; int kv_indices_type; /* prefix slots */
  const uint8_t* mask; /* bool/uint8 FULL layout, or NULL for a causal chain */
  const void* mask_indptr; int mask_indptr_type; /* [B+1], required with mask */
  void* out; /* bf16 [T, H, 512], last dim contiguous */
  int64_t out_stride_t, out_stride_h;
  void* workspace; size_t workspace_bytes;
  unsigned long long* counter; /* optional device counter, +1 per launch */
  unsigned long long* counter_mirror; /* optional host-mapped copy of *counter */
  float sm_scale;
  int batch, num_heads, max_q_len;
  int cta_slots; /* multiprocessors x resident CTAs of `config` per multiprocessor (sizes the prefix split) */
  int config; /* enum kdtree_config */
  int kv_dtype; /* enum kdtree_kv_dtype */
  float k_scale, v_scale; /* positive, finite; 1 for a bf16 pool */
  int fp8_path; /* enum kdtree_fp8_path */
  /* int32 [batch] on the device, or NULL: request b's first q_live[b] tokens (clamped to [0, its tokens]) are
   * computed and its other rows of out written as zeros. A tree cut to a smaller budget inside a graph captured at a
   * larger one (DDTREE's auto budget) costs the rows it keeps. */
  const int32_t* q_live;
} kdtree_verify_args;

int kdtree_abi_version(void);
/* Comma-separated SASS architectures compiled into this library, e.g. "90,100,120". */
const char* kdtree_compiled_archs(void);
/* Dynamic shared memory one block of `config` uses, in bytes (0 for an unknown config). */
int kdtree_verify_smem_bytes(int config);
/* CTAs of `config` one multiprocessor of the current device holds at once (for cta_slots). */
int kdtree_verify_ctas_per_sm(int config, int* ctas);
/* Workspace the launch needs for these sizes; depends on sizes only, never on device data. */
int kdtree_verify_workspace_bytes(int batch, int num_heads, int max_q_len, int cta_slots, int config, size_t* bytes);
/* Enqueue the attention on `stream` (a cudaStream_t). No allocation, no host synchronisation. */
int kdtree_verify_launch(const kdtree_verify_args* args, void* stream);

/* Validate-mode parity: compare n bf16 values of `ours` with `ref`, accumulate into `stats`
 * (kdtree_parity_stats_bytes() of device memory, zeroed once) and copy the running totals
 * to `mirror` (host-mapped memory, same layout as kdtree_parity_totals) on the device. */
typedef struct {
  unsigned long long calls_compared;
  unsigned long long calls_over_tol;
  unsigned long long nan_inf;
  float max_abs_err;
  float max_rel_l2;
  float last_rel_l2;
  float rtol;
} kdtree_parity_totals;
size_t kdtree_parity_stats_bytes(void);
int kdtree_parity_update(const void* ours, const void* ref, int64_t n, void* stats, kdtree_parity_totals* mirror,
                         float rtol, void* stream);

/* Live mode switching inside CUDA graphs captured with every mode (src/modes.cu). A captured verify call is: the
 * KV write; then, on a side stream, kdtree's kernel into the call's output on the extents it serves (on); and on
 * the call's stream the original into that output (validate, standby), kdtree's kernel into a scratch buffer
 * (validate) and kdtree_mode_post. Each launch gets extents that are the step's own or all zeros (a kernel with no
 * draft tokens returns at once), so in on the original's path costs its early exits, beside kdtree's kernel.
 *
 * kdtree_mode_gate, once per captured step, before its first verify call: read the mode from `host_mode` (pinned
 * host memory mapped into the device, written by the host with no CUDA call) and keep it in `mode` (device memory)
 * for the step's kernels; write qo_indptr's n entries, or zeros, into `qo_gated` = [on | validate | original]
 * (3n entries of qo_type): the extents kdtree's kernel serves in on, those it computes to be compared in validate,
 * and the original's (validate and standby); and in on count the step's calls as served: `*step_calls` (device
 * address of pinned host memory the host counts the step's captured calls in) onto `counter` and its mirror. */
int kdtree_mode_gate(const unsigned* host_mode, unsigned* mode, const void* qo_indptr, int qo_type, int n,
                     void* qo_gated, const unsigned long long* step_calls, unsigned long long* counter,
                     unsigned long long* counter_mirror, void* stream);
/* After a captured call's paths, in validate only: compare `ours` (kdtree's output) with `orig` (the served one) as
 * kdtree_parity_update does. In any other mode it returns at once. */
int kdtree_mode_post(const unsigned* mode, const void* ours, const void* orig, int64_t n, void* stats,
                     kdtree_parity_totals* mirror, float rtol, void* stream);
/* The id of the CUDA graph capture running on `stream` (a cudaStream_t), 0 when it is not capturing. */
int kdtree_capture_id(void* stream, unsigned long long* id);

/* The measured rate of mma.sync.m16n8k16 bf16 with fp32 accumulate on the current device, in TFLOP/s, into *tflops
 * (src/peak.cu): the compute ceiling of the benchmarks' roofline. warps_per_sm 0: 4 blocks of 8 warps per
 * multiprocessor; 1..32: one block of that many warps per multiprocessor. Runs on `stream` and waits for it: a
 * benchmark, not for graphs. */
int kdtree_mma_peak(int warps_per_sm, float* tflops, void* stream);

/* Device address of pinned host memory (the mode word, the mirrors above). */
int kdtree_host_device_pointer(void* host, void** device);

/* Why the calling thread's last failed call failed: every entry point that returns a status other than KDTREE_OK
 * records its message here first (src/status.cu). Not cleared by a call that succeeds. */
const char* kdtree_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
