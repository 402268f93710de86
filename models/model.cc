#include "models/model.h"

#include "models/registry.h"

namespace onebit {

absl::StatusOr<double> Model::GradientInParts(const float* x, uint32_t rank, uint64_t step,
                                              float* g, const ReleaseFn& release) const {
  absl::StatusOr<double> loss = Gradient(x, rank, step, g);
  if (!loss.ok()) return loss;
  if (absl::Status st = release(0, num_params()); !st.ok()) return st;
  return loss;
}

absl::StatusOr<std::unique_ptr<Model>> NewModel(const control::TrainingConfig& config) {
  const ModelEntry* m = FindModel(config.model().name());
  if (m == nullptr) return UnknownModelError(config.model().name());
  return m->make(config);
}

}  // namespace onebit
