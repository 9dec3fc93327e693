// The C ABI's one error path (status.cuh): where every entry point's failure message is kept.
#include <cstdio>

#include "status.cuh"

namespace kdtree {
namespace {
thread_local char g_error[256] = "";
}

int fail(int code, const char* msg) {
  snprintf(g_error, sizeof g_error, "%s", msg);
  return code;
}

int fail_cuda(cudaError_t e, const char* what) {
  snprintf(g_error, sizeof g_error, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
  return KDTREE_ERR_CUDA;
}

}  // namespace kdtree

extern "C" __attribute__((visibility("default"))) const char* kdtree_last_error(void) { return kdtree::g_error; }
