// The CUDA backend (cuda/backend.h): device memory, pinned host memory,
// streams, and the kernels of cuda/kernels.h.
#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/backend.h"
#include "cuda/cuda_status.h"

namespace onebit::cuda {
namespace {

absl::StatusOr<void*> Alloc(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return p;
  if (absl::Status st = CudaError(cudaMalloc(&p, bytes), "cudaMalloc"); !st.ok()) return st;
  return p;
}
void Free(void* p) {
  if (p != nullptr) cudaFree(p);
}
absl::StatusOr<void*> AllocPinned(size_t bytes) {
  void* p = nullptr;
  if (bytes == 0) return p;
  absl::Status st = CudaError(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc");
  if (!st.ok()) return st;
  return p;
}
void FreePinned(void* p) {
  if (p != nullptr) cudaFreeHost(p);
}
absl::StatusOr<Stream> CreateStream() {
  cudaStream_t s = nullptr;
  // Non-blocking: no implicit waits on the legacy default stream.
  absl::Status st =
      CudaError(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
  if (!st.ok()) return st;
  return s;
}
void DestroyStream(Stream s) {
  if (s != nullptr) cudaStreamDestroy(s);
}
absl::Status CopyToDev(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, s),
                   "cudaMemcpyAsync to device");
}
absl::Status CopyToHostAsync(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s),
                   "cudaMemcpyAsync to host");
}
absl::Status SetZero(void* dst, size_t bytes, Stream s) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemsetAsync(dst, 0, bytes, s), "cudaMemsetAsync");
}
absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream s) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s),
                   "cudaMemcpyAsync on the device");
}
absl::Status Sync(Stream s) { return CudaError(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }
absl::StatusOr<std::string> ExportMemory(void* p, size_t) {
  cudaIpcMemHandle_t h;
  if (absl::Status st = CudaError(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle"); !st.ok()) {
    return st;
  }
  return std::string(reinterpret_cast<const char*>(&h), sizeof h);
}
absl::StatusOr<void*> ImportMemory(const std::string& handle, size_t) {
  cudaIpcMemHandle_t h;
  if (handle.size() != sizeof h) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA IPC handle has ", sizeof h, " bytes, not ", handle.size()));
  }
  std::memcpy(&h, handle.data(), sizeof h);
  void* p = nullptr;
  absl::Status st = CudaError(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
                              "cudaIpcOpenMemHandle");
  if (!st.ok()) return st;
  return p;
}
void CloseImported(void* p, size_t) {
  if (p != nullptr) cudaIpcCloseMemHandle(p);
}

const Backend kCuda = {
    "cuda",
    Alloc,
    Free,
    AllocPinned,
    FreePinned,
    CreateStream,
    DestroyStream,
    CopyToDev,
    CopyToHostAsync,
    SetZero,
    CopyOnDevice,
    Sync,
    Alloc,
    ExportMemory,
    ImportMemory,
    CloseImported,
    OnebitEncode,
    OnebitSigns,
    OnebitDecode,
    OnebitDecodeAdd,
    Fp16Check,
    Fp16Encode,
    Fp16Decode,
    Fp16DecodeAdd,
    FirstNonFinite,
    Axpy,
    UpdateMomentum,
    ApplyMomentum,
    UpdateMoments,
    FrozenDenominators,
    VarianceDenominators,
    UpdateSinceSync,
    ApplySync,
    LambApply,
    AdamUpdate,
};

}  // namespace

const Backend* CudaBackend() { return &kCuda; }

absl::StatusOr<std::string> SelectDevice(int index) {
  int count = 0;
  if (absl::Status st = CudaError(cudaGetDeviceCount(&count), "cudaGetDeviceCount"); !st.ok()) {
    return st;
  }
  if (index < 0 || index >= count) {
    return absl::NotFoundError(
        absl::StrCat("no CUDA device ", index, " (", count, " usable on this machine)"));
  }
  if (absl::Status st = CudaError(cudaSetDevice(index), "cudaSetDevice"); !st.ok()) return st;
  cudaDeviceProp prop;
  if (absl::Status st = CudaError(cudaGetDeviceProperties(&prop, index), "cudaGetDeviceProperties");
      !st.ok()) {
    return st;
  }
  return std::string(prop.name);
}

}  // namespace onebit::cuda
