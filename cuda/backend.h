// Where a device worker's state lives and what computes on it: a CUDA GPU
// (memory on the device, the kernels of cuda/kernels.h) or its CPU twin (host
// memory, the CPU twin of every kernel, everything synchronous). One table of
// functions per backend, as compress/kernels.h has one per instruction set,
// so that the GPU worker's code (worker/device_replica.h) runs unchanged on
// either: the twin tests that code, byte for byte against the CPU worker, on
// machines without a GPU.
//
// Every pointer a kernel or copy takes is a "device pointer" of the backend
// (host memory for the twin); `pinned` memory is host memory the device can
// copy from and to asynchronously (cudaHostAlloc; plain memory for the twin).
// Kernels have the signatures and semantics of cuda/kernels.h. A worker's
// rule reaches them through cuda/array_ops.h.
//
// The tables are immutable; the functions are thread-safe as cuda/kernels.h.
#ifndef ONEBIT_CUDA_BACKEND_H_
#define ONEBIT_CUDA_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/kernels.h"

namespace onebit::cuda {

struct Backend {
  const char* name;  // "cuda" or "cuda-twin"

  // Memory. alloc of 0 bytes gives nullptr. free(nullptr) does nothing.
  absl::StatusOr<void*> (*alloc)(size_t bytes);
  void (*free)(void* p);
  absl::StatusOr<void*> (*alloc_pinned)(size_t bytes);
  void (*free_pinned)(void* p);
  // A stream of its own (nullptr for the twin, where all work is synchronous).
  absl::StatusOr<Stream> (*create_stream)();
  void (*destroy_stream)(Stream s);
  // Enqueued copies (asynchronous where the host side is pinned); 0 bytes do
  // nothing. set_zero: bytes of device memory to zero.
  absl::Status (*copy_to_device)(void* dst, const void* src, size_t bytes, Stream s);
  absl::Status (*copy_to_host)(void* dst, const void* src, size_t bytes, Stream s);
  absl::Status (*set_zero)(void* dst, size_t bytes, Stream s);
  // Device memory to device memory (any alignment).
  absl::Status (*copy_on_device)(void* dst, const void* src, size_t bytes, Stream s);
  // Waits for the work enqueued on s; returns the first error of it.
  absl::Status (*synchronize)(Stream s);

  // Device memory another process of this host maps: the local ranks of a
  // host add their gradients on the devices. alloc_shared: memory that
  // export_memory can hand out (cudaMalloc's, which CUDA IPC shares; a
  // memfd's pages for the twin), freed by free. export_memory: a handle of
  // p (alloc_shared's, `bytes` long) for import_memory in another process of
  // this host and user; import_memory maps it into this process (CUDA: on
  // the current device, which reads the other's memory over the peer link);
  // close_imported unmaps it. Errors name the call that failed.
  absl::StatusOr<void*> (*alloc_shared)(size_t bytes);
  absl::StatusOr<std::string> (*export_memory)(void* p, size_t bytes);
  absl::StatusOr<void*> (*import_memory)(const std::string& handle, size_t bytes);
  void (*close_imported)(void* p, size_t bytes);

  // The kernels (cuda/kernels.h).
  absl::Status (*onebit_encode)(const float* y, const float* e_in, float* e_out, size_t n,
                                uint32_t block, ScaleRule rule, uint8_t* out, Stream s);
  absl::Status (*onebit_signs)(const float* y, float* e, size_t n, uint32_t block,
                               const float* scales, uint8_t* bits, Stream s);
  absl::Status (*onebit_decode)(const float* scales, const uint8_t* bits, size_t n, uint32_t block,
                                float* out, Stream s);
  absl::Status (*onebit_decode_add)(const float* scales, const uint8_t* bits, size_t n,
                                    uint32_t block, float w, float* acc, Stream s);
  absl::StatusOr<size_t> (*fp16_check)(const float* y, const float* e, size_t n, Stream s);
  absl::Status (*fp16_encode)(const float* y, float* e, size_t n, uint16_t* out, Stream s);
  absl::Status (*fp16_decode)(const uint16_t* in, size_t n, float* out, Stream s);
  absl::Status (*fp16_decode_add)(const uint16_t* in, size_t n, float w, float* acc, Stream s);
  absl::StatusOr<size_t> (*first_nonfinite)(const float* y, const float* e, size_t n, Stream s);
  absl::Status (*axpy)(const float* x, size_t n, float w, float* acc, Stream s);
  absl::Status (*update_momentum)(const float* g, float b1, float c1, size_t n, float* m, Stream s);
  absl::Status (*apply_momentum)(const float* mbar, const float* den, float lr, float wd, size_t n,
                                 float* x, Stream s);
  absl::Status (*update_moments)(const float* g, float b1, float c1, float b2, float c2, size_t n,
                                 float* m, float* v, Stream s);
  absl::Status (*frozen_denominators)(const float* v, float eps, size_t n, float* den, Stream s);
  absl::Status (*variance_denominators)(const float* v, float c, float floor, float eps, size_t n,
                                        float* den, Stream s);
  absl::Status (*update_since_sync)(const float* x, const float* x_sync, const float* den, size_t n,
                                    float* u, Stream s);
  absl::Status (*apply_sync)(const float* a, const float* den, float lrs, size_t n, float* x_sync,
                             float* m, float* x, Stream s);
  absl::Status (*lamb_apply)(const float* mbar, const float* den, float k, float wd, size_t n,
                             float* x, Stream s);
  absl::Status (*adam_update)(const AdamCoefficients& c, size_t n, float* g, float* m, float* v,
                              float* x, Stream s);
};

// The CPU twin: always available.
const Backend& TwinBackend();

// The GPU: nullptr in a build without CUDA. Having the table does not mean a
// GPU is present: ask DeviceCount (cuda/device.h), then SelectDevice.
const Backend* CudaBackend();

// Makes GPU `index` current for this thread and returns its name, e.g.
// "NVIDIA H200". Errors: a build without CUDA, no such device, CUDA errors.
absl::StatusOr<std::string> SelectDevice(int index);

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_BACKEND_H_
