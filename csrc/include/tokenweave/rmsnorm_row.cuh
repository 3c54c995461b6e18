// The row math every data path shares (bulk copies, registers, one-shot, multimem): the norm
// weight held in registers, a row's sum of squares reduced over the CTA (or a team of it: Team),
// y * rstd * w in fp32 rounded once, and where a normed vector goes. The paths differ only in how
// the P partial rows arrive; keeping the math in one place keeps their outputs bit-identical.
#pragma once

#include "tokenweave/common.cuh"

namespace tokenweave {

// The threads that work on one row together: the whole CTA (Team<1>), or one of two equal teams
// (teams_for), team t taking every other one of the CTA's rows. A CTA's rows are a chain of
// waits (the row's data, its sum-of-squares reduction and barrier, the normed stores, the FP8
// epilogue's block reductions); with every thread on one row the SM idles through them, with two
// teams one team's waits overlap the other's work. A team's thread holds the vectors of kTeams
// of the CTA's threads (columns tid + m * size), and reduces the sum of squares per such CTA
// thread in the CTA's order (`ss[m % kTeams]`, `publish_row_sums`), so a row's outputs have the
// same bits for any team count. A team syncs on its own named barrier (1 + id). Stateless: its
// indices come from the special registers, as the CTA's do.
constexpr int kMaxTeams = 2;

template <int kTeams>
struct Team {
  static_assert(kTeams == 1 || kTeams == kMaxTeams, "a CTA or two teams");
  // Threads per team (the host sizes the CTA in whole warps per team: launch_shape).
  __device__ __forceinline__ int size() const { return static_cast<int>(blockDim.x) / kTeams; }
  __device__ __forceinline__ int id() const {
    return kTeams == 1 ? 0 : static_cast<int>(threadIdx.x) / size();
  }
  __device__ __forceinline__ int tid() const {
    return static_cast<int>(threadIdx.x) - id() * size();
  }
  __device__ __forceinline__ void sync() const {
    if constexpr (kTeams == 1)
      __syncthreads();
    else if (id() == 0)  // immediate barrier ids: ptxas then reserves 3 barriers, not all 16
      asm volatile("bar.sync 1, %0;" ::"r"(size()) : "memory");
    else
      asm volatile("bar.sync 2, %0;" ::"r"(size()) : "memory");
  }
};
using CtaTeam = Team<1>;

// Teams of a CTA whose threads hold kVpt vectors of a row: two where each team's thread can hold
// two CTA threads' vectors within the register budget (kVpt <= 2), else the CTA.
__host__ __device__ constexpr int teams_for(int vpt) { return vpt <= 2 ? kMaxTeams : 1; }

// The norm weight's kVpt vectors of this thread (columns tid, tid + size, ... of its team);
// untouched where there is no weight (add only) or past the row's end.
template <int kVpt, int kTeams>
__device__ __forceinline__ void load_weight(Team<kTeams> t, const void* weight, int hv,
                                            Vec16 (&w)[kVpt]) {
#pragma unroll
  for (int v = 0; v < kVpt; ++v) {
    const int col = t.tid() + v * t.size();
    if (weight != nullptr && col < hv) w[v] = reinterpret_cast<const Vec16*>(weight)[col];
  }
}

// f(v, col) for each of this thread's kVpt vector columns of a row (col = tid + v * size of its
// team, those inside the row's hv vectors).
template <int kVpt, int kTeams, typename F>
__device__ __forceinline__ void for_each_vec(Team<kTeams> t, int hv, F&& f) {
#pragma unroll
  for (int v = 0; v < kVpt; ++v) {
    const int col = t.tid() + v * t.size();
    if (col < hv) f(v, col);
  }
}

// ss += y[0]^2 + ... + y[7]^2, accumulated in that order.
__device__ __forceinline__ void add_squares(float& ss, const float (&y)[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) ss += y[k] * y[k];
}

// The sum of ss over the warp's lanes (an xor tree), in every lane.
__device__ __forceinline__ float warp_sum(float ss) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  return ss;
}

// Step 1 of the CTA-wide sum of squares: the warp's sum into s_warps[warp]. The caller then
// synchronizes the CTA (__syncthreads or __syncthreads_or) before block_rstd reads s_warps.
__device__ __forceinline__ void publish_warp_sum(float ss, float* s_warps) {
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) s_warps[threadIdx.x >> 5] = ss;
}

// The same for a team's thread of kTeams: ss[j] is CTA thread j * size + tid's sum (Team),
// published as that thread's warp's; the team then syncs (Team::sync). The reductions run
// interleaved (one chain's latency).
template <int kTeams>
__device__ __forceinline__ void publish_row_sums(Team<kTeams> t, float (&ss)[kTeams],
                                                 float* s_warps) {
#pragma unroll
  for (int j = 0; j < kTeams; ++j) ss[j] = warp_sum(ss[j]);
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int j = 0; j < kTeams; ++j) s_warps[(j * t.size() + t.tid()) >> 5] = ss[j];
}

// Step 2: 1 / sqrt(mean(y^2) + eps) from the warps' sums (the CTA's warps, in order; a team
// publishes them all), the same in every thread.
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
