#include "cuda/memory.h"

#include <cuda_runtime_api.h>

#include <utility>

#include "cuda/cuda_status.h"

namespace onebit::cuda {

absl::StatusOr<DeviceBuffer> DeviceBuffer::Create(size_t bytes) {
  DeviceBuffer b;
  if (bytes == 0) return b;
  if (absl::Status st = CudaError(cudaMalloc(&b.ptr_, bytes), "cudaMalloc"); !st.ok()) {
    b.ptr_ = nullptr;
    return st;
  }
  b.bytes_ = bytes;
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}

absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
}

absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
}

absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0) return absl::OkStatus();
  return CudaError(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                   "cudaMemcpyAsync on device");
}

absl::Status Synchronize(Stream stream) {
  return CudaError(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
}

}  // namespace onebit::cuda
