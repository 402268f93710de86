#include "models/blas_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <type_traits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace onebit {
namespace {

absl::StatusOr<const BlasApi*> Load() {
  const std::string name = BlasLibraryName();
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the mlp and softmax models need OpenBLAS, and ", name, " cannot be loaded (", dlerror(),
        "): install libopenblas0-pthread (tools/setup does) or name the library "
        "with ONEBIT_BLAS_LIBRARY"));
  }
  static BlasApi api;
  std::vector<std::string> missing;
  auto get = [&](auto* fn, const char* symbol) {
    *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(dlsym(lib, symbol));
    if (*fn == nullptr) missing.push_back(symbol);
  };
  get(&api.sgemm, "cblas_sgemm");
  get(&api.set_num_threads, "openblas_set_num_threads");
  if (!missing.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(name, " lacks ", absl::StrJoin(missing, ", "), ": not an OpenBLAS library"));
  }
  return &api;  // the library stays loaded for the process's life
}

}  // namespace

std::string BlasLibraryName() {
  const char* given = std::getenv("ONEBIT_BLAS_LIBRARY");
  if (given != nullptr && *given != '\0') return given;
  return ONEBIT_OPENBLAS_SONAME;
}

absl::StatusOr<const BlasApi*> Blas() {
  static const absl::StatusOr<const BlasApi*> loaded = Load();
  return loaded;
}

}  // namespace onebit
