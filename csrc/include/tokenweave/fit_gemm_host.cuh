// Host side of the fitted communicating GEMM (fit_gemm.cuh): the operands' tensor maps and the
// launch of the instantiation for the call's extent BN (the tiles' tokens, or with the tokens as
// M their weight rows). No torch here: ops.cu checks the call and turns a status into a Python
// error. The instantiations compile in csrc/launch_fit_gemm_{bf16,fp16,e4m3_bf16,e4m3_fp16,
// e4m3_blocks_bf16,e4m3_blocks_fp16}.cu (one operand dtype, scaling and output dtype each, both
// modes, every BN; 16-bit and per tensor also the cooperative mode in pairs) and, tokens as M,
// csrc/launch_fit_gemm_e4m3_blocks_tokens_m_{bf16,fp16}.cu (both modes, the weight extents of
// TokensMExtents).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <type_traits>
#include <utility>

#include "tokenweave/fit_gemm.cuh"

namespace tokenweave {
namespace fit {

enum class LaunchStatus { kOk, kNoDriverEntry, kTensorMap, kBadBN, kCuda };

// cuTensorMapEncodeTiled from the driver, looked up once (the runtime links no libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess)
      p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// The tensor maps' element type of an operand type (e4m3 moves as bytes).
template <typename In>
constexpr CUtensorMapDataType map_type() {
  return std::is_same<In, __nv_bfloat16>::value ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
         : std::is_same<In, __half>::value      ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                                : CU_TENSOR_MAP_DATA_TYPE_UINT8;
}

// A row-major 2-D tensor map: [rows, inner] elements of `type`, rows `row_bytes` apart, moved in
// boxes of box_inner x box_rows.
inline bool encode_2d(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, int64_t inner,
                      int64_t rows, int64_t row_bytes, int box_inner, int box_rows,
                      CUtensorMapSwizzle swizzle, CUtensorMapL2promotion promotion) {
  const auto encode = encode_fn();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(inner), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_bytes)};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_inner),
                             static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, type, 2, const_cast<void*>(ptr), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A row-major [rows, inner] matrix of In whose rows start `pitch` elements apart (a multiple of
// 16 bytes, at least `inner`), moved in boxes of box_rows x 128 bytes (128-byte swizzle: what
// smem_desc_k128 and fit::stage_offset describe).
template <typename In>
bool make_map(CUtensorMap* map, const void* ptr, int64_t inner, int64_t rows, int64_t pitch,
              int box_rows) {
  return encode_2d(map, map_type<In>(), ptr, inner, rows, pitch * sizeof(In),
                   Operand<In>::kStageK, box_rows, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
}

// x's block scales [k_blocks, cols] fp32 (ops/fp8_operands.py; cols a multiple of 4, at least x's
// rows), moved in boxes of one K block's `box` tokens (unswizzled; tokens past cols land as
// zeros).
inline bool make_scale_map(CUtensorMap* map, const float* ptr, int64_t cols, int64_t k_blocks,
                           int box) {
  return encode_2d(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, ptr, cols, k_blocks,
                   cols * static_cast<int64_t>(sizeof(float)), box, 1, CU_TENSOR_MAP_SWIZZLE_NONE,
                   CU_TENSOR_MAP_L2_PROMOTION_NONE);
}

// f(std::integral_constant<int, v>{}) where v is one of V (false where it is none).
template <typename F, int... V>
bool with_value(int v, F&& f, std::integer_sequence<int, V...>) {
  return ((v == V ? (f(std::integral_constant<int, V>{}), true) : false) || ...);
}
template <int... V>
constexpr bool one_of(int v, std::integer_sequence<int, V...>) {
  return ((v == V) || ...);
}
// The values of V as text, comma-separated (error messages name what is instantiated).
template <int... V>
std::string spelled(std::integer_sequence<int, V...>) {
  std::string s;
  ((s += (s.empty() ? "" : ", ") + std::to_string(V)), ...);
  return s;
}

// The token extents: 8 * q for q in kMinBN / 8 .. kMax / 8.
template <int kMax, int... Q>
constexpr auto bn_range(std::integer_sequence<int, Q...>) {
  return std::integer_sequence<int, (kMinBN + 8 * Q)...>{};
}
template <int kMax>
using BnRange =
    decltype(bn_range<kMax>(std::make_integer_sequence<int, (kMax - kMinBN) / 8 + 1>{}));

// Tokens as M: the weight extents instantiated (ops/segments.FIT_TOKENS_M_EXTENTS). Each takes a
// main loop per place of a tile's first weight row in its block (fit_gemm.cuh RowScales):
// kBlockK / gcd(BN, kBlockK) of them, so few extents with a large power of two.
using TokensMExtents = std::integer_sequence<int, 64, 96, 128, 144, 160, 176, 192, 208>;

// Split K: the CTAs that deal out the split tiles' K steps, p.split_steps each.
inline int64_t split_ctas(const FitGemmParams& p, int stage_k) {
  const int64_t steps = static_cast<int64_t>(p.split_tiles) * ((p.k + stage_k - 1) / stage_k);
  return (steps + p.split_steps - 1) / p.split_steps;
}

// Queue the GEMM: x [x_rows, k] and w [n_out, k] row-major In, their rows x_pitch and w_pitch
// elements apart, rows of T into the inboxes (p.scale_inv set for e4m3 operands; kBlocks: x's
// block scales at x_scales, `scale_cols` apart (p.xs_stride), and p.ws_stride / p.w_blocks the
// weight's), p's geometry for tiles of bn tokens (kTokensM: of bn weight rows, 64 tokens a
// consumer), on `ctas` persistent CTAs (kPair: clusters of two, p.tiles the pairs' units of
// work). x's map ends at its x_rows rows: a tile's rows past them land as zeros (never stored),
// so x needs no rows past the call's.
template <typename T, typename In, bool kCoop, bool kBlocks, bool kTokensM, bool kPair>
LaunchStatus launch(const void* x, int64_t x_rows, int64_t x_pitch, const void* w,
                    int64_t w_pitch, const float* x_scales, int64_t scale_cols,
                    const FitGemmParams& p, int bn, int ctas, cudaStream_t stream) {
  CUtensorMap w_map, x_map, s_map{};
  if (encode_fn() == nullptr) return LaunchStatus::kNoDriverEntry;
  // Rows of a tile's A (the MMA's M operand: the weight's, or with kTokensM the tokens').
  const int tile_a = (kCoop ? 2 : 1) * (kTokensM ? kHalfM : consumer_rows(bn, kBlocks));
  // Pairs: each CTA copies half of a tile's weight rows (into both CTAs).
  if (!make_map<In>(&w_map, w, p.k, p.n_out, w_pitch, kTokensM ? bn : tile_a / (kPair ? 2 : 1)) ||
      !make_map<In>(&x_map, x, p.k, x_rows, x_pitch, kTokensM ? tile_a : bn) ||
      (kBlocks && !kTokensM &&
       !make_scale_map(&s_map, x_scales, scale_cols,
                       (p.k + Operand<In>::kStageK - 1) / Operand<In>::kStageK, bn + kScaleLead)))
    return LaunchStatus::kTensorMap;
  cudaError_t err = cudaSuccess;
  const auto go = [&](auto bn_c) {
    constexpr int BN = decltype(bn_c)::value;
    using S = Shape<BN, kCoop, kBlocks, kTokensM, kPair>;
    auto kernel = fit_gemm_kernel<T, In, BN, kCoop, kBlocks, kTokensM, kPair>;
    // The shared-memory limit is an attribute of the function on each device: raised once per
    // device (a bit per device of this instantiation).
    static std::atomic<uint64_t> raised{0};
    int device = 0;
    err = cudaGetDevice(&device);
    if (err != cudaSuccess) return;
    const uint64_t bit = uint64_t{1} << (device & 63);
    if ((raised.load(std::memory_order_relaxed) & bit) == 0) {
      err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmem);
      if (err != cudaSuccess) return;
      raised.fetch_or(bit, std::memory_order_relaxed);
    }
    int clusters = ctas / S::kCtas;
    if constexpr (kPair) {
      cudaLaunchAttribute cluster[1];
      cluster[0].id = cudaLaunchAttributeClusterDimension;
      cluster[0].val.clusterDim.x = S::kCtas;
      cluster[0].val.clusterDim.y = 1;
      cluster[0].val.clusterDim.z = 1;
      cudaLaunchConfig_t config{};
      config.blockDim = dim3(kThreads);
      config.dynamicSmemBytes = S::kSmem;
      config.stream = stream;
      config.attrs = cluster;
      config.numAttrs = 1;
      // No more clusters than fit at once (both CTAs of one in a GPC: a GPC with an odd count
      // of free SMs leaves one idle), so every cluster is persistent and none waits for a
      // second wave. Queried once per device (a host query, no stream work).
      static std::atomic<int> resident[64];
      int fit = resident[device & 63].load(std::memory_order_relaxed);
      if (fit == 0) {  // -1: the query found none (the launch then reports why)
        config.gridDim = dim3(S::kCtas * clusters);
        err = cudaOccupancyMaxActiveClusters(&fit, kernel, &config);
        if (err != cudaSuccess) return;
        if (fit == 0) fit = -1;
        resident[device & 63].store(fit, std::memory_order_relaxed);
      }
      if (fit > 0 && fit < clusters) clusters = fit;
      config.gridDim = dim3((p.tiles < clusters ? p.tiles : clusters) * S::kCtas);
      err = cudaLaunchKernelEx(&config, kernel, w_map, x_map, s_map, p);
    } else {
      // Split K: every CTA given, whose count the whole tiles' waves assume (Work; ops.cu
      // checks that the split tiles' shares fit).
      const int units = p.split_tiles > 0 ? clusters : p.tiles;
      const int grid = (units < clusters ? units : clusters) * S::kCtas;
      kernel<<<grid, kThreads, S::kSmem, stream>>>(w_map, x_map, s_map, p);
      err = cudaPeekAtLastError();  // left for the caller's message
    }
  };
  bool known;
  if constexpr (kTokensM)
    known = with_value(bn, go, TokensMExtents{});
  else
    known = with_value(bn, go, BnRange<max_bn(kCoop, kBlocks, kPair)>{});
  if (!known) return LaunchStatus::kBadBN;
  return err == cudaSuccess ? LaunchStatus::kOk : LaunchStatus::kCuda;
}

}  // namespace fit
}  // namespace tokenweave

// The instantiations of both modes for one output dtype, operand dtype, scaling and layout
// (`extern` where they are used, defined in csrc/launch_fit_gemm_*.cu, one translation unit
// each).
#define TOKENWEAVE_FIT_LAUNCHER(PREFIX, T, In, COOP, BLOCKS, TOKENS_M, PAIR)                    \
  PREFIX template tokenweave::fit::LaunchStatus                                               \
  tokenweave::fit::launch<T, In, COOP, BLOCKS, TOKENS_M, PAIR>(                               \
      const void*, int64_t, int64_t, const void*, int64_t, const float*, int64_t,             \
      const tokenweave::fit::FitGemmParams&, int, int, cudaStream_t)
#define TOKENWEAVE_FIT_LAUNCHERS(PREFIX, T, In, BLOCKS, TOKENS_M)                             \
  TOKENWEAVE_FIT_LAUNCHER(PREFIX, T, In, false, BLOCKS, TOKENS_M, false);                     \
  TOKENWEAVE_FIT_LAUNCHER(PREFIX, T, In, true, BLOCKS, TOKENS_M, false)
// The cooperative mode in pairs (not in blocks: operands 16-bit or e4m3 per tensor).
#define TOKENWEAVE_FIT_PAIR_LAUNCHER(PREFIX, T, In) \
  TOKENWEAVE_FIT_LAUNCHER(PREFIX, T, In, true, false, false, true)

#ifndef TOKENWEAVE_FIT_INSTANTIATE
TOKENWEAVE_FIT_LAUNCHERS(extern, __nv_bfloat16, __nv_bfloat16, false, false);
TOKENWEAVE_FIT_LAUNCHERS(extern, __half, __half, false, false);
TOKENWEAVE_FIT_LAUNCHERS(extern, __nv_bfloat16, __nv_fp8_e4m3, false, false);
TOKENWEAVE_FIT_LAUNCHERS(extern, __half, __nv_fp8_e4m3, false, false);
TOKENWEAVE_FIT_LAUNCHERS(extern, __nv_bfloat16, __nv_fp8_e4m3, true, false);
TOKENWEAVE_FIT_LAUNCHERS(extern, __half, __nv_fp8_e4m3, true, false);
TOKENWEAVE_FIT_LAUNCHERS(extern, __nv_bfloat16, __nv_fp8_e4m3, true, true);
TOKENWEAVE_FIT_LAUNCHERS(extern, __half, __nv_fp8_e4m3, true, true);
TOKENWEAVE_FIT_PAIR_LAUNCHER(extern, __nv_bfloat16, __nv_bfloat16);
TOKENWEAVE_FIT_PAIR_LAUNCHER(extern, __half, __half);
TOKENWEAVE_FIT_PAIR_LAUNCHER(extern, __nv_bfloat16, __nv_fp8_e4m3);
TOKENWEAVE_FIT_PAIR_LAUNCHER(extern, __half, __nv_fp8_e4m3);
#endif
