// The GEMM-fused path's consumer launcher (gemm_reduce.cuh); ops.cu fills its InboxParams.
#include "launch.cuh"

namespace tokenweave {

template <typename T>
void launch_gemm_reduce_kernel(const FusedParams& p, const InboxParams& g, int64_t seg_rows,
                               int64_t ctas, cudaStream_t stream) {
  const LaunchShape shape = launch_shape(p.hidden);
  with_np_vpt(np_bucket(p.world), shape.vpt, [&](auto np_c, auto vpt_c) {
    gemm_reduce_rmsnorm_kernel<T, decltype(np_c)::value, decltype(vpt_c)::value>
        <<<grid_of(seg_rows, ctas), shape.threads, 0, stream>>>(p, g);
  });
  check_launch();
}

TOKENWEAVE_INSTANTIATE(launch_gemm_reduce_kernel, const FusedParams&, const InboxParams&,
                       int64_t, int64_t, cudaStream_t);

}  // namespace tokenweave
