// The fitted communicating GEMM's instantiations for e4m3 operands scaled per tensor, fp16 rows
// (fit_gemm_host.cuh): both consumer modes and the cooperative one in pairs, every token extent.
// One dtype pair per translation unit, so a build compiles them in parallel.
#define TOKENWEAVE_FIT_INSTANTIATE
#include "tokenweave/fit_gemm_host.cuh"

TOKENWEAVE_FIT_LAUNCHERS(, __half, __nv_fp8_e4m3, false, false);
TOKENWEAVE_FIT_PAIR_LAUNCHER(, __half, __nv_fp8_e4m3);
