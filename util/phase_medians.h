// Per-step durations of named parts, kept by phase (the warm-up and the
// compression phase), for a process's closing line: each part's median.
// Bounded: the first kMaxSteps steps of each phase are kept, enough for a
// median of a benchmark and a few MB at most.
//
// Not thread-safe: one thread adds and summarises.
#ifndef ONEBIT_UTIL_PHASE_MEDIANS_H_
#define ONEBIT_UTIL_PHASE_MEDIANS_H_

#include <cstddef>
#include <string>
#include <vector>

namespace onebit {

class PhaseMedians {
 public:
  static constexpr size_t kMaxSteps = 100000;

  // The parts' names, in the order Add takes their durations.
  explicit PhaseMedians(std::vector<std::string> parts);

  // One step's durations in seconds, one per part (missing ones count 0).
  void Add(bool compressed, const std::vector<double>& seconds);

  // Steps kept of a phase.
  size_t steps(bool compressed) const;
  // The median of part `part` over the phase's steps, in seconds; 0 without steps.
  double Median(bool compressed, size_t part) const;

  // "warm-up gradient 1.234, wait 5.678; compression gradient ..., wait ..."
  // in milliseconds, a phase without steps left out; "" without any.
  std::string Summary() const;

 private:
  std::vector<std::string> parts_;
  // [phase][part] -> durations
  std::vector<std::vector<double>> by_phase_[2];
};

}  // namespace onebit

#endif  // ONEBIT_UTIL_PHASE_MEDIANS_H_
