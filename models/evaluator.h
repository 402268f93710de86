// A model that can score parameters on held-out data. Kept apart from Model so
// that models without a test set (synthetic) need not say anything.
#ifndef ONEBIT_MODELS_EVALUATOR_H_
#define ONEBIT_MODELS_EVALUATOR_H_

#include <cstdint>

#include "absl/status/statusor.h"

namespace onebit {

struct EvalResult {
  double accuracy = 0;    // fraction of examples whose arg-max class is the label
  double loss = 0;        // mean loss per example
  uint64_t examples = 0;  // how many were scored
};

// Thread-compatible: Evaluate may run concurrently with itself and with the
// model's Gradient.
class Evaluator {
 public:
  virtual ~Evaluator() = default;
  // Scores x[0, num_params) on the whole test set. Non-finite loss is an error.
  virtual absl::StatusOr<EvalResult> Evaluate(const float* x) const = 0;
};

}  // namespace onebit

#endif  // ONEBIT_MODELS_EVALUATOR_H_
