// The fitted communicating GEMM's instantiations for fp16 (fit_gemm_host.cuh): both consumer
// modes, every token extent. One dtype per translation unit, so a build compiles them in parallel.
#define TOKENWEAVE_FIT_INSTANTIATE
#include "tokenweave/fit_gemm_host.cuh"

TOKENWEAVE_FIT_LAUNCHERS(, __half);
