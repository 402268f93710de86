// What a worker trains: a model over a flat fp32 parameter vector x[0, d).
// Gradients must be deterministic per (seed, rank, step) so that a run can be
// replayed by the single-process reference.
#ifndef ONEBIT_MODELS_MODEL_H_
#define ONEBIT_MODELS_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "proto/control.pb.h"

namespace onebit {

// The ranks the data is split among: N workers of K local ranks each
// (--local_ranks). The gradient of worker w's local rank k is rank
// w * K + k's.
inline uint32_t DataRanks(const control::TrainingConfig& c) {
  return c.cluster().workers() * (c.cluster().local_ranks() > 0 ? c.cluster().local_ranks() : 1);
}

// Thread-compatible: const methods may run concurrently.
class Model {
 public:
  virtual ~Model() = default;
  virtual uint64_t num_params() const = 0;
  // x[0, d) = the initial parameters (the same on every rank).
  virtual void Init(float* x) const = 0;
  // g[0, d) = gradient of worker `rank`'s loss at x for `step`; returns the
  // loss at x. Non-finite results are an error.
  virtual absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step,
                                          float* g) const = 0;
  // Told that g[b, e) is final for this call (and finite); a non-OK result
  // stops the gradient, which returns it.
  using ReleaseFn = std::function<absl::Status(uint64_t b, uint64_t e)>;
  // Gradient, releasing ranges of g as they become final, so that a caller
  // can send them while the rest is computed. The same g and loss as
  // Gradient, bit for bit; the released ranges are disjoint and cover
  // [0, d) by the time it returns OK. A model whose backward runs layer by
  // layer releases each layer as it finishes it (the last layer first); the
  // default releases [0, d) at the end.
  virtual absl::StatusOr<double> GradientInParts(const float* x, uint32_t rank, uint64_t step,
                                                 float* g, const ReleaseFn& release) const;
  // Steps per pass over the training data; 0 when the model has no data set.
  virtual uint64_t steps_per_epoch() const { return 0; }
};

// The registered model named by config.model().name() (models/registry.h), from a
// resolved config (job/config.h's ResolveConfig).
absl::StatusOr<std::unique_ptr<Model>> NewModel(const control::TrainingConfig& config);

}  // namespace onebit

#endif  // ONEBIT_MODELS_MODEL_H_
