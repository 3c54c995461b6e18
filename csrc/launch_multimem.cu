// The multicast path's launcher. UNTESTED HERE (multicast is forbidden on this project's
// machines): see multimem.cuh. Its sm_90 PTX is checked for the NVLink SHARP instructions
// (.ci/compile_csrc.sh).
#include "launch.cuh"
#include "tokenweave/multimem.cuh"

namespace tokenweave {

template <typename T>
void launch_multimem(const FusedParams& p, int64_t ctas, char* mc, cudaStream_t stream) {
  const LaunchShape s = launch_shape(p.hidden);
  // The switch reduces: no per-rank template parameter (any np picks the same kernel).
  with_np_vpt(2, s.vpt, [&](auto, auto vpt_c) {
    fused_allreduce_rmsnorm_multimem_kernel<T, decltype(vpt_c)::value>
        <<<grid_of(p.rows, ctas), s.threads, 0, stream>>>(p, mc);
  });
  check_launch();
}

TOKENWEAVE_INSTANTIATE(launch_multimem, const FusedParams&, int64_t, char*, cudaStream_t);

}  // namespace tokenweave
