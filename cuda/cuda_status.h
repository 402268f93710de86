// CUDA error codes as Status (internal to cuda/).
#ifndef ONEBIT_CUDA_CUDA_STATUS_H_
#define ONEBIT_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace onebit::cuda {

// OK for cudaSuccess, else an error naming `what` with CUDA's name and text
// for err (cudaErrorNoDevice, "no CUDA-capable device is detected", ...).
inline absl::Status CudaError(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so the next call starts clean
  const absl::StatusCode code = err == cudaErrorMemoryAllocation
                                    ? absl::StatusCode::kResourceExhausted
                                    : absl::StatusCode::kFailedPrecondition;
  return absl::Status(code, absl::StrCat(what, ": CUDA error ", cudaGetErrorName(err), ": ",
                                         cudaGetErrorString(err)));
}

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_CUDA_STATUS_H_
