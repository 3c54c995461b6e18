// A reference for benchmarks, not part of the extension: CUTLASS's sm90 GEMM (its 3.x API)
// D[M, N] = A[M, K] @ W[N, K]^T in bf16 (fp32 accumulation), with its tile shape, cluster shape
// and kernel schedule as template parameters, so the communicating GEMM can be timed against
// CUTLASS's warp-specialized kernels, TMA multicast across a cluster included.
// megatron_tokenweave/bench/cutlass_gemm.py builds one translation unit per configuration, each
// defining TOKENWEAVE_CUTLASS_GEMM(name, ...) from this header.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <tuple>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

namespace tokenweave_bench {

template <class TileShape, class ClusterShape, class MainloopSchedule, class EpilogueSchedule>
struct CutlassGemm {
  using Element = cutlass::bfloat16_t;
  static constexpr int kAlign = 8;  // 16-byte rows: K and N multiples of 8
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, Element,
      cutlass::layout::RowMajor, kAlign, Element, cutlass::layout::RowMajor, kAlign,
      EpilogueSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor,
      kAlign, Element, cutlass::layout::ColumnMajor, kAlign, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // Initialized once per (operands, shape): a call then only launches, so a CUDA graph of calls
  // times the kernel alone.
  std::map<std::tuple<void*, void*, void*, int64_t, int64_t, int64_t>,
           std::pair<std::unique_ptr<Gemm>, torch::Tensor>>
      prepared;

  void operator()(const torch::Tensor& a, const torch::Tensor& w, torch::Tensor& d,
                  int64_t stream_handle) {
    TORCH_CHECK(a.is_cuda() && a.scalar_type() == torch::kBFloat16 && a.dim() == 2 &&
                    a.is_contiguous(), "a: a contiguous bf16 CUDA matrix [M, K]");
    TORCH_CHECK(w.is_cuda() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2 &&
                    w.is_contiguous() && w.size(1) == a.size(1),
                "w: a contiguous bf16 CUDA matrix [N, K]");
    TORCH_CHECK(d.is_cuda() && d.scalar_type() == torch::kBFloat16 && d.dim() == 2 &&
                    d.is_contiguous() && d.size(0) == a.size(0) && d.size(1) == w.size(0),
                "d: a contiguous bf16 CUDA matrix [M, N]");
    TORCH_CHECK(w.device() == a.device() && d.device() == a.device(),
                "a, w and d must be on one GPU");
    int current = -1;
    TORCH_CHECK(cudaGetDevice(&current) == cudaSuccess && current == a.device().index(),
                "the current CUDA device must be the operands' (torch.cuda.device(...))");
    TORCH_CHECK(a.size(0) > 0 && a.size(0) <= INT32_MAX && w.size(0) <= INT32_MAX,
                "M must be in 1 .. 2^31 - 1");
    TORCH_CHECK(a.size(1) % kAlign == 0 && w.size(0) % kAlign == 0,
                "K and N must be multiples of 8");
    for (const void* p : {a.data_ptr(), w.data_ptr(), d.data_ptr()}) {
      TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0,
                  "operands must start 16-byte aligned (TMA)");
    }
    const int m = a.size(0), k = a.size(1), n = w.size(0);
    auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    auto key = std::make_tuple(a.data_ptr(), w.data_ptr(), d.data_ptr(), int64_t(m), int64_t(n),
                               int64_t(k));
    auto it = prepared.find(key);
    if (it == prepared.end()) {
      using cute::make_shape;
      auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(m, k, 1));
      auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(n, k, 1));
      auto sc = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, make_shape(m, n, 1));
      auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(m, n, 1));
      cutlass::KernelHardwareInfo hw;
      hw.device_id = a.device().index();
      hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw.device_id);
      auto* pa = reinterpret_cast<Element*>(a.data_ptr());
      auto* pw = reinterpret_cast<Element*>(w.data_ptr());
      auto* pd = reinterpret_cast<Element*>(d.data_ptr());
      typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                    {m, n, k, 1},
                                    {pa, sa, pw, sb},
                                    {{1.0f, 0.0f}, pd, sc, pd, sd},
                                    hw};
      auto gemm = std::make_unique<Gemm>();
      TORCH_CHECK(gemm->can_implement(args) == cutlass::Status::kSuccess,
                  "CUTLASS cannot run this configuration on these operands");
      auto workspace = torch::empty({int64_t(std::max<size_t>(Gemm::get_workspace_size(args), 1))},
                                    a.options().dtype(torch::kUInt8));
      TORCH_CHECK(gemm->initialize(args, workspace.data_ptr(), stream) == cutlass::Status::kSuccess,
                  "CUTLASS GEMM initialization failed");
      it = prepared.emplace(key, std::make_pair(std::move(gemm), workspace)).first;
    }
    TORCH_CHECK(it->second.first->run(stream) == cutlass::Status::kSuccess,
                "CUTLASS GEMM launch failed");
  }
};

}  // namespace tokenweave_bench

#define TOKENWEAVE_CUTLASS_GEMM(NAME, TILE, CLUSTER, MAINLOOP, EPILOGUE)                   \
  void NAME(const torch::Tensor& a, const torch::Tensor& w, torch::Tensor& d, int64_t s) { \
    static tokenweave_bench::CutlassGemm<TILE, CLUSTER, MAINLOOP, EPILOGUE> gemm;           \
    gemm(a, w, d, s);                                                                        \
  }
