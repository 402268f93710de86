// A model whose gradient is computed where a device replica keeps x (see
// worker/device_replica.h): on the GPU for the CUDA backend, so that only
// compressed payloads (and the model's input data) cross PCIe; on the host for
// the CPU twin backend, where device pointers are host pointers.
#ifndef ONEBIT_WORKER_DEVICE_MODEL_H_
#define ONEBIT_WORKER_DEVICE_MODEL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "cuda/backend.h"
#include "models/evaluator.h"
#include "models/model.h"

namespace onebit {

// Not thread-safe: one caller at a time.
class DeviceModel {
 public:
  virtual ~DeviceModel() = default;
  // g[0, d) = the gradient of worker `rank`'s loss at x for `step` (both
  // device pointers of the backend), the same gradient the host model
  // computes (to rounding: see each implementation); returns the loss once g
  // is complete. Non-finite results are an error, as for Model::Gradient.
  virtual absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step,
                                          float* g) = 0;
  // Whether Evaluate works (the model has a test set).
  virtual bool can_evaluate() const = 0;
  // Scores device x[0, d) on the test set, as Evaluator::Evaluate.
  virtual absl::StatusOr<EvalResult> Evaluate(const float* x) = 0;
};

// The host model itself, for the CPU twin backend (device pointers are host
// pointers). `model` must outlive the result.
std::unique_ptr<DeviceModel> NewHostDeviceModel(const Model* model);

// The GPU version of `model` (worker/cuda_models.cc): the synthetic model's
// gradient as a CUDA kernel (bitwise equal to SyntheticModel's), the mlp on
// cuBLAS (cuda/mlp.h). Work runs on `stream`; the current CUDA device must be
// selected. `model` must outlive the result. Errors: a build without CUDA, a
// model with no GPU version, CUDA errors.
absl::StatusOr<std::unique_ptr<DeviceModel>> NewCudaDeviceModel(const Model* model,
                                                                cuda::Stream stream);

}  // namespace onebit

#endif  // ONEBIT_WORKER_DEVICE_MODEL_H_
