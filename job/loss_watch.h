// The divergence watch over metrics.csv's loss column (the coordinator's
// and onebit-reference's): a training run whose loss grew by orders of
// magnitude is still "ok" (the loss stayed finite), but summary.json says
// "diverged": true and the coordinator's log has a warning.
//
// The rule: the loss of the job's first step (with a reported loss) is the
// baseline; the loss has diverged once the median of the losses of kWindow
// (5) consecutive later steps is above kFactor (100) times it. The median,
// so that one noisy batch does not count; the first step, because a run
// that diverges at once (too large a learning rate) has no calm steps after
// it. 100, not more: the first loss is an untrained model's, and an mlp
// whose loss ended 535 times it (test accuracy 0.26) is no training run.
// Steps without a reported loss (NaN) are skipped; a job whose first loss
// is 0 or negative is not watched.
//
// Not thread-safe (the coordinator holds its lock).
#ifndef ONEBIT_JOB_LOSS_WATCH_H_
#define ONEBIT_JOB_LOSS_WATCH_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <utility>

namespace onebit {

class LossWatch {
 public:
  static constexpr size_t kWindow = 5;
  static constexpr double kFactor = 100;

  // The mean loss over the workers of `step`; rows come in step order.
  // Returns the warning to log when this row is the one at which the loss
  // is first found to have diverged; nullopt otherwise.
  std::optional<std::string> Add(uint64_t step, double loss);

  bool diverged() const { return diverged_; }

 private:
  std::optional<double> baseline_;
  uint64_t baseline_step_ = 0;
  bool watched_ = true;                             // false: the first loss was not positive
  std::deque<std::pair<uint64_t, double>> window_;  // the last kWindow (step, loss)
  bool diverged_ = false;
};

}  // namespace onebit

#endif  // ONEBIT_JOB_LOSS_WATCH_H_
