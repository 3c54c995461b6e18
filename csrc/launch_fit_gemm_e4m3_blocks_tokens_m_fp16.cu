// The fitted communicating GEMM's instantiations for e4m3 operands scaled in blocks with the
// tokens as the MMA's M, fp16 rows (fit_gemm_host.cuh): both consumer modes, the weight extents of
// TokensMExtents. One dtype pair, scaling and layout per translation unit, so a build compiles
// them in parallel.
#define TOKENWEAVE_FIT_INSTANTIATE
#include "tokenweave/fit_gemm_host.cuh"

TOKENWEAVE_FIT_LAUNCHERS(, __half, __nv_fp8_e4m3, true, true);
