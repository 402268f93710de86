#include "optim/state.h"

#include "absl/strings/str_cat.h"
#include "optim/update_kernels.h"

namespace onebit {

absl::Status HandOverDenominators(const float* v, size_t n, uint64_t first, float eps, float* den) {
  for (size_t i = 0; i < n; ++i) {
    if (!(v[i] >= 0)) {
      return absl::DataLossError(
          absl::StrCat("hand-over: negative second moment ", v[i], " at parameter ", first + i));
    }
  }
  for (size_t i = 0; i < n; ++i) den[i] = FrozenDenominator(v[i], eps);
  return absl::OkStatus();
}

}  // namespace onebit
