// Shared helpers of the tokenweave kernels: 16-byte vectors, dtype conversions, limits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace tokenweave {

// Limits of the kernels (the Python wrapper checks them first and raises TokenWeaveInputError).
constexpr int kMaxRanks = 8;          // TP 2..8
constexpr int kMaxCtas = 128;         // CTAs per launch (signal pad slots)
constexpr int kVecBytes = 16;         // one vector = 16 bytes = 8 bf16/fp16 elements
constexpr int kVecElems = 8;
constexpr int kMaxThreads = 512;      // threads per CTA
constexpr int kMaxVecsPerThread = 8;  // => hidden <= 512 * 8 * 8 = 32768

// 16 bytes, loaded/stored as one ld.global.v4 / st.global.v4.
struct __align__(16) Vec16 {
  uint32_t u[4];
};

template <typename T>
struct Pack;  // two elements of T in a 32-bit word, converted to/from float2

template <>
struct Pack<__nv_bfloat16> {
  // A bf16 is the top half of its float: one shift and one mask (the intrinsic's 16-bit
  // moves cost a byte permute and a shift for the high element).
  static __device__ __forceinline__ float2 to_float2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xFFFF0000u));
  }
  static __device__ __forceinline__ uint32_t from_float2(float a, float b) {
    __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

template <>
struct Pack<__half> {
  static __device__ __forceinline__ float2 to_float2(uint32_t w) {
    __half2 h = *reinterpret_cast<__half2*>(&w);
    return __half22float2(h);
  }
  static __device__ __forceinline__ uint32_t from_float2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
  }
};

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

// One 16-byte load, `op` the PTX instruction with its state space and cache qualifiers.
#define TOKENWEAVE_LOAD_V4(op, v, p)                                                \
  asm volatile(op " {%0,%1,%2,%3}, [%4];"                                           \
               : "=r"((v).u[0]), "=r"((v).u[1]), "=r"((v).u[2]), "=r"((v).u[3])     \
               : "l"(p)                                                             \
               : "memory")

__device__ __forceinline__ Vec16 load_vec(const void* p) {
  Vec16 v;
  TOKENWEAVE_LOAD_V4("ld.global.v4.u32", v, p);
  return v;
}

// The same at L2 only (.cg): for data a peer wrote during this launch (after a barrier), which an
// L1 line filled earlier in the launch (a neighbouring row's bytes) must not shadow.
__device__ __forceinline__ Vec16 load_vec_l2(const void* p) {
  Vec16 v;
  TOKENWEAVE_LOAD_V4("ld.global.cg.v4.u32", v, p);
  return v;
}

__device__ __forceinline__ void store_vec(void* p, const Vec16& v) {
  asm volatile("st.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.u[0]), "r"(v.u[1]),
               "r"(v.u[2]), "r"(v.u[3])
               : "memory");
}

// Unpack 8 elements of T from a vector, accumulate into acc[8] (fp32).
template <typename T>
__device__ __forceinline__ void add_vec(float (&acc)[8], const Vec16& v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 f = Pack<T>::to_float2(v.u[k]);
    acc[2 * k] += f.x;
    acc[2 * k + 1] += f.y;
  }
}

template <typename T>
__device__ __forceinline__ void set_vec(float (&acc)[8], const Vec16& v) {
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    float2 f = Pack<T>::to_float2(v.u[k]);
    acc[2 * k] = f.x;
    acc[2 * k + 1] = f.y;
  }
}

template <typename T>
__device__ __forceinline__ Vec16 pack_vec(const float (&x)[8]) {
  Vec16 v;
#pragma unroll
  for (int k = 0; k < 4; ++k) v.u[k] = Pack<T>::from_float2(x[2 * k], x[2 * k + 1]);
  return v;
}

}  // namespace tokenweave
