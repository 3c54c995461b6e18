// The row math every data path shares (bulk copies, registers, one-shot, multimem): the norm
// weight held in registers, a row's sum of squares reduced over the CTA, y * rstd * w in fp32
// rounded once, and where a normed vector goes. The paths differ only in how the P partial rows
// arrive; keeping the math in one place keeps their outputs bit-identical.
#pragma once

#include "tokenweave/common.cuh"

namespace tokenweave {

// The norm weight's kVpt vectors of this thread (columns tid, tid + blockDim.x, ...); untouched
// where there is no weight (add only) or past the row's end.
template <int kVpt>
__device__ __forceinline__ void load_weight(const void* weight, int hv, Vec16 (&w)[kVpt]) {
#pragma unroll
  for (int v = 0; v < kVpt; ++v) {
    const int col = threadIdx.x + v * blockDim.x;
    if (weight != nullptr && col < hv) w[v] = reinterpret_cast<const Vec16*>(weight)[col];
  }
}

// f(v, col) for each of this thread's kVpt vector columns of a row (col = tid + v * blockDim.x,
// those inside the row's hv vectors).
template <int kVpt, typename F>
__device__ __forceinline__ void for_each_vec(int hv, F&& f) {
#pragma unroll
  for (int v = 0; v < kVpt; ++v) {
    const int col = threadIdx.x + v * blockDim.x;
    if (col < hv) f(v, col);
  }
}

// ss += y[0]^2 + ... + y[7]^2, accumulated in that order.
__device__ __forceinline__ void add_squares(float& ss, const float (&y)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) ss += y[k] * y[k];
}

// Step 1 of the CTA-wide sum of squares: the warp's sum into s_warps[warp]. The caller then
// synchronizes the CTA (__syncthreads or __syncthreads_or) before block_rstd reads s_warps.
__device__ __forceinline__ void publish_warp_sum(float ss, float* s_warps) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) s_warps[threadIdx.x >> 5] = ss;
}

// Step 2: 1 / sqrt(mean(y^2) + eps) from the warps' sums, the same in every thread.
__device__ __forceinline__ float block_rstd(const float* s_warps, float inv_h, float eps) {
  const int nwarps = blockDim.x / 32;
  float t = 0.f;
  for (int k = 0; k < nwarps; ++k) t += s_warps[k];
  return rsqrtf(t * inv_h + eps);
}

// y * rstd * w, rounded once to T.
template <typename T>
__device__ __forceinline__ Vec16 normalize_vec(const float (&y)[8], float rstd, const Vec16& w) {
  float wf[8];
  set_vec<T>(wf, w);
  float o[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) o[k] = y[k] * rstd * wf[k];
  return pack_vec<T>(o);
}

}  // namespace tokenweave
