// The barrier paths' launcher (fused_allreduce_rmsnorm.cuh): the bulk-copy pipeline where its
// stages fit (ops.cu bulk_stages), else the register path.
#include <atomic>

#include "launch.cuh"

namespace tokenweave {
namespace {

// cudaFuncSetAttribute once per kernel instantiation (`done` is that instantiation's own flag
// word) and device, before its first launch there.
template <typename Kernel>
void allow_stage_smem(Kernel kernel, std::atomic<uint64_t>& done) {
  int dev = 0;
  TW_CHECK(cudaGetDevice(&dev) == cudaSuccess, "tokenweave: cudaGetDevice failed");
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStageSmemBytes);
  TW_CHECK(err == cudaSuccess, "tokenweave: cudaFuncSetAttribute failed: ",
           cudaGetErrorString(err));
  done.fetch_or(bit, std::memory_order_acq_rel);
}

template <typename T, int NP, int VPT>
void launch_bulk(const FusedParams& p, int grid, int threads, int stages, cudaStream_t stream) {
  static std::atomic<uint64_t> smem_set{0};  // one per <T, NP, VPT>
  auto kernel = fused_allreduce_rmsnorm_bulk_kernel<T, NP, VPT>;
  allow_stage_smem(kernel, smem_set);
  const size_t smem = static_cast<size_t>(stages) * (p.world + 1) * p.hidden * sizeof(T);
  kernel<<<grid, threads, smem, stream>>>(p, stages);
}

}  // namespace

template <typename T>
void launch_barrier_path(const FusedParams& p, int64_t ctas, int stages, cudaStream_t stream) {
  const LaunchShape s = launch_shape(p.hidden);
  with_np_vpt(np_bucket(p.world), s.vpt, [&](auto np_c, auto vpt_c) {
    constexpr int NP = decltype(np_c)::value, VPT = decltype(vpt_c)::value;
    if (stages > 0) {
      launch_bulk<T, NP, VPT>(p, grid_of(p.rows, ctas), s.threads, stages, stream);
    } else {
      constexpr int kRows = rows_per_iter(NP, VPT);
      fused_allreduce_rmsnorm_kernel<T, NP, VPT>
          <<<grid_of((p.rows + kRows - 1) / kRows, ctas), s.threads, 0, stream>>>(p);
    }
  });
  check_launch();
}

TOKENWEAVE_INSTANTIATE(launch_barrier_path, const FusedParams&, int64_t, int, cudaStream_t);

}  // namespace tokenweave
