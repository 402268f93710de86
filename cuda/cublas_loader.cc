#include "cuda/cublas_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace onebit::cuda {
namespace {

absl::StatusOr<const CublasApi*> Load() {
  const std::string name = CublasLibraryName();
  // The soname through the loader's search path, then the toolkit's folder
  // this was built against (not on the search path everywhere).
  std::vector<std::string> tried = {name};
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib == nullptr ? dlerror() : "";
  if (lib == nullptr && std::getenv("ONEBIT_CUBLAS_LIBRARY") == nullptr) {
    const std::string in_toolkit = absl::StrCat(ONEBIT_CUDA_LIBRARY_DIR, "/", name);
    tried.push_back(in_toolkit);
    lib = dlopen(in_toolkit.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) why = dlerror();
  }
  if (lib == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the GPU mlp needs cuBLAS, and ", absl::StrJoin(tried, " or "), " cannot be loaded (", why,
        "): install the CUDA toolkit's cuBLAS (libcublas) or name it with "
        "ONEBIT_CUBLAS_LIBRARY; the CPU needs neither (--device cpu)"));
  }
  static CublasApi api;
  std::vector<std::string> missing;
  auto get = [&](auto* fn, const char* symbol) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, symbol));
    if (*fn == nullptr) missing.push_back(symbol);
  };
  get(&api.create, "cublasCreate_v2");
  get(&api.destroy, "cublasDestroy_v2");
  get(&api.set_stream, "cublasSetStream_v2");
  get(&api.set_math_mode, "cublasSetMathMode");
  get(&api.set_atomics_mode, "cublasSetAtomicsMode");
  get(&api.sgemm, "cublasSgemm_v2");
  get(&api.status_name, "cublasGetStatusName");
  get(&api.status_string, "cublasGetStatusString");
  if (!missing.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(name, " lacks ", absl::StrJoin(missing, ", "),
                                                      ": not the cuBLAS this was built for"));
  }
  return &api;  // the library stays loaded for the process's life
}

}  // namespace

std::string CublasLibraryName() {
  const char* given = std::getenv("ONEBIT_CUBLAS_LIBRARY");
  if (given != nullptr && *given != '\0') return given;
  return ONEBIT_CUBLAS_SONAME;
}

absl::StatusOr<const CublasApi*> Cublas() {
  static const absl::StatusOr<const CublasApi*> loaded = Load();
  return loaded;
}

}  // namespace onebit::cuda
