// OpenBLAS, loaded when a model first needs it (dlopen) rather than linked:
// OpenBLAS starts a thread per core when it is loaded, and those threads
// spin (sched_yield) for a while before they sleep. Linked, every process
// of a job paid that, the coordinator and the servers included, which never
// multiply a matrix (a 3 x 2 test job spent a fifth of its CPU there); now
// only a worker training a model that uses BLAS (mlp, softmax) loads it.
//
// Thread-safe: the library is loaded once, by the first caller.
#ifndef ONEBIT_MODELS_BLAS_LOADER_H_
#define ONEBIT_MODELS_BLAS_LOADER_H_

#include <cblas.h>

#include <string>

#include "absl/status/statusor.h"

namespace onebit {

// The BLAS calls the CPU models make, as OpenBLAS exports them.
struct BlasApi {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&openblas_set_num_threads) set_num_threads = nullptr;
};

// The library's name, or ONEBIT_BLAS_LIBRARY when that is set (a path or a
// name for dlopen).
std::string BlasLibraryName();

// The loaded functions; FAILED_PRECONDITION naming the library, what the
// loader said and how to install it when it cannot be loaded or lacks one
// of them. The outcome of the first call is kept.
absl::StatusOr<const BlasApi*> Blas();

}  // namespace onebit

#endif  // ONEBIT_MODELS_BLAS_LOADER_H_
