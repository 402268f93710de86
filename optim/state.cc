#include "optim/state.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "optim/update_kernels.h"

namespace onebit {

namespace {

absl::Status NegativeMoment(float v, uint64_t i) {
  return absl::DataLossError(
      absl::StrCat("hand-over: negative second moment ", v, " at parameter ", i));
}

}  // namespace

absl::Status HandOverDenominators(const float* v, size_t n, uint64_t first, float eps, float* den) {
  for (size_t i = 0; i < n; ++i) {
    if (!(v[i] >= 0)) return NegativeMoment(v[i], first + i);
  }
  FrozenDenominators(v, eps, n, den);
  return absl::OkStatus();
}

absl::Status CheckHandOverMoments(const uint8_t* v, size_t n, uint64_t first) {
  for (size_t i = 0; i < n; ++i) {
    float vi;
    std::memcpy(&vi, v + 4 * i, 4);
    if (!(vi >= 0)) return NegativeMoment(vi, first + i);
  }
  return absl::OkStatus();
}

}  // namespace onebit
