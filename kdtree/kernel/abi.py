"""The C ABI as the binding reads it: kernel_build/include/kdtree_verify.h's constants, enums and structs again for
ctypes (tests/kernel_build/test_kernel_abi.py holds them to the header)."""

from __future__ import annotations

import ctypes

import torch

from kdtree.config import TILE_CONFIGS

LIB_NAME = "libkdtree_verify.so"
QK_DIM, V_DIM = 576, 512
MAX_HEADS, MAX_Q_LEN = 128, 1024
ABI_VERSION = 8  # kernel_build/include/kdtree_verify.h
CONFIGS = TILE_CONFIGS  # enum kdtree_config, in the automatic choice's order (kdtree_tile_configs.h)
# Pool dtypes (enum kdtree_kv_dtype): SGLang's MLA pool for --kv-cache-dtype auto, fp8_e4m3 and fp8_e5m2.
KV_DTYPES = {torch.bfloat16: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# How an fp8 pool's prefix is computed (enum kdtree_fp8_path, KDTREE_FP8_PATH): widened exactly to f16, or fp8 x fp8.
FP8_PATHS = {"widen": 0, "mma": 1}
_I32, _I64 = 0, 1


class _Args(ctypes.Structure):
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("q_stride_t", ctypes.c_int64),
        ("q_stride_h", ctypes.c_int64),
        ("k_ext", ctypes.c_void_p),
        ("k_ext_stride", ctypes.c_int64),
        ("v_ext", ctypes.c_void_p),
        ("v_ext_stride", ctypes.c_int64),
        ("k_buf", ctypes.c_void_p),
        ("k_buf_stride", ctypes.c_int64),
        ("qo_indptr", ctypes.c_void_p),
        ("qo_indptr_type", ctypes.c_int),
        ("kv_indptr", ctypes.c_void_p),
        ("kv_indptr_type", ctypes.c_int),
        ("kv_indices", ctypes.c_void_p),
        ("kv_indices_type", ctypes.c_int),
        ("mask", ctypes.c_void_p),
        ("mask_indptr", ctypes.c_void_p),
        ("mask_indptr_type", ctypes.c_int),
        ("out", ctypes.c_void_p),
        ("out_stride_t", ctypes.c_int64),
        ("out_stride_h", ctypes.c_int64),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("counter", ctypes.c_void_p),
        ("counter_mirror", ctypes.c_void_p),
        ("sm_scale", ctypes.c_float),
        ("batch", ctypes.c_int),
        ("num_heads", ctypes.c_int),
        ("max_q_len", ctypes.c_int),
        ("cta_slots", ctypes.c_int),
        ("config", ctypes.c_int),
        ("kv_dtype", ctypes.c_int),
        ("k_scale", ctypes.c_float),
        ("v_scale", ctypes.c_float),
        ("fp8_path", ctypes.c_int),
        ("q_live", ctypes.c_void_p),
    ]


class ParityTotals(ctypes.Structure):
    _fields_ = [
        ("calls_compared", ctypes.c_uint64),
        ("calls_over_tol", ctypes.c_uint64),
        ("nan_inf", ctypes.c_uint64),
        ("max_abs_err", ctypes.c_float),
        ("max_rel_l2", ctypes.c_float),
        ("last_rel_l2", ctypes.c_float),
        ("rtol", ctypes.c_float),
    ]


# enum kdtree_status of kernel_build/include/kdtree_verify.h (tests/kernel_build/test_kernel_abi.py holds them to it)
STATUS = {0: "KDTREE_OK", 1: "KDTREE_ERR_ARGUMENT", 2: "KDTREE_ERR_WORKSPACE", 3: "KDTREE_ERR_CUDA"}

# enum kdtree_mode: the verify modes as the device reads them (src/modes.cu)
MODE_CODES = {"off": 0, "validate": 1, "on": 2, "standby": 3}  # enum kdtree_mode
