// 0/1 Adam's schedule (docs/design.md §1.6), which every process derives from
// the step number alone. Pure functions; thread-safe.
#ifndef ONEBIT_OPTIM_ZERO_ONE_ADAM_H_
#define ONEBIT_OPTIM_ZERO_ONE_ADAM_H_

#include <cstdint>

#include "optim/options.h"

namespace onebit {

// For step `step` (counted from 0): whether it refreshes v (only steps
// before the freeze do), and, after the freeze, whether it synchronises.
bool IsVarianceStep(const ZeroOneOptions& z, uint64_t step);
bool IsSyncStep(const ZeroOneOptions& z, uint64_t step);
// How many of the steps 0..step refresh v (none after var_freeze_step).
uint64_t VarianceRefreshes(const ZeroOneOptions& z, uint64_t step);
// 1 - beta2^r, r = VarianceRefreshes(step), computed in double and rounded
// once: a variance step's den is sqrt(max(v / this, v_floor)) + eps.
float ZeroOneVarianceCorrection(const OptimizerOptions& o, uint64_t step);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_ZERO_ONE_ADAM_H_
