#include "models/model.h"

#include "models/registry.h"

namespace onebit {

absl::StatusOr<std::unique_ptr<Model>> NewModel(const control::TrainingConfig& config) {
  const ModelEntry* m = FindModel(config.model());
  if (m == nullptr) return UnknownModelError(config.model());
  return m->make(config);
}

}  // namespace onebit
