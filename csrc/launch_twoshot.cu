// The two-shot path's launcher (twoshot.cuh): larger replicated-layout calls from 4 ranks on.
#include "launch.cuh"
#include "tokenweave/twoshot.cuh"

namespace tokenweave {

template <typename T>
void launch_twoshot(const FusedParams& p, int64_t ctas, cudaStream_t stream) {
  const LaunchShape s = launch_shape(p.hidden);
  const int64_t chunk_rows = (p.rows + p.world - 1) / p.world;
  with_np_vpt(np_bucket(p.world), s.vpt, [&](auto np_c, auto vpt_c) {
    fused_allreduce_rmsnorm_twoshot_kernel<T, decltype(np_c)::value, decltype(vpt_c)::value>
        <<<grid_of(chunk_rows, ctas), s.threads, 0, stream>>>(p);
  });
  check_launch();
}

TOKENWEAVE_INSTANTIATE(launch_twoshot, const FusedParams&, int64_t, cudaStream_t);

}  // namespace tokenweave
