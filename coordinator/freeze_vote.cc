#include "coordinator/freeze_vote.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "optim/reference.h"

namespace onebit {

void FreezeVote::Add(uint32_t shard, const control::FreezeCheck& c, const ShardMap& map,
                     uint64_t job_steps) {
  if (!options_.automatic || step_ != 0) return;
  checks_[c.completed()][shard] = c.change();
  uint32_t nonempty = 0;
  for (uint32_t k = 0; k < map.num_shards(); ++k) nonempty += map.shard(k).size() > 0;
  // Decide in order: each check once every non-empty shard has reported it.
  while (step_ == 0) {
    auto next = checks_.find(decided_ + options_.window);
    if (next == checks_.end() || next->second.size() < nonempty) return;
    std::vector<double> changes;
    double largest = 0;
    for (const auto& [k, change] : next->second) {
      changes.push_back(change);
      largest = std::max(largest, change);
    }
    const uint64_t step = AutoFreezeStep(options_, next->first, changes);
    decided_ = next->first;
    checks_.erase(next);
    // The check's measure, for the log and summary.json: how far the rule is
    // from firing (the first check has nothing to compare with: 1).
    history_.push_back({decided_, largest});
    if (step == kNever) {
      std::fprintf(stderr,
                   "coordinator: freeze check after %llu steps: largest change of v %.4g, not "
                   "below tau %.4g yet\n",
                   static_cast<unsigned long long>(decided_), largest, options_.tau);
      continue;
    }
    step_ = step;
    if (largest < options_.tau) {
      std::fprintf(stderr,
                   "coordinator: v settled after %llu steps (largest change %.4g < tau %.4g): "
                   "the warm-up ends; compression from step %llu\n",
                   static_cast<unsigned long long>(decided_), largest, options_.tau,
                   static_cast<unsigned long long>(step));
    } else {
      std::fprintf(stderr,
                   "coordinator: v has not settled after %llu steps (largest change %.4g, tau "
                   "%.4g), but the warm-up takes at most %g of the job's %llu steps: compression "
                   "from step %llu\n",
                   static_cast<unsigned long long>(decided_), largest, options_.tau,
                   options_.latest_fraction, static_cast<unsigned long long>(job_steps),
                   static_cast<unsigned long long>(step));
    }
  }
}

void FreezeVote::RollBackTo(uint64_t decided, uint64_t step) {
  checks_.clear();
  decided_ = decided;
  step_ = step;
}

void FreezeVote::Record(uint64_t step, checkpoint::Manifest* m) const {
  if (decided_ <= step) {
    m->set_freeze_decided(decided_);
    m->set_freeze_step(step_);
  } else if (options_.automatic) {
    m->set_freeze_decided(step / options_.window * options_.window);
  }
}

std::string FreezeVote::NeverFiredWarning() const {
  if (history_.empty()) {
    return absl::StrCat("the automatic freeze never fired: no check was decided (one every ",
                        options_.window, " steps); the job ran without compression");
  }
  return absl::StrCat("the automatic freeze never fired: the last check, after ",
                      history_.back().first, " steps, measured ",
                      absl::SixDigits(history_.back().second), " against tau ",
                      absl::SixDigits(options_.tau),
                      "; the job ran without compression (give --freeze_step, a larger tau, "
                      "or the job a fixed --steps, so that the warm-up ends by the latest "
                      "fraction of auto:TAU:K:F)");
}

}  // namespace onebit
