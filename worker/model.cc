#include "worker/model.h"

#include "absl/strings/str_cat.h"
#include "worker/mlp_model.h"
#include "worker/synthetic_model.h"

namespace onebit {

absl::StatusOr<std::unique_ptr<Model>> NewModel(const control::TrainingConfig& config) {
  if (config.model() == "synthetic") {
    SyntheticOptions o;
    o.dim = config.dim();
    o.seed = config.seed();
    o.noise = config.noise();
    o.curvature_spread = config.curvature_spread();
    o.skip = config.skip_model();
    return std::unique_ptr<Model>(new SyntheticModel(o));
  }
  if (config.model() == "mlp") {
    MlpOptions o;
    auto layers = ParseLayers(config.layers());
    if (!layers.ok()) return layers.status();
    o.layers = *layers;
    o.seed = config.seed();
    o.data_dir = config.data_dir();
    o.batch = config.batch();
    o.workers = config.workers();
    o.blas_threads = static_cast<int>(config.blas_threads());
    o.max_train = config.max_train();
    o.max_test = config.max_test();
    auto mlp = NewMlpModel(o);
    if (!mlp.ok()) return mlp.status();
    return std::unique_ptr<Model>(std::move(*mlp));
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown model '", config.model(), "'"));
}

}  // namespace onebit
