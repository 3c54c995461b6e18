// The one-shot path's launcher (oneshot.cuh): small replicated-layout calls.
#include "launch.cuh"
#include "tokenweave/oneshot.cuh"

namespace tokenweave {

template <typename T>
void launch_oneshot(const FusedParams& p, int64_t ctas, cudaStream_t stream) {
  const LaunchShape s = launch_shape(p.hidden);
  with_np_vpt(np_bucket(p.world), s.vpt, [&](auto np_c, auto vpt_c) {
    fused_allreduce_rmsnorm_oneshot_kernel<T, decltype(np_c)::value, decltype(vpt_c)::value>
        <<<grid_of(p.rows, ctas), s.threads, 0, stream>>>(p);
  });
  check_launch();
}

TOKENWEAVE_INSTANTIATE(launch_oneshot, const FusedParams&, int64_t, cudaStream_t);

}  // namespace tokenweave
