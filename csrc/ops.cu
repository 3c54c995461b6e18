// torch.library bindings of the fused all-reduce + residual add + RMSNorm kernels.
// Schemas (vLLM style: mutated arguments annotated Tensor(a!)) are defined here; the CUDA
// implementations are registered with TORCH_LIBRARY_IMPL; fake implementations live in Python
// (megatron_tokenweave/kernels/_ext.py). The Python wrapper validates first and raises
// TokenWeaveInputError; the TORCH_CHECKs below are the last line of defence. No host sync, no
// allocation: the ops only enqueue kernels (one; the copy-engine op: barrier kernels, copies and
// one kernel) on the current stream (CUDA-graph capturable).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <optional>
#include <type_traits>

#include "tokenweave/copy_engine.cuh"
#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/multimem.cuh"
#include "tokenweave/oneshot.cuh"

namespace tokenweave {
namespace {

struct LaunchShape {
  int vpt;
  int threads;
};

LaunchShape launch_shape(int64_t hidden) {
  const int64_t hv = hidden / kVecElems;
  for (int vpt = 1; vpt <= kMaxVecsPerThread; vpt *= 2) {
    const int64_t t = (hv + vpt - 1) / vpt;
    if (t <= kMaxThreads) return {vpt, static_cast<int>(((t + 31) / 32) * 32)};
  }
  TORCH_CHECK(false, "tokenweave: hidden ", hidden, " too large (max ",
              kMaxThreads * kMaxVecsPerThread * kVecElems, ")");
  return {0, 0};
}

int np_bucket(int64_t world) { return world <= 2 ? 2 : (world <= 4 ? 4 : 8); }

// The kernels move 16-byte vectors (and bulk copies of whole rows) from and to every tensor.
void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % kVecBytes == 0, "tokenweave: ", name,
              " is not 16-byte aligned");
}

void check_in_buffer(const at::Tensor& t, const char* name, int64_t local_base,
                     int64_t buffer_bytes, int64_t extent_bytes) {
  const int64_t off = reinterpret_cast<int64_t>(t.data_ptr()) - local_base;
  TORCH_CHECK(off >= 0 && off + extent_bytes <= buffer_bytes, "tokenweave: ", name,
              " is not inside the symmetric buffer (offset ", off, ", extent ", extent_bytes,
              ", buffer ", buffer_bytes, " bytes)");
  TORCH_CHECK(off % kVecBytes == 0, "tokenweave: ", name, " is not 16-byte aligned");
}

FusedParams make_params(const at::Tensor& partial, const at::Tensor& residual,
                        const std::optional<at::Tensor>& weight, double eps,
                        at::Tensor& residual_out, const std::optional<at::Tensor>& normed_out,
                        bool sequence_parallel, const at::Tensor& bases, int64_t rank,
                        int64_t world, int64_t local_base, int64_t buffer_bytes, int64_t ctas,
                        int64_t timeout_ns) {
  TORCH_CHECK(partial.is_cuda() && partial.dim() == 3 && partial.is_contiguous(),
              "tokenweave: partial must be a contiguous [chunks, rows, hidden] CUDA tensor");
  const auto dt = partial.scalar_type();
  TORCH_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "tokenweave: dtype must be bf16 or fp16");
  TORCH_CHECK(world >= 2 && world <= kMaxRanks, "tokenweave: world size ", world,
              " out of range 2..", kMaxRanks);
  TORCH_CHECK(rank >= 0 && rank < world, "tokenweave: bad rank ", rank);
  TORCH_CHECK(ctas >= 1 && ctas <= kMaxCtas, "tokenweave: ctas ", ctas, " out of range 1..",
              kMaxCtas);
  TORCH_CHECK(bases.is_cuda() && bases.scalar_type() == at::kLong && bases.numel() == 2 * world,
              "tokenweave: bases must be a CUDA int64 tensor of 2 * world entries");
  const int64_t chunks = partial.size(0), rows = partial.size(1), hidden = partial.size(2);
  TORCH_CHECK(chunks == (sequence_parallel ? world : 1), "tokenweave: partial has ", chunks,
              " chunks");
  TORCH_CHECK(hidden % kVecElems == 0, "tokenweave: hidden must be a multiple of 8");
  TORCH_CHECK(rows < (int64_t{1} << 31) / 4, "tokenweave: too many rows");
  const int64_t es = partial.element_size();
  for (const at::Tensor* t : {&residual, static_cast<const at::Tensor*>(&residual_out)}) {
    TORCH_CHECK(t->device() == partial.device() && t->scalar_type() == dt &&
                    t->is_contiguous() && t->numel() == rows * hidden,
                "tokenweave: residual/residual_out must be contiguous [rows, hidden] of partial's "
                "dtype on its device");
    check_aligned(*t, "residual/residual_out");
  }
  check_in_buffer(partial, "partial", local_base, buffer_bytes, chunks * rows * hidden * es);

  FusedParams p{};
  p.bases = bases.data_ptr<int64_t>();
  p.partial_off = reinterpret_cast<int64_t>(partial.data_ptr()) - local_base;
  p.partial_cstride = rows * hidden * es;
  p.residual = residual.data_ptr();
  p.residual_out = residual_out.data_ptr();
  p.rows = static_cast<int>(rows);
  p.hidden = static_cast<int>(hidden);
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(world);
  p.sequence_parallel = sequence_parallel ? 1 : 0;
  p.eps = static_cast<float>(eps);
  p.timeout_ns = static_cast<uint64_t>(timeout_ns);
  const char* dbg = std::getenv("TOKENWEAVE_DEBUG_LOCAL_STORES");
  p.debug_local_stores = (dbg != nullptr && dbg[0] == '1') ? 1 : 0;
  if (weight.has_value()) {
    TORCH_CHECK(normed_out.has_value(), "tokenweave: normed_out required with a weight");
    const at::Tensor& w = *weight;
    const at::Tensor& no = *normed_out;
    TORCH_CHECK(w.device() == partial.device() && w.scalar_type() == dt && w.is_contiguous() &&
                    w.numel() == hidden,
                "tokenweave: weight must be a contiguous [hidden] tensor of partial's dtype on "
                "its device");
    check_aligned(w, "weight");
    check_aligned(no, "normed_out");
    TORCH_CHECK(no.device() == partial.device() && no.scalar_type() == dt && no.dim() == 3 &&
                    no.size(0) == chunks && no.size(1) == rows && no.size(2) == hidden &&
                    no.stride(2) == 1 && (rows <= 1 || no.stride(1) == hidden),
                "tokenweave: normed_out must be [chunks, rows, hidden] with dense rows");
    p.weight = w.data_ptr();
    if (sequence_parallel) {
      TORCH_CHECK(chunks == 1 || no.stride(0) >= 0, "tokenweave: negative normed_out stride");
      const int64_t extent = ((chunks - 1) * no.stride(0) + rows * hidden) * es;
      check_in_buffer(no, "normed_out", local_base, buffer_bytes, extent);
      TORCH_CHECK((no.stride(0) * es) % kVecBytes == 0,
                  "tokenweave: normed_out chunk stride must be a multiple of 16 bytes");
      p.normed_off = reinterpret_cast<int64_t>(no.data_ptr()) - local_base;
      p.normed_cstride = no.stride(0) * es;
    } else {
      p.normed_local = no.data_ptr();
    }
  } else {
    TORCH_CHECK(!normed_out.has_value(), "tokenweave: normed_out given without a weight");
  }
  return p;
}

// Stages of the bulk-copy pipeline for this shape, or 0 to use the register path: fewer than 2
// stages of `world` + 1 rows fit in kStageSmemBytes, or TOKENWEAVE_NO_BULK=1 (read at every launch;
// for benchmarks and debugging).
int bulk_stages(int world, int64_t hidden, int64_t elem_bytes) {
  const char* off = std::getenv("TOKENWEAVE_NO_BULK");
  if (off != nullptr && off[0] == '1') return 0;
  const int64_t stage = (world + 1) * hidden * elem_bytes;
  const int64_t n = kStageSmemBytes / stage;
  return n < 2 ? 0 : static_cast<int>(n < kMaxStages ? n : kMaxStages);
}

// cudaFuncSetAttribute once per kernel instantiation (`done` is that instantiation's own flag
// word) and device, before its first launch there.
template <typename Kernel>
void allow_stage_smem(Kernel kernel, std::atomic<uint64_t>& done) {
  int dev = 0;
  TORCH_CHECK(cudaGetDevice(&dev) == cudaSuccess, "tokenweave: cudaGetDevice failed");
  const uint64_t bit = uint64_t{1} << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return;
  const cudaError_t err = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStageSmemBytes);
  TORCH_CHECK(err == cudaSuccess, "tokenweave: cudaFuncSetAttribute failed: ",
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

// Calls f(NP, VPT) with both as std::integral_constant for the runtime (np, vpt): the one place
// where the kernels' template instantiations are chosen.
template <typename F>
void with_np_vpt(int np, int vpt, F&& f) {
  auto by_vpt = [&](auto np_c) {
    switch (vpt) {
      case 1: f(np_c, std::integral_constant<int, 1>{}); break;
      case 2: f(np_c, std::integral_constant<int, 2>{}); break;
      case 4: f(np_c, std::integral_constant<int, 4>{}); break;
      default: f(np_c, std::integral_constant<int, 8>{}); break;
    }
  };
  switch (np) {
    case 2: by_vpt(std::integral_constant<int, 2>{}); break;
    case 4: by_vpt(std::integral_constant<int, 4>{}); break;
    default: by_vpt(std::integral_constant<int, 8>{}); break;
  }
}

void check_launch() {
  const cudaError_t err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "tokenweave: kernel launch failed: ", cudaGetErrorString(err));
}

int grid_of(int64_t units, int64_t ctas) { return static_cast<int>(units < ctas ? units : ctas); }

// The SM-driven barrier paths: the bulk-copy pipeline where its stages fit, else registers.
template <typename T>
void launch_p2p(const FusedParams& p, int64_t ctas, cudaStream_t stream) {
  const LaunchShape s = launch_shape(p.hidden);
  const int stages = bulk_stages(p.world, p.hidden, sizeof(T));
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

// The one-shot path takes replicated-layout calls whose P rows per row fit one receive buffer,
// unless TOKENWEAVE_NO_ONESHOT=1 (read at every launch; benchmarks and tests).
bool use_oneshot(const FusedParams& p, int64_t elem_bytes) {
  const char* off = std::getenv("TOKENWEAVE_NO_ONESHOT");
  if (off != nullptr && off[0] == '1') return false;
  return !p.sequence_parallel && p.world * static_cast<int64_t>(p.rows) * p.hidden * elem_bytes <=
                                     kOneShotRoundBytes;
}

template <typename T>
void launch_oneshot(const FusedParams& p, int64_t ctas, cudaStream_t stream) {
  const LaunchShape s = launch_shape(p.hidden);
  with_np_vpt(np_bucket(p.world), s.vpt, [&](auto np_c, auto vpt_c) {
    fused_allreduce_rmsnorm_oneshot_kernel<T, decltype(np_c)::value, decltype(vpt_c)::value>
        <<<grid_of(p.rows, ctas), s.threads, 0, stream>>>(p);
  });
  check_launch();
}

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

}  // namespace

void fused_allreduce_rmsnorm(const at::Tensor& partial, const at::Tensor& residual,
                             const std::optional<at::Tensor>& weight, double eps,
                             at::Tensor& residual_out, const std::optional<at::Tensor>& normed_out,
                             bool sequence_parallel, const at::Tensor& bases, at::Tensor& signal,
                             int64_t rank, int64_t world, int64_t local_base,
                             int64_t buffer_bytes, int64_t ctas, int64_t timeout_ns) {
  (void)signal;  // the kernel reaches the pads through `bases`; the argument orders the op
  const FusedParams p = make_params(partial, residual, weight, eps, residual_out, normed_out,
                                    sequence_parallel, bases, rank, world, local_base,
                                    buffer_bytes, ctas, timeout_ns);
  if (p.rows == 0) return;
  c10::cuda::CUDAGuard guard(partial.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(partial.get_device()).stream();
  const bool bf16 = partial.scalar_type() == at::kBFloat16;
  if (use_oneshot(p, partial.element_size())) {
    if (bf16)
      launch_oneshot<__nv_bfloat16>(p, ctas, stream);
    else
      launch_oneshot<__half>(p, ctas, stream);
  } else if (bf16) {
    launch_p2p<__nv_bfloat16>(p, ctas, stream);
  } else {
    launch_p2p<__half>(p, ctas, stream);
  }
}

// The copy-engine data path (copy_engine.cuh). `sources`: device int64 [2 * world], the fused
// kernel's bases on this path (data: the mirror of q, or this rank's data base at q = rank; then
// the signal pads); `peer_data`: every rank's data base (host; entry `rank` = local_base);
// `mirrors`: this rank's mirror of each rank (host; entry `rank` unused), each `mirror_bytes`
// long inside `mirror`, 16-byte aligned.
void fused_allreduce_rmsnorm_copy_engine(
    const at::Tensor& partial, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    double eps, at::Tensor& residual_out, const std::optional<at::Tensor>& normed_out,
    bool sequence_parallel, const at::Tensor& bases, at::Tensor& signal, int64_t rank,
    int64_t world, int64_t local_base, int64_t buffer_bytes, int64_t ctas, int64_t timeout_ns,
    const at::Tensor& sources, at::Tensor& mirror, at::IntArrayRef peer_data,
    at::IntArrayRef mirrors, int64_t mirror_bytes, int64_t phase) {
  (void)signal;
  const bool gather_normed = sequence_parallel && weight.has_value();
  TORCH_CHECK(phase == kCeWhole || phase == kCeTransfer || phase == kCeReduce,
              "tokenweave: copy-engine phase must be 0 (whole), 1 (transfer) or 2 (reduce), got ",
              phase);
  TORCH_CHECK(phase == kCeWhole || !gather_normed,
              "tokenweave: the copy-engine op runs in two phases only when it gathers no normed "
              "rows (replicated layout, or no norm)");
  const FusedParams p = make_params(partial, residual, weight, eps, residual_out, normed_out,
                                    sequence_parallel, bases, rank, world, local_base,
                                    buffer_bytes, ctas, timeout_ns);
  TORCH_CHECK(sources.is_cuda() && sources.scalar_type() == at::kLong &&
                  sources.numel() == 2 * world,
              "tokenweave: sources must be a CUDA int64 tensor of 2 * world entries");
  TORCH_CHECK(static_cast<int64_t>(peer_data.size()) == world &&
                  static_cast<int64_t>(mirrors.size()) == world,
              "tokenweave: peer_data and mirrors need one entry per rank");
  TORCH_CHECK(sources.device() == partial.device() && mirror.device() == partial.device(),
              "tokenweave: sources and mirror must be on partial's device");
  TORCH_CHECK(peer_data[rank] == local_base, "tokenweave: peer_data[rank] is not local_base");
  const int64_t mirror_base = reinterpret_cast<int64_t>(mirror.data_ptr());
  const int64_t mirror_end = mirror_base + mirror.numel() * mirror.element_size();
  for (int64_t q = 0; q < world; ++q)
    TORCH_CHECK(q == rank || (mirrors[q] >= mirror_base && mirrors[q] % kVecBytes == 0 &&
                              mirrors[q] + mirror_bytes <= mirror_end),
                "tokenweave: the mirror of rank ", q,
                " is not a 16-byte aligned region inside the mirror tensor");
  if (p.rows == 0) return;
  const int64_t es = partial.element_size();
  const int64_t bytes = static_cast<int64_t>(p.rows) * p.hidden * es;  // one chunk's rows
  const int64_t src_off = p.partial_off + (sequence_parallel ? rank : 0) * p.partial_cstride;
  TORCH_CHECK(src_off + bytes <= mirror_bytes, "tokenweave: partial rows end at byte ",
              src_off + bytes, " of the data region, past the mirrored ", mirror_bytes);
  c10::cuda::CUDAGuard guard(partial.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(partial.get_device()).stream();
  const int64_t* pads = bases.data_ptr<int64_t>() + world;
  auto copy = [&](int64_t dst, int64_t src) {
    const cudaError_t err =
        cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                        static_cast<size_t>(bytes), cudaMemcpyDefault, stream);
    TORCH_CHECK(err == cudaSuccess, "tokenweave: cudaMemcpyAsync failed: ",
                cudaGetErrorString(err));
  };
  auto barrier = [&](int which) {
    if (which == kCeStart)
      copy_engine_barrier_kernel<kCeStart><<<1, 32, 0, stream>>>(pads, rank, world, timeout_ns);
    else if (which == kCeMid)
      copy_engine_barrier_kernel<kCeMid><<<1, 32, 0, stream>>>(pads, rank, world, timeout_ns);
    else
      copy_engine_barrier_kernel<kCeEnd><<<1, 32, 0, stream>>>(pads, rank, world, timeout_ns);
    check_launch();
  };

  if (phase != kCeReduce) {
    barrier(kCeStart);
    for (int64_t q = 0; q < world; ++q)
      if (q != rank) copy(mirrors[q] + src_off, peer_data[q] + src_off);
    if (phase == kCeTransfer) {  // every peer has pulled my rows: the rest is local
      barrier(kCeEnd);
      return;
    }
  }
  FusedParams local = p;
  local.bases = sources.data_ptr<int64_t>();
  local.copy_engine = 1;
  if (partial.scalar_type() == at::kBFloat16)
    launch_p2p<__nv_bfloat16>(local, ctas, stream);
  else
    launch_p2p<__half>(local, ctas, stream);
  if (gather_normed) {  // pull every peer's normed chunk
    barrier(kCeMid);
    for (int64_t q = 0; q < world; ++q) {
      const int64_t normed = p.normed_off + q * p.normed_cstride;
      if (q != rank) copy(local_base + normed, peer_data[q] + normed);
    }
  }
  if (phase == kCeWhole) barrier(kCeEnd);
}

// UNTESTED HERE (multicast is forbidden on this project's machines): see multimem.cuh.
void fused_allreduce_rmsnorm_multimem(
    const at::Tensor& partial, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    double eps, at::Tensor& residual_out, const std::optional<at::Tensor>& normed_out,
    bool sequence_parallel, const at::Tensor& bases, at::Tensor& signal, int64_t rank,
    int64_t world, int64_t local_base, int64_t buffer_bytes, int64_t ctas, int64_t timeout_ns,
    int64_t multicast_base) {
  (void)signal;
  TORCH_CHECK(multicast_base != 0, "tokenweave: multimem needs a multicast address");
  const FusedParams p = make_params(partial, residual, weight, eps, residual_out, normed_out,
                                    sequence_parallel, bases, rank, world, local_base,
                                    buffer_bytes, ctas, timeout_ns);
  if (p.rows == 0) return;
  c10::cuda::CUDAGuard guard(partial.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(partial.get_device()).stream();
  char* mc = reinterpret_cast<char*>(multicast_base);
  if (partial.scalar_type() == at::kBFloat16)
    launch_multimem<__nv_bfloat16>(p, ctas, mc, stream);
  else
    launch_multimem<__half>(p, ctas, mc, stream);
}

}  // namespace tokenweave

TORCH_LIBRARY(tokenweave, m) {
  m.def(
      "fused_allreduce_rmsnorm(Tensor partial, Tensor residual, Tensor? weight, float eps, "
      "Tensor(a!) residual_out, Tensor(b!)? normed_out, bool sequence_parallel, Tensor bases, "
      "Tensor(c!) signal, int rank, int world, int local_base, int buffer_bytes, int ctas, "
      "int timeout_ns) -> ()");
  m.def(
      "fused_allreduce_rmsnorm_multimem(Tensor partial, Tensor residual, Tensor? weight, "
      "float eps, Tensor(a!) residual_out, Tensor(b!)? normed_out, bool sequence_parallel, "
      "Tensor bases, Tensor(c!) signal, int rank, int world, int local_base, int buffer_bytes, "
      "int ctas, int timeout_ns, int multicast_base) -> ()");
  m.def(
      "fused_allreduce_rmsnorm_copy_engine(Tensor partial, Tensor residual, Tensor? weight, "
      "float eps, Tensor(a!) residual_out, Tensor(b!)? normed_out, bool sequence_parallel, "
      "Tensor bases, Tensor(c!) signal, int rank, int world, int local_base, int buffer_bytes, "
      "int ctas, int timeout_ns, Tensor sources, Tensor(d!) mirror, int[] peer_data, "
      "int[] mirrors, int mirror_bytes, int phase) -> ()");
}

TORCH_LIBRARY_IMPL(tokenweave, CUDA, m) {
  m.impl("fused_allreduce_rmsnorm", &tokenweave::fused_allreduce_rmsnorm);
  m.impl("fused_allreduce_rmsnorm_multimem", &tokenweave::fused_allreduce_rmsnorm_multimem);
  m.impl("fused_allreduce_rmsnorm_copy_engine",
         &tokenweave::fused_allreduce_rmsnorm_copy_engine);
}

#ifdef TORCH_EXTENSION_NAME
// Importable as a Python module (megatron_tokenweave._C); the ops register on load.
#include <Python.h>
#define TW_CAT_(a, b) a##b
#define TW_CAT(a, b) TW_CAT_(a, b)
extern "C" PyObject* TW_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                            nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
#endif
