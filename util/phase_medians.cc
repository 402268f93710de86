#include "util/phase_medians.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace onebit {

PhaseMedians::PhaseMedians(std::vector<std::string> parts) : parts_(std::move(parts)) {
  for (auto& phase : by_phase_) phase.resize(parts_.size());
}

void PhaseMedians::Add(bool compressed, const std::vector<double>& seconds) {
  std::vector<std::vector<double>>& phase = by_phase_[compressed ? 1 : 0];
  if (phase.empty() || phase[0].size() >= kMaxSteps) return;
  for (size_t i = 0; i < parts_.size(); ++i) {
    phase[i].push_back(i < seconds.size() ? seconds[i] : 0.0);
  }
}

size_t PhaseMedians::steps(bool compressed) const {
  const auto& phase = by_phase_[compressed ? 1 : 0];
  return phase.empty() ? 0 : phase[0].size();
}

double PhaseMedians::Median(bool compressed, size_t part) const {
  const auto& phase = by_phase_[compressed ? 1 : 0];
  if (part >= phase.size() || phase[part].empty()) return 0;
  std::vector<double> v = phase[part];
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

std::string PhaseMedians::Summary() const {
  std::string out;
  for (bool compressed : {false, true}) {
    if (steps(compressed) == 0) continue;
    absl::StrAppend(&out, out.empty() ? "" : "; ", compressed ? "compression" : "warm-up");
    for (size_t i = 0; i < parts_.size(); ++i) {
      absl::StrAppend(&out, i == 0 ? " " : ", ", parts_[i], " ",
                      absl::StrFormat("%.3f", Median(compressed, i) * 1e3));
    }
  }
  return out;
}

}  // namespace onebit
