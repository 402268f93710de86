#include "optim/state.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "optim/algorithm.h"
#include "optim/registry.h"
#include "optim/update_kernels.h"

namespace onebit {

namespace {

absl::Status NegativeMoment(float v, uint64_t i) {
  return absl::DataLossError(
      absl::StrCat("hand-over: negative second moment ", v, " at parameter ", i));
}

}  // namespace

absl::Status HandOverDenominators(const float* v, size_t n, uint64_t first, float eps, float* den) {
  absl::Status st = CheckHandOverMoments(reinterpret_cast<const uint8_t*>(v), n, first);
  if (st.ok()) FrozenDenominators(v, eps, n, den);
  return st;
}

absl::Status CheckHandOverMoments(const uint8_t* v, size_t n, uint64_t first) {
  for (size_t i = 0; i < n; ++i) {
    float vi;
    std::memcpy(&vi, v + 4 * i, 4);
    if (!(vi >= 0)) return NegativeMoment(vi, first + i);
  }
  return absl::OkStatus();
}

absl::Status CheckWorkerStateFits(const OptimizerOptions& o, uint64_t d, const WorkerState& s) {
  auto algorithm = NewAlgorithm(o);
  if (!algorithm.ok()) return algorithm.status();
  const WorkerArraySet held = (*algorithm)->WorkerArraysIn(PhaseOf(s), /*hand_over=*/false);
  const std::pair<const char*, std::pair<const std::vector<float>*, bool>> arrays[] = {
      {"x", {&s.x, true}},   {"mbar", {&s.mbar, held.mbar}},
      {"e", {&s.e, held.e}}, {"den", {&s.den, held.den}},
      {"v", {&s.v, held.v}}, {"x_sync", {&s.x_sync, held.x_sync}}};
  std::vector<std::string> wrong;
  for (const auto& [name, a] : arrays) {
    const uint64_t want = a.second ? d : 0;
    if (a.first->size() == want) continue;
    wrong.push_back(a.first->empty() ? absl::StrCat("lacks '", name, "' (", want, " floats)")
                                     : absl::StrCat("has ", a.first->size(), " floats of '", name,
                                                    "' where ", want, " fit"));
  }
  if (wrong.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("the saved worker state ", absl::StrJoin(wrong, ", "), ": a worker of ",
                   OptimizerKindName(o.kind), " with d = ", d, " in the ",
                   s.frozen ? "compression phase" : "warm-up", " does not hold that"));
}

void ChunkPushes::Mean(size_t b, size_t e, float* out) const {
  if (payloads.empty()) return;
  DecodeScaledRange(*codec, payloads[0], n, b, e, w, out);
  for (size_t r = 1; r < payloads.size(); ++r) codec->DecodeAddRange(payloads[r], n, b, e, w, out);
}

}  // namespace onebit
