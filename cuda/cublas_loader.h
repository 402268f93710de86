// cuBLAS, loaded when first needed (dlopen) rather than linked: a binary
// built with CUDA then starts, and trains on the CPU, on a machine without
// the CUDA libraries (a CPU node, the CPU container image); only the GPU
// mlp needs cuBLAS, and it says so by name when the library is missing.
//
// Thread-safe: the library is loaded once, by the first caller.
#ifndef ONEBIT_CUDA_CUBLAS_LOADER_H_
#define ONEBIT_CUDA_CUBLAS_LOADER_H_

#include <cublas_v2.h>

#include <string>

#include "absl/status/statusor.h"

namespace onebit::cuda {

// The cuBLAS calls the GPU mlp makes, as the library exports them.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSetAtomicsMode) set_atomics_mode = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

// The library's name, or ONEBIT_CUBLAS_LIBRARY when that is set (a path or
// a name for dlopen).
std::string CublasLibraryName();

// The loaded functions; FAILED_PRECONDITION naming the library, what the
// loader said and how to install it when it cannot be loaded or lacks one
// of them. The outcome of the first call is kept.
absl::StatusOr<const CublasApi*> Cublas();

}  // namespace onebit::cuda

#endif  // ONEBIT_CUDA_CUBLAS_LOADER_H_
