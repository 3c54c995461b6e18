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

// 1 / x correctly rounded, subnormal results kept (x normal, zero or infinite): the build's fast
// math makes __frcp_rn flush them to zero, and a block scale above 2^126 (amax below
// 448 x 2^-126) has a subnormal reciprocal, which the reference stores (TE's blockwise quantizer
// computes it as 1.0 / scale in double). The flushing form where the result is normal: the full
// one's slow path costs registers.
__device__ __forceinline__ float rcp_rn_subnormal(float x) {
  if (fabsf(x) <= 0x1p126f) return __frcp_rn(x);
  float r;
  asm("rcp.rn.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

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
// reciprocal (rcp_rn_subnormal). Power-of-two scales of an amax of biased exponent >= 9 (the
// blocks that occur) without a division: 448 / (m * 2^e) = (1.75 / m) * 2^(8 - e), whose
// exponent is 8 - e where m <= 1.75 and 7 - e above it (the quotient rounds to below 1 there:
// m's spacing, 2^-23, is more than twice the half-spacing of floats below 1), and the
// reciprocal is exact (at least 2^-126: normal). kPow2: the caller knows f.pow2 is set.
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
  return make_float2(scale, rcp_rn_subnormal(scale));
}

// Two blocks of a thread (vectors v and v + 1 of its row, lo and hi of a word below): their
// scales, reciprocals, and for bf16 rows with power-of-two scales each scale as a bf16 pair
// (the multiplier of scaled_pow2_bf16).
struct BlockScales2 {
  float scale[2];
  float inv[2];
  uint32_t pair[2];
};

// The scales of the two blocks whose amaxes are the halves of `amax2` (non-negative T).
// kPow2 (power-of-two scales, amax_eps 0: emit_normed's dispatch) with bf16 rows: both at once on
// the 16-bit fields, fp8_block_scales<true>'s rule without unpacking: t = (biased exponent +
// (mantissa > 1.75's)) << 7 of each half (adding 0x1F carries into the exponent exactly where
// the 7-bit mantissa exceeds 0x60), the scale the bf16 of exponent field 262 - (t >> 7), the
// reciprocal's field (t >> 7) - 8; halves outside [2^-118, largest finite] (zero blocks, NaN,
// tiny amaxes) take fp8_block_scales<true>. Else each half through fp8_block_scales<kPow2>.
template <typename T, bool kPow2>
__device__ __forceinline__ BlockScales2 fp8_block_scales2(uint32_t amax2, const Fp8Rows& f) {
  BlockScales2 s;
  const float2 amax = Pack<T>::to_float2(amax2);
  if constexpr (kPow2 && std::is_same_v<T, __nv_bfloat16>) {
    const uint32_t lo = amax2 & 0xFFFFu, hi = amax2 >> 16;
    if (lo - 0x480u <= 0x7F7Fu - 0x480u && hi - 0x480u <= 0x7F7Fu - 0x480u) {
      const uint32_t t = (amax2 + 0x001F001Fu) & 0xFF80FF80u;  // no carry out of a half
      const uint32_t scales = 0x83008300u - t;                  // no borrow: t <= 0x7F80
      s.pair[0] = __byte_perm(scales, 0, 0x1010);
      s.pair[1] = __byte_perm(scales, 0, 0x3232);
      s.inv[0] = __uint_as_float((t << 16) - 0x04000000u);
      s.inv[1] = __uint_as_float((t & 0xFFFF0000u) - 0x04000000u);
      return s;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 one = fp8_block_scales<true>(j == 0 ? amax.x : amax.y, f);
      s.inv[j] = one.y;
      s.pair[j] = Pack<T>::from_float2(one.x, one.x);  // a power of two: exact in bf16
    }
  } else {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 one = fp8_block_scales<kPow2>(j == 0 ? amax.x : amax.y, f);
      s.scale[j] = one.x;
      s.inv[j] = one.y;
    }
  }
  return s;
}

// What a thread of an FP8-writing launch keeps across rows: the tensor scale, read once, and
// its running max |x| (tensor scale) as a word of two magnitudes of T (max_abs2's; signs
// arbitrary).
struct Fp8Acc {
  float scale;
  uint32_t amax2;
};

__device__ __forceinline__ Fp8Acc fp8_begin(const Fp8Rows& f) {
  return {f.mode == kFp8TensorScale ? *f.scale : 0.f, 0u};
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

// A vector of T's values times `scale`, as floats (fp32 products).
template <typename T>
__device__ __forceinline__ void scaled_vec(float (&x)[8], const Vec16& q, float scale) {
  set_vec<T>(x, q);
#pragma unroll
  for (int k = 0; k < 8; ++k) x[k] *= scale;
}

// A bf16 vector times a power-of-two scale given as a bf16 pair, as floats: one packed multiply
// a pair, exact (a power of two from 2^-126 to 2^127 is a bf16, and the products are at most 448
// in magnitude; one that underflows is below e4m3's half-spacing at zero either way).
__device__ __forceinline__ void scaled_pow2_bf16(float (&x)[8], Vec16 q, uint32_t pair) {
  const __nv_bfloat162 s2 = *reinterpret_cast<const __nv_bfloat162*>(&pair);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    __nv_bfloat162 h = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&q.u[k]), s2);
    q.u[k] = *reinterpret_cast<uint32_t*>(&h);
  }
  set_vec<__nv_bfloat16>(x, q);
}

// Packed maxima of magnitudes of two words of T pairs (max.xorsign.abs: the result's sign is
// the product of the operands'). NaNs are skipped as fmaxf skips them (NaN only where both are).
template <typename T>
__device__ __forceinline__ uint32_t max_abs2(uint32_t a, uint32_t b) {
  uint32_t m;
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("max.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  else
    asm("max.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  return m;
}

// Packed maxima of two words of non-negative T pairs (NaNs skipped as by max_abs2).
template <typename T>
__device__ __forceinline__ uint32_t max2(uint32_t a, uint32_t b) {
  uint32_t m;
  if constexpr (std::is_same_v<T, __nv_bfloat16>)
    asm("max.bf16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  else
    asm("max.f16x2 %0, %1, %2;" : "=r"(m) : "r"(a), "r"(b));
  return m;
}

// A vector's magnitudes folded to one word: max |x| over its even elements (lo) and its odd
// ones (hi), signs arbitrary.
template <typename T>
__device__ __forceinline__ uint32_t vec_max_abs2(const Vec16& q) {
  return max_abs2<T>(max_abs2<T>(q.u[0], q.u[1]), max_abs2<T>(q.u[2], q.u[3]));
}

// max |x| over vector a (lo) and over vector b (hi) in one word, signs cleared.
template <typename T>
__device__ __forceinline__ uint32_t pair_max_abs(const Vec16& a, const Vec16& b) {
  const uint32_t ma = vec_max_abs2<T>(a), mb = vec_max_abs2<T>(b);
  return max_abs2<T>(__byte_perm(ma, mb, 0x5410), __byte_perm(ma, mb, 0x7632)) & 0x7FFF7FFFu;
}

// Both halves of a word of non-negative T maxed over the 16 lanes of this lane's half-warp (a
// block of 128 columns is 16 aligned lanes' vectors): two blocks' amaxes in four shuffles.
template <typename T>
__device__ __forceinline__ uint32_t half_warp_max2(uint32_t m) {
#pragma unroll
  for (int o = 1; o < kFp8BlockLanes; o <<= 1) m = max2<T>(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Tensor scale: this thread's running amax into the quantizer's (every thread of the CTA calls
// it once, after its last row); CTA 0 also writes scale_inv.
template <typename T>
__device__ __forceinline__ void fp8_end(const Fp8Rows& f, const Fp8Acc& acc) {
  if (f.mode != kFp8TensorScale) return;
  const float2 m = Pack<T>::to_float2(acc.amax2 & 0x7FFF7FFFu);
  float amax = fmaxf(m.x, m.y);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  // Non-negative floats order as their bit patterns: an integer max is the float max.
  if ((threadIdx.x & 31) == 0 && amax > 0.f)
    atomicMax(reinterpret_cast<unsigned int*>(f.amax), __float_as_uint(amax));
  if (blockIdx.x == 0 && threadIdx.x == 0) f.scale_inv[0] = rcp_rn_subnormal(acc.scale);
}

}  // namespace tokenweave
