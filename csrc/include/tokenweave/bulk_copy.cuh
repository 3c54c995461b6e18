// sm_90 bulk asynchronous copies (the TMA engine's non-tensor form) into shared memory, completed
// on an mbarrier. They need no registers, so one CTA keeps several 16-64 KB rows of peer data in
// flight over NVLink (the source may be a peer's IPC-mapped memory: it is ordinary global memory).
#pragma once

#include <stdint.h>

// Inline PTX that needs sm_90 (here: mbarrier tx-counts, bulk copies, async-proxy fences; and
// multimem.* in multimem.cuh). In device code for an older arch (TOKENWEAVE_CUDA_ARCHS="80;90") it
// is __trap() instead: the host never launches these paths below sm_90 (ops.cu checks the device),
// so a trap there means that check was bypassed.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define TOKENWEAVE_SM90_ASM(...) __trap()
#else
#define TOKENWEAVE_SM90_ASM(...) asm volatile(__VA_ARGS__)
#endif

namespace tokenweave {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  TOKENWEAVE_SM90_ASM("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)),
                      "r"(count)
                      : "memory");
}

// Make mbarrier.init visible to the async proxy (the copy engine signals the barrier).
__device__ __forceinline__ void fence_mbar_init() {
  TOKENWEAVE_SM90_ASM("fence.mbarrier_init.release.cluster;" ::: "memory");
  TOKENWEAVE_SM90_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}

// Order this thread's (and, through an earlier barrier, the CTA's) generic-proxy accesses before
// later async-proxy ones: of shared memory (a stage read by the threads, then refilled by a copy)
// and of global memory (peers' partial rows published by their release, then bulk-read).
__device__ __forceinline__ void fence_proxy_async_shared() {
  TOKENWEAVE_SM90_ASM("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ void fence_proxy_async_global() {
  TOKENWEAVE_SM90_ASM("fence.proxy.async.global;" ::: "memory");
}

// The producer's arrival on `bar`, announcing `bytes` to be delivered by bulk copies.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  TOKENWEAVE_SM90_ASM("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::
                          "r"(smem_addr(bar)),
                      "r"(bytes)
                      : "memory");
}

// A plain arrival on `bar` (a consumer releasing the slot it read).
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  TOKENWEAVE_SM90_ASM("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// Global (local or peer) -> shared, `bytes` a multiple of 16, both addresses 16-byte aligned.
__device__ __forceinline__ void bulk_load(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                          uint64_t* bar) {
  TOKENWEAVE_SM90_ASM(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_addr(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// Wait until the phase with parity `parity` of `bar` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done = 1;  // set by the asm; the initial 1 only matters where it is a trap (< sm_90)
  do {
    TOKENWEAVE_SM90_ASM(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        " selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}

}  // namespace tokenweave
