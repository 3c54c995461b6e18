// Normed rows written in FP8 (e4m3) for the next linear, quantized as that linear's
// TransformerEngine input quantizer quantizes the same rows rounded to the activations' dtype:
//
// - one known scale (delayed scaling): q = e4m3(x * scale), saturating; max |x| accumulated
//   into the quantizer's amax (atomicMax, once per warp at the end of a launch); scale_inv[0] =
//   1 / scale;
// - 1 x 128 blocks (blockwise scaling of activations): per block of 128 columns of a row,
//   amax over the block (16 lanes of 8 elements: a shuffle, the row is in registers), scale =
//   448 / amax (floored at amax_eps; 1 where the block is all zeros; the dtype's largest finite
//   value where it overflows; optionally rounded down to a power of two), q = e4m3(x * scale),
//   scale_inv stored at [block][row] (TE's GEMM-ready layout: column blocks of a stride of
//   rows rounded up to 4).
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "tokenweave/common.cuh"

// e4m3 conversions are instructions from sm_89 on; below it each would be a long software
// sequence in every kernel instantiation (minutes of compile time for code no caller runs: TE has
// no FP8 GEMM there), so there the FP8 epilogue is a trap and the host refuses FP8 rows (ops.cu).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
#define TOKENWEAVE_FP8_ROWS 0
#else
#define TOKENWEAVE_FP8_ROWS 1
#endif

namespace tokenweave {

constexpr int kFp8MinArch = 89;  // the oldest arch that writes FP8 rows (sm_89)

enum Fp8Mode : int { kFp8None = 0, kFp8TensorScale = 1, kFp8Blocks = 2 };

constexpr int kFp8BlockCols = 128;                        // columns per scale block
constexpr int kFp8BlockLanes = kFp8BlockCols / kVecElems;  // lanes holding one block of a row
constexpr float kE4m3Max = 448.f;
constexpr uint32_t kFp8NanWord = 0x7F7F7F7Fu;             // four e4m3 NaNs

struct Fp8Rows {
  int mode;             // Fp8Mode
  const float* scale;   // tensor scale: the known scale
  float* amax;          // tensor scale: max |x| accumulated here
  float* scale_inv;     // tensor scale: [1]; blocks: [hidden / 128][stride]
  int stride;           // blocks: scale_inv entries between two column blocks
  float amax_eps;       // blocks: floor of a block's amax
  int pow2;             // blocks: scales rounded down to a power of two
  float inf_scale;      // blocks: the scale where 448 / amax overflows (largest finite of T)
};

// TE's scale of a block from its amax (recipe_common.cuh's semantics, written here).
__device__ __forceinline__ float fp8_block_scale(float amax, const Fp8Rows& f) {
  if (amax < f.amax_eps) amax = f.amax_eps;
  if (isinf(amax) || amax == 0.f || isnan(amax)) return 1.f;
  float scale = __fdiv_rn(kE4m3Max, amax);
  if (isinf(scale)) scale = f.inf_scale;
  if (f.pow2) scale = __uint_as_float(__float_as_uint(scale) & 0xFF800000u);
  return scale;
}

// (scale, 1 / scale) of a block, the same bits as fp8_block_scale and a correctly rounded
// reciprocal. Power-of-two scales of an amax of biased exponent >= 9 (the blocks that occur)
// without a division: 448 / (m * 2^e) = (1.75 / m) * 2^(8 - e), whose exponent is 8 - e where
// m <= 1.75 and 7 - e above it (the quotient rounds to below 1 there: m's spacing, 2^-23, is
// more than twice the half-spacing of floats below 1), and the reciprocal is exact. kPow2: the
// caller knows f.pow2 is set.
template <bool kPow2>
__device__ __forceinline__ float2 fp8_block_scales(float amax, const Fp8Rows& f) {
  if (amax < f.amax_eps) amax = f.amax_eps;
  const uint32_t bits = __float_as_uint(amax);
  const uint32_t biased = bits >> 23;  // amax >= 0: no sign bit
  if (kPow2 && biased >= 9 && biased < 255) {
    const uint32_t k = ((bits & 0x7FFFFFu) <= 0x600000u ? 135u : 134u) - biased;  // 2^k
    return make_float2(__uint_as_float((k + 127u) << 23), __uint_as_float((127u - k) << 23));
  }
  const float scale = fp8_block_scale(amax, f);
  return make_float2(scale, __frcp_rn(scale));
}

// max over the 16 lanes of this lane's half-warp of a non-negative float (both halves at
// once: two warp-wide integer max reductions, non-negative floats ordering as their bits).
__device__ __forceinline__ float half_warp_max(float m) {
  const uint32_t bits = __float_as_uint(m);
  const bool low = (threadIdx.x & 31) < 16;
  const uint32_t lo = __reduce_max_sync(0xffffffffu, low ? bits : 0u);
  const uint32_t hi = __reduce_max_sync(0xffffffffu, low ? 0u : bits);
  return __uint_as_float(low ? lo : hi);
}

// What a thread of an FP8-writing launch keeps across rows: the tensor scale, read once, and
// its running max |x| (tensor scale).
struct Fp8Acc {
  float scale;
  float amax;
};

__device__ __forceinline__ Fp8Acc fp8_begin(const Fp8Rows& f) {
  return {f.mode == kFp8TensorScale ? *f.scale : 0.f, 0.f};
}

// Eight values as e4m3 with saturation, in one 8-byte word.
__device__ __forceinline__ uint2 fp8_pack8(const float (&x)[8]) {
  uint32_t h[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    h[k] = __nv_cvt_float2_to_fp8x2(make_float2(x[2 * k], x[2 * k + 1]), __NV_SATFINITE,
                                    __NV_E4M3);
  return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

// A vector of T's values times `scale`, as floats. bf16 rows with power-of-two scales (every
// scale of the blockwise recipe's default): one packed multiply a pair, exact (a power of two
// from 2^-126 to 2^127 is a bf16, and the products are at most 448 in magnitude; one that
// underflows is below e4m3's half-spacing at zero either way); else in fp32.
template <typename T, bool kPow2>
__device__ __forceinline__ void scaled_vec(float (&x)[8], Vec16 q, float scale) {
  if constexpr (kPow2 && std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 s2 = __float2bfloat162_rn(scale);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      __nv_bfloat162 h = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&q.u[k]), s2);
      q.u[k] = *reinterpret_cast<uint32_t*>(&h);
    }
    set_vec<T>(x, q);
  } else {
    set_vec<T>(x, q);
#pragma unroll
    for (int k = 0; k < 8; ++k) x[k] *= scale;
  }
}

// Packed maxima of magnitudes of two words of T pairs (max.xorsign.abs: the result's sign is
// the product of the operands', dropped at the end by abs_max8).
template <typename T>
__device__ __forceinline__ uint32_t max_abs2(uint32_t a, uint32_t b) {
  uint32_t m;
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  else
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  return m;
}

// max |v| over a vector of T. NaNs are skipped as fmaxf skips them, except in a vector of eight
// NaNs, whose max is NaN: its block then takes the scale 1 (a NaN amax's), as a block of NaNs
// does (the values are NaN either way).
template <typename T>
__device__ __forceinline__ float abs_max8(const Vec16& q) {
  const float2 f = Pack<T>::to_float2(
      max_abs2<T>(max_abs2<T>(q.u[0], q.u[1]), max_abs2<T>(q.u[2], q.u[3])));
  return fmaxf(fabsf(f.x), fabsf(f.y));
}

// Tensor scale: this thread's running amax into the quantizer's (every thread of the CTA calls
// it once, after its last row); CTA 0 also writes scale_inv.
__device__ __forceinline__ void fp8_end(const Fp8Rows& f, const Fp8Acc& acc) {
  if (f.mode != kFp8TensorScale) return;
  float amax = acc.amax;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  // Non-negative floats order as their bit patterns: an integer max is the float max.
  if ((threadIdx.x & 31) == 0 && amax > 0.f)
    atomicMax(reinterpret_cast<unsigned int*>(f.amax), __float_as_uint(amax));
  if (blockIdx.x == 0 && threadIdx.x == 0) f.scale_inv[0] = __frcp_rn(acc.scale);
}

}  // namespace tokenweave
