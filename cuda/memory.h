// Device memory and copies for the GPU kernels' callers (tests, benchmarks,
// the GPU worker). Every CUDA error becomes a Status with the CUDA error
// text. Requires a build with ONEBIT_WITH_CUDA (target onebit_cuda_kernels).
#ifndef ONEBIT_CUDA_MEMORY_H_
#define ONEBIT_CUDA_MEMORY_H_

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/kernels.h"

namespace onebit::cuda {

// An owned device allocation. Move-only; not thread-safe.
class DeviceBuffer {
 public:
  // bytes == 0 gives an empty buffer (data() == nullptr) without touching CUDA.
  static absl::StatusOr<DeviceBuffer> Create(size_t bytes);
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Synchronous copies (bytes == 0 does nothing).
absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
// Enqueued device-to-device copy.
absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes, Stream stream);
// Waits for the stream; returns any error of the work enqueued on it.
absl::Status Synchronize(Stream stream);

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_MEMORY_H_
