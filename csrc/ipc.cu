// Host-side helpers of the symmetric buffer: cudaMalloc'd allocations shared with CUDA IPC.
// Not on any hot path; every CUDA return code is checked and raised with its error string.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cstring>

#include "tokenweave/check.h"
#include "tokenweave/signal.cuh"

namespace tokenweave {

#define TW_CUDA_CHECK(expr)                                                               \
  do {                                                                                    \
    cudaError_t err_ = (expr);                                                            \
    TW_CHECK(err_ == cudaSuccess, "tokenweave: ", #expr, " failed: ",                     \
             cudaGetErrorString(err_), " (", static_cast<int>(err_), ")");                \
  } while (0)

int64_t ipc_malloc(int64_t nbytes, int64_t device) {
  TW_CHECK(nbytes > 0, "tokenweave: ipc_malloc needs nbytes > 0, got ", nbytes);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  TW_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(nbytes)));
  TW_CUDA_CHECK(cudaMemset(ptr, 0, static_cast<size_t>(nbytes)));
  TW_CUDA_CHECK(cudaDeviceSynchronize());
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_free(int64_t ptr, int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  TW_CUDA_CHECK(cudaDeviceSynchronize());
  TW_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr)));
}

at::Tensor ipc_get_handle(int64_t ptr, int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t h;
  TW_CUDA_CHECK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(ptr)));
  at::Tensor out =
      at::empty({static_cast<int64_t>(sizeof(h))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(out.data_ptr(), &h, sizeof(h));
  return out;
}

int64_t ipc_open_handle(const at::Tensor& handle, int64_t device) {
  TW_CHECK(handle.device().is_cpu() && handle.scalar_type() == at::kByte &&
               handle.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
           "tokenweave: an IPC handle is a CPU uint8 tensor of ", sizeof(cudaIpcMemHandle_t),
           " bytes");
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.contiguous().data_ptr(), sizeof(h));
  void* ptr = nullptr;
  TW_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_close_handle(int64_t ptr, int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  TW_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)));
}

// A uint8 CUDA tensor viewing [ptr, ptr + nbytes) without owning it.
at::Tensor tensor_from_ptr(int64_t ptr, int64_t nbytes, int64_t device) {
  auto opts = at::TensorOptions()
                  .dtype(at::kByte)
                  .device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  return at::from_blob(reinterpret_cast<void*>(ptr), {nbytes}, [](void*) {}, opts);
}

// Queries the attribute only; creates nothing (multicast objects are never created here).
bool device_multicast_supported(int64_t device) {
  int v = 0;
  // CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED (132): no runtime-API enum name in CUDA 13 headers.
  cudaError_t err = cudaDeviceGetAttribute(&v, static_cast<cudaDeviceAttr>(132),
                                           static_cast<int>(device));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return v != 0;
}

int64_t signal_pad_bytes() { return kHeaderBytes; }

__global__ void fill_words(uint32_t* p, int64_t n, uint32_t v) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    p[i] = v;
}

// After ipc_malloc (which zeroes everything): the one-shot receive buffers start "empty".
void init_header(int64_t ptr, int64_t device) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  const int64_t words = (kHeaderBytes - kSignalBytes) / 4;
  fill_words<<<256, 256>>>(reinterpret_cast<uint32_t*>(ptr + kSignalBytes), words, 0x80008000u);
  TW_CUDA_CHECK(cudaGetLastError());
  TW_CUDA_CHECK(cudaDeviceSynchronize());
}

}  // namespace tokenweave

TORCH_LIBRARY_FRAGMENT(tokenweave, m) {
  m.def("ipc_malloc(int nbytes, int device) -> int", &tokenweave::ipc_malloc);
  m.def("ipc_free(int ptr, int device) -> ()", &tokenweave::ipc_free);
  m.def("ipc_get_handle(int ptr, int device) -> Tensor", &tokenweave::ipc_get_handle);
  m.def("ipc_open_handle(Tensor handle, int device) -> int", &tokenweave::ipc_open_handle);
  m.def("ipc_close_handle(int ptr, int device) -> ()", &tokenweave::ipc_close_handle);
  m.def("tensor_from_ptr(int ptr, int nbytes, int device) -> Tensor", &tokenweave::tensor_from_ptr);
  m.def("device_multicast_supported(int device) -> bool",
        &tokenweave::device_multicast_supported);
  m.def("signal_pad_bytes() -> int", &tokenweave::signal_pad_bytes);
  m.def("init_header(int ptr, int device) -> ()", &tokenweave::init_header);
}
