// The fitted communicating GEMM's instantiations for e4m3 operands scaled in blocks (TE's
// blockwise recipe), fp16 rows (fit_gemm_host.cuh): both consumer modes, token extents up to
// kMaxWideBN. One dtype pair and scaling per translation unit, so a build compiles them in
// parallel.
#define TOKENWEAVE_FIT_INSTANTIATE
#include "tokenweave/fit_gemm_host.cuh"

TOKENWEAVE_FIT_LAUNCHERS(, __half, __nv_fp8_e4m3, true, false);
