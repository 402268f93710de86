#include "worker/device_model.h"

#include "absl/status/status.h"

namespace onebit {
namespace {

class HostDeviceModel final : public DeviceModel {
 public:
  explicit HostDeviceModel(const Model* model)
      : model_(model), evaluator_(dynamic_cast<const Evaluator*>(model)) {}
  absl::StatusOr<double> Gradient(const float* x, uint32_t rank, uint64_t step, float* g) override {
    return model_->Gradient(x, rank, step, g);
  }
  bool can_evaluate() const override { return evaluator_ != nullptr; }
  absl::StatusOr<EvalResult> Evaluate(const float* x) override {
    if (evaluator_ == nullptr) return absl::FailedPreconditionError("the model has no test set");
    return evaluator_->Evaluate(x);
  }

 private:
  const Model* model_;
  const Evaluator* evaluator_;
};

}  // namespace

std::unique_ptr<DeviceModel> NewHostDeviceModel(const Model* model) {
  return std::make_unique<HostDeviceModel>(model);
}

#ifndef ONEBIT_WITH_CUDA
absl::StatusOr<std::unique_ptr<DeviceModel>> NewCudaDeviceModel(const Model*, cuda::Stream) {
  return absl::FailedPreconditionError("this binary was built without CUDA");
}
#endif

}  // namespace onebit
