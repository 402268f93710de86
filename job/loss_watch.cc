#include "job/loss_watch.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_format.h"

namespace onebit {

std::optional<std::string> LossWatch::Add(uint64_t step, double loss) {
  if (diverged_ || !watched_ || std::isnan(loss)) return std::nullopt;
  if (!baseline_) {
    baseline_ = loss;
    baseline_step_ = step;
    watched_ = loss > 0;
    return std::nullopt;
  }
  window_.emplace_back(step, loss);
  if (window_.size() > kWindow) window_.pop_front();
  if (window_.size() < kWindow) return std::nullopt;
  std::vector<double> losses;
  for (const auto& [s, l] : window_) losses.push_back(l);
  std::nth_element(losses.begin(), losses.begin() + kWindow / 2, losses.end());
  const double median = losses[kWindow / 2];
  if (!(median > kFactor * *baseline_)) return std::nullopt;
  diverged_ = true;
  return absl::StrFormat(
      "the loss diverged: its median over steps %d-%d is %.4g, more than %gx step %d's %.4g "
      "(summary.json will say \"diverged\": true)",
      window_.front().first, window_.back().first, median, kFactor, baseline_step_, *baseline_);
}

}  // namespace onebit
