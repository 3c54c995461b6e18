// Hopper (sm_90a) building blocks of the warp-specialized GEMM (fit_gemm.cuh), beside the
// mbarrier steps of bulk_copy.cuh: bulk tensor copies (TMA), named barriers, register
// reallocation, matrix stores (as they are or transposed) and wgmma (bf16, fp16 or e4m3
// operands) with any instruction N (a multiple of 8 up to 208: the extent of a tile fitted to
// the call, its tokens' or, with the tokens as M, its weight rows').
// Everything here is device code for sm_90a; fit_gemm.cuh compiles it only there.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <stdint.h>

#include "tokenweave/bulk_copy.cuh"  // smem_addr and the mbarrier steps

namespace tokenweave {
namespace hopper {

// A 2-D box of the tensor map at (inner, row) into shared memory; completes on `bar` (its
// transaction bytes). Out-of-bounds elements land as zeros.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, int inner, int row,
                                           uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, "
      "{%2, %3}], [%4];" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(row), "r"(smem_addr(bar))
      : "memory");
}

// The same box into shared memory at the same offset in every CTA of the cluster that `ctas`
// has a bit of (TMA multicast), each completing on its own barrier at `bar`'s offset.
__device__ __forceinline__ void tma_load_2d_multicast(void* dst, const CUtensorMap* map, int inner,
                                                     int row, uint64_t* bar, uint16_t ctas) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_addr(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(row), "r"(smem_addr(bar)), "h"(ctas)
      : "memory");
}

// An arrival on the barrier at `bar`'s offset in CTA `cta` of the cluster (a consumer releasing
// a slot the other CTA's copies also fill). The default semantics (release at CTA scope), as
// for the local arrival: the wgmma reads it orders are complete (waited for) before it, and a
// cluster-scope release compiles to a GPU-wide memory barrier before every arrival.
__device__ __forceinline__ void mbar_arrive_cluster(uint64_t* bar, uint32_t cta) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
               : "=r"(remote)
               : "r"(smem_addr(bar)), "r"(cta));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

// CTAs in this CTA's cluster.
__device__ __forceinline__ uint32_t cluster_ctas() {
  uint32_t n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
  return n;
}

// Every thread of the cluster's CTAs: what each did before (barrier inits included) is seen by
// all after.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" :::
                   "memory");
}

__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Named barriers among `threads` threads (ids 1..15; 0 is __syncthreads').
__device__ __forceinline__ void bar_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

template <uint32_t kRegs>
__device__ __forceinline__ void regs_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <uint32_t kRegs>
__device__ __forceinline__ void regs_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Shared-memory matrix descriptor of a K-major operand tile whose rows are 128 bytes, stored by
// the copy engine with the 128-byte swizzle: 8-row groups 1024 bytes apart. `addr` is the first
// row's K offset (a multiple of 32 bytes within the row: each wgmma K step).
__device__ __forceinline__ uint64_t smem_desc_k128(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(1) << 16) |
         (static_cast<uint64_t>(1024 >> 4) << 32) | (static_cast<uint64_t>(1) << 62);
}

// Four (x4) or two (x2) 8 x 8 matrices of 16-bit elements, each thread holding row lane / 4,
// columns 2 * (lane % 4) and + 1 of each (an mma accumulator fragment, two elements a register),
// stored as they are (fragment row r of matrix i to the 16 bytes at the address lane 8 * i + r
// gives) or transposed (fragment column c to lane 8 * i + c's address).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x2(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1, %2};" ::"r"(addr), "r"(r0),
               "r"(r1)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x2_trans(uint32_t addr, uint32_t r0, uint32_t r1) {
  asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};" ::"r"(addr),
               "r"(r0), "r"(r1)
               : "memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulators across wgmma_wait.
template <int kN>
__device__ __forceinline__ void fence_regs(float (&d)[kN]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Operand lists of an m64nN wgmma: its N / 2 fp32 accumulators are operands %3 .. (after the
// two descriptors and the scale), TW_ACC_k names 4 * k of them, TW_OUT_k binds them to d[].
#define TW_ACC_1 "%3, %4, %5, %6"
#define TW_ACC_2 TW_ACC_1 ", " "%7, %8, %9, %10"
#define TW_ACC_3 TW_ACC_2 ", " "%11, %12, %13, %14"
#define TW_ACC_4 TW_ACC_3 ", " "%15, %16, %17, %18"
#define TW_ACC_5 TW_ACC_4 ", " "%19, %20, %21, %22"
#define TW_ACC_6 TW_ACC_5 ", " "%23, %24, %25, %26"
#define TW_ACC_7 TW_ACC_6 ", " "%27, %28, %29, %30"
#define TW_ACC_8 TW_ACC_7 ", " "%31, %32, %33, %34"
#define TW_ACC_9 TW_ACC_8 ", " "%35, %36, %37, %38"
#define TW_ACC_10 TW_ACC_9 ", " "%39, %40, %41, %42"
#define TW_ACC_11 TW_ACC_10 ", " "%43, %44, %45, %46"
#define TW_ACC_12 TW_ACC_11 ", " "%47, %48, %49, %50"
#define TW_ACC_13 TW_ACC_12 ", " "%51, %52, %53, %54"
#define TW_ACC_14 TW_ACC_13 ", " "%55, %56, %57, %58"
#define TW_ACC_15 TW_ACC_14 ", " "%59, %60, %61, %62"
#define TW_ACC_16 TW_ACC_15 ", " "%63, %64, %65, %66"
#define TW_ACC_17 TW_ACC_16 ", " "%67, %68, %69, %70"
#define TW_ACC_18 TW_ACC_17 ", " "%71, %72, %73, %74"
#define TW_ACC_19 TW_ACC_18 ", " "%75, %76, %77, %78"
#define TW_ACC_20 TW_ACC_19 ", " "%79, %80, %81, %82"
#define TW_ACC_21 TW_ACC_20 ", " "%83, %84, %85, %86"
#define TW_ACC_22 TW_ACC_21 ", " "%87, %88, %89, %90"
#define TW_ACC_23 TW_ACC_22 ", " "%91, %92, %93, %94"
#define TW_ACC_24 TW_ACC_23 ", " "%95, %96, %97, %98"
#define TW_ACC_25 TW_ACC_24 ", " "%99, %100, %101, %102"
#define TW_ACC_26 TW_ACC_25 ", " "%103, %104, %105, %106"
#define TW_OUT_1(d) "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
#define TW_OUT_2(d) TW_OUT_1(d), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
#define TW_OUT_3(d) TW_OUT_2(d), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
#define TW_OUT_4(d) TW_OUT_3(d), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
#define TW_OUT_5(d) TW_OUT_4(d), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19])
#define TW_OUT_6(d) TW_OUT_5(d), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
#define TW_OUT_7(d) TW_OUT_6(d), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27])
#define TW_OUT_8(d) TW_OUT_7(d), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define TW_OUT_9(d) TW_OUT_8(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35])
#define TW_OUT_10(d) TW_OUT_9(d), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39])
#define TW_OUT_11(d) TW_OUT_10(d), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43])
#define TW_OUT_12(d) TW_OUT_11(d), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47])
#define TW_OUT_13(d) TW_OUT_12(d), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51])
#define TW_OUT_14(d) TW_OUT_13(d), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55])
#define TW_OUT_15(d) TW_OUT_14(d), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59])
#define TW_OUT_16(d) TW_OUT_15(d), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
#define TW_OUT_17(d) TW_OUT_16(d), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67])
#define TW_OUT_18(d) TW_OUT_17(d), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
#define TW_OUT_19(d) TW_OUT_18(d), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75])
#define TW_OUT_20(d) TW_OUT_19(d), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
#define TW_OUT_21(d) TW_OUT_20(d), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83])
#define TW_OUT_22(d) TW_OUT_21(d), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
#define TW_OUT_23(d) TW_OUT_22(d), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91])
#define TW_OUT_24(d) TW_OUT_23(d), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
#define TW_OUT_25(d) TW_OUT_24(d), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99])
#define TW_OUT_26(d) TW_OUT_25(d), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103])

// The operands' types of a wgmma (both K-major in shared memory): 16-bit ones take 16 of K per
// instruction, e4m3 ones 32 (the same 32 bytes of each row).
enum class MmaType { kBf16, kF16, kE4m3 };

// D[64 x N] (+)= A[64 x K] * B[N x K]^T, both K-major in shared memory (descriptors), fp32
// accumulators; `accumulate` 0 overwrites D. K: 16 for 16-bit operands, 32 for e4m3 (whose
// instruction takes no transpose immediates).
template <int kN>
struct Wgmma;

#define TW_WGMMA_TYPE(K4, N, SHAPE_K, TYPE, IMMS)                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %2, 0;\n"                                  \
               "wgmma.mma_async.sync.aligned.m64n" #N "k" #SHAPE_K ".f32." TYPE "." TYPE " {"   \
               TW_ACC_##K4 "}, %0, %1, p, " IMMS ";\n}\n"                                    \
               : "+l"(a), "+l"(b), "+r"(accumulate), TW_OUT_##K4(d))

#define TW_WGMMA(K4, N)                                                                       \
  template <>                                                                                 \
  struct Wgmma<N> {                                                                           \
    template <MmaType kType>                                                                  \
    static __device__ __forceinline__ void mma(float (&d)[N / 2], uint64_t a, uint64_t b,     \
                                               uint32_t accumulate) {                         \
      if constexpr (kType == MmaType::kBf16) {                                                \
        TW_WGMMA_TYPE(K4, N, 16, "bf16", "1, 1, 0, 0");                                       \
      } else if constexpr (kType == MmaType::kF16) {                                          \
        TW_WGMMA_TYPE(K4, N, 16, "f16", "1, 1, 0, 0");                                        \
      } else {                                                                                \
        TW_WGMMA_TYPE(K4, N, 32, "e4m3", "1, 1");                                             \
      }                                                                                       \
    }                                                                                         \
  };

TW_WGMMA(2, 16)
TW_WGMMA(3, 24)
TW_WGMMA(4, 32)
TW_WGMMA(5, 40)
TW_WGMMA(6, 48)
TW_WGMMA(7, 56)
TW_WGMMA(8, 64)
TW_WGMMA(9, 72)
TW_WGMMA(10, 80)
TW_WGMMA(11, 88)
TW_WGMMA(12, 96)
TW_WGMMA(13, 104)
TW_WGMMA(14, 112)
TW_WGMMA(15, 120)
TW_WGMMA(16, 128)
TW_WGMMA(17, 136)
TW_WGMMA(18, 144)
TW_WGMMA(19, 152)
TW_WGMMA(20, 160)
TW_WGMMA(21, 168)
TW_WGMMA(22, 176)
TW_WGMMA(23, 184)
TW_WGMMA(24, 192)
TW_WGMMA(25, 200)
TW_WGMMA(26, 208)

#undef TW_WGMMA
#undef TW_WGMMA_TYPE

}  // namespace hopper
}  // namespace tokenweave
