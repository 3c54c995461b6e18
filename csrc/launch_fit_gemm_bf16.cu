// The fitted communicating GEMM's instantiations for bf16 operands and rows
// (fit_gemm_host.cuh): both consumer modes, every token extent. One dtype pair per translation
// unit, so a build compiles them in parallel.
#define TOKENWEAVE_FIT_INSTANTIATE
#include "tokenweave/fit_gemm_host.cuh"

TOKENWEAVE_FIT_LAUNCHERS(, __nv_bfloat16, __nv_bfloat16, false, false);
