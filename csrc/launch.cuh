// Host-side launchers of the SM-driven kernels, one translation unit per kernel family
// (csrc/launch_*.cu): each family's template instantiations (dtype x ranks bucket x vectors per
// thread) compile in their own nvcc process, so a build runs them in parallel. ops.cu validates
// the call, builds FusedParams and picks the launcher.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "tokenweave/check.h"
#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/gemm_reduce.cuh"

namespace tokenweave {

struct LaunchShape {
  int vpt;
  int threads;
};

// Vectors per thread and threads per CTA for rows of `hidden` elements: whole warps for each of
// the CTA's teams (rmsnorm_row.cuh teams_for; a warp without columns adds zeros to a row's sums).
inline LaunchShape launch_shape(int64_t hidden) {
  const int64_t hv = hidden / kVecElems;
  for (int vpt = 1; vpt <= kMaxVecsPerThread; vpt *= 2) {
    const int64_t t = (hv + vpt - 1) / vpt;
    const int64_t unit = 32 * teams_for(vpt);
    if (t <= kMaxThreads) return {vpt, static_cast<int>(((t + unit - 1) / unit) * unit)};
  }
  TW_CHECK(false, "tokenweave: hidden ", hidden, " too large (max ",
           kMaxThreads * kMaxVecsPerThread * kVecElems, ")");
  return {0, 0};
}

inline int np_bucket(int64_t world) { return world <= 2 ? 2 : (world <= 4 ? 4 : 8); }

// Calls f(NP, VPT) with both as std::integral_constant for the runtime (np, vpt): the one place
// where the kernels' template instantiations are chosen.
template <typename F>
void with_np_vpt(int np, int vpt, F&& f) {
  auto by_vpt = [&](auto np_c) {
    switch (vpt) {
      case 1: f(np_c, std::integral_constant<int, 1>{}); break;
      case 2: f(np_c, std::integral_constant<int, 2>{}); break;
      case 4: f(np_c, std::integral_constant<int, 4>{}); break;
      default: f(np_c, std::integral_constant<int, 8>{}); break;
    }
  };
  switch (np) {
    case 2: by_vpt(std::integral_constant<int, 2>{}); break;
    case 4: by_vpt(std::integral_constant<int, 4>{}); break;
    default: by_vpt(std::integral_constant<int, 8>{}); break;
  }
}

inline void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TW_CHECK(err == cudaSuccess, "tokenweave: kernel launch failed: ", cudaGetErrorString(err));
}

inline int grid_of(int64_t units, int64_t ctas) {
  return static_cast<int>(units < ctas ? units : ctas);
}

// The launchers, T = __nv_bfloat16 or __half (instantiated in their own files).
// Barrier paths (launch_barrier.cu): the bulk-copy pipeline with `stages` stages, or the register
// path where stages == 0.
template <typename T>
void launch_barrier_path(const FusedParams& p, int64_t ctas, int stages, cudaStream_t stream);
template <typename T>
void launch_oneshot(const FusedParams& p, int64_t ctas, cudaStream_t stream);
template <typename T>
void launch_twoshot(const FusedParams& p, int64_t ctas, cudaStream_t stream);
// Multicast (NVLink SHARP) path: compiled, never run on this project's machines (multimem.cuh).
template <typename T>
void launch_multimem(const FusedParams& p, int64_t ctas, char* mc, cudaStream_t stream);
// The GEMM-fused path's consumer over `seg_rows` rows of a segment.
template <typename T>
void launch_gemm_reduce_kernel(const FusedParams& p, const InboxParams& g, int64_t seg_rows,
                               int64_t ctas, cudaStream_t stream);

// Explicit instantiations of launcher NAME for both dtypes (in its own .cu file).
#define TOKENWEAVE_INSTANTIATE(NAME, ...)                     \
  template void NAME<__nv_bfloat16>(__VA_ARGS__);             \
  template void NAME<__half>(__VA_ARGS__)

}  // namespace tokenweave
