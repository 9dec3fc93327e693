// The C ABI's one error path: an entry point that fails records why (per calling thread) and returns its
// kdtree_status code; kdtree_last_error() hands the message over (kdtree.kernel raises with it).
#pragma once
#include <cuda_runtime.h>

#include "kdtree_verify.h"

namespace kdtree {

int fail(int code, const char* msg);  // records msg; returns code
int fail_cuda(cudaError_t e, const char* what);  // records "what: <CUDA's message>"; returns KDTREE_ERR_CUDA

// KDTREE_OK when `e` is cudaSuccess, else fail_cuda.
inline int check_cuda(cudaError_t e, const char* what) { return e == cudaSuccess ? KDTREE_OK : fail_cuda(e, what); }

}  // namespace kdtree
