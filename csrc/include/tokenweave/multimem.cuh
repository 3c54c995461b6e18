// multimem (NVLink SHARP) variant of the fused op, sm_90: the switch reduces the peers' partials
// (multimem.ld_reduce, fp32 accumulation) and broadcasts the normed rows (multimem.st).
//
// UNTESTED HERE: the project's machines forbid NVLink multicast (DEVICE.md). This code is compiled
// (and its PTX checked by .ci/compile_csrc.sh) but never executed on them. It needs a multicast
// address `mc_base` mapping every rank's data region (created by the caller, e.g. with
// cuMulticastCreate + cuMulticastBindMem on a machine where that is allowed); this project never
// creates one. Selection is opt-in only (megatron_tokenweave.kernels.policy).
// Ordering uses the same unicast signal-pad barriers as the P2P kernel (signal.cuh).
#pragma once

#include "tokenweave/bulk_copy.cuh"  // TOKENWEAVE_SM90_ASM: multimem.* needs sm_90
#include "tokenweave/common.cuh"
#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/rmsnorm_row.cuh"
#include "tokenweave/signal.cuh"

namespace tokenweave {

template <typename T>
struct Multimem;

template <>
struct Multimem<__nv_bfloat16> {
  static __device__ __forceinline__ Vec16 ld_reduce(const void* mc) {
    Vec16 v{};  // the asm sets it (below sm_90 the asm is a trap)
    TOKENWEAVE_SM90_ASM(
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.u[0]), "=r"(v.u[1]), "=r"(v.u[2]), "=r"(v.u[3])
        : "l"(mc)
        : "memory");
    return v;
  }
  static __device__ __forceinline__ void st(void* mc, const Vec16& v) {
    TOKENWEAVE_SM90_ASM("multimem.st.relaxed.sys.global.v4.bf16x2 [%0], {%1,%2,%3,%4};" ::"l"(mc),
                        "r"(v.u[0]), "r"(v.u[1]), "r"(v.u[2]), "r"(v.u[3])
                        : "memory");
  }
};

template <>
struct Multimem<__half> {
  static __device__ __forceinline__ Vec16 ld_reduce(const void* mc) {
    Vec16 v{};  // the asm sets it (below sm_90 the asm is a trap)
    TOKENWEAVE_SM90_ASM(
        "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.f16x2 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.u[0]), "=r"(v.u[1]), "=r"(v.u[2]), "=r"(v.u[3])
        : "l"(mc)
        : "memory");
    return v;
  }
  static __device__ __forceinline__ void st(void* mc, const Vec16& v) {
    TOKENWEAVE_SM90_ASM("multimem.st.relaxed.sys.global.v4.f16x2 [%0], {%1,%2,%3,%4};" ::"l"(mc),
                        "r"(v.u[0]), "r"(v.u[1]), "r"(v.u[2]), "r"(v.u[3])
                        : "memory");
  }
};

// Same parameters as the P2P kernel plus the multicast base of the data regions. One row per CTA
// iteration; kVpt vectors per thread.
template <typename T, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    fused_allreduce_rmsnorm_multimem_kernel(const FusedParams p, char* mc_base) {
  __shared__ float s_red[2][kMaxThreads / 32];
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t* pad_bases = p.bases + p.world;
  if (tid == 0) {
    s_fail = 0;
    s_epoch = next_epoch(reinterpret_cast<SignalPad*>(pad_bases[p.rank]), b);
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  if (e == 0 ||
      !cta_barrier<false>(pad_bases, p.rank, p.world, b, e, p.tag, p.timeout_ns, &s_fail)) {
    poison_outputs(p, nan_pair<T>());
    return;
  }

  const int hv = p.hidden / kVecElems;
  const bool norm = p.weight != nullptr;
  const int chunk = p.sequence_parallel ? p.rank : 0;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const float inv_h = 1.0f / static_cast<float>(p.hidden);
  int parity = 0;
  for (int row = b; row < p.rows; row += gridDim.x, parity ^= 1) {
    float y[kVpt][8];
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < kVpt; ++v) {
      const int col = tid + v * blockDim.x;
      if (col < hv) {
        const int64_t off = p.partial_off + chunk * p.partial_cstride + row * row_bytes +
                            col * kVecBytes;
        set_vec<T>(y[v], Multimem<T>::ld_reduce(mc_base + off));
        add_vec<T>(y[v], reinterpret_cast<const Vec16*>(static_cast<const char*>(p.residual) +
                                                        row * row_bytes)[col]);
        reinterpret_cast<Vec16*>(static_cast<char*>(p.residual_out) + row * row_bytes)[col] =
            pack_vec<T>(y[v]);
        add_squares(ss, y[v]);
      }
    }
    if (!norm) continue;
    publish_warp_sum(ss, s_red[parity]);
    __syncthreads();
    const float rstd = block_rstd(s_red[parity], inv_h, p.eps);
#pragma unroll
    for (int v = 0; v < kVpt; ++v) {
      const int col = tid + v * blockDim.x;
      if (col < hv) {
        // The weight is read here, not held in registers: kVpt up to 8 (hidden 32768).
        const Vec16 out =
            normalize_vec<T>(y[v], rstd, reinterpret_cast<const Vec16*>(p.weight)[col]);
        const int64_t roff = row * row_bytes + col * kVecBytes;
        if (p.sequence_parallel) {
          Multimem<T>::st(mc_base + p.normed_off + chunk * p.normed_cstride + roff, out);
        } else {
          *reinterpret_cast<Vec16*>(static_cast<char*>(p.normed_local) + roff) = out;
        }
      }
    }
  }
  if (!cta_barrier<true>(pad_bases, p.rank, p.world, b, e, 0u, p.timeout_ns, &s_fail))
    poison_outputs(p, nan_pair<T>());
}

}  // namespace tokenweave
