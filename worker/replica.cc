#include "worker/replica.h"

#include <algorithm>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/state_file.h"
#include "optim/held_momentum.h"

namespace onebit {
namespace {

class CpuReplica final : public Replica {
 public:
  CpuReplica(uint64_t d, const Model* model, const WorkerOptimizer* optimizer)
      : model_(model),
        opt_(optimizer),
        evaluator_(dynamic_cast<const Evaluator*>(model)),
        g_(d, 0.0f) {}

  const std::string& device() const override { return device_; }
  uint64_t num_params() const override { return g_.size(); }
  Phase phase() const override { return PhaseOf(state_); }
  const WorkerOptimizer& optimizer() const override { return *opt_; }

  absl::Status Init() override {
    opt_->InitState(g_.size(), &state_);
    held_.Clear();
    std::fill(g_.begin(), g_.end(), 0.0f);
    if (model_ != nullptr) model_->Init(state_.x.data());
    return absl::OkStatus();
  }
  float* params() override { return state_.x.data(); }
  float* grads() override { return g_.data(); }
  absl::StatusOr<double> ComputeGradient(uint32_t rank, uint64_t step) override {
    if (model_ == nullptr) return absl::FailedPreconditionError("the replica has no model");
    return model_->Gradient(state_.x.data(), rank, step, g_.data());
  }
  absl::StatusOr<double> ComputeGradientInParts(uint32_t rank, uint64_t step,
                                                const Model::ReleaseFn& release) override {
    if (model_ == nullptr) return absl::FailedPreconditionError("the replica has no model");
    return model_->GradientInParts(state_.x.data(), rank, step, g_.data(), release);
  }
  absl::Status BeginStep(uint64_t step, float lr) override {
    step_ = step;
    lr_ = lr;
    opt_->BeginStep(step, lr, &state_);
    return absl::OkStatus();
  }
  absl::Status Push(uint64_t step, uint64_t b, size_t n, uint8_t* out) override {
    return opt_->Push(step, StepLr(step), g_.data(), b, n, &state_, out, &held_);
  }
  absl::Status LocalStep(uint64_t step, uint64_t b, size_t n) override {
    return opt_->LocalStep(step, StepLr(step), g_.data(), b, n, &state_);
  }
  absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply, uint64_t b,
                     size_t n) override {
    return opt_->Apply(step, lr, last_warmup, reply, b, n, &state_, &held_);
  }
  absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n) override {
    return opt_->Merge(pushed, step, b, n, &state_);
  }
  absl::Status FinishStep(bool entered_compression) override {
    if (step_) opt_->EndStep(*step_, &state_);
    step_.reset();
    lr_.reset();
    if (entered_compression) {
      held_.Release(state_.mbar.data());
      opt_->EnterCompression(&state_);
    }
    return absl::OkStatus();
  }
  absl::Status ReadX(float* x) override {
    std::copy(state_.x.begin(), state_.x.end(), x);
    return absl::OkStatus();
  }
  absl::Status ReadGrads(float* host) override {
    std::copy(g_.begin(), g_.end(), host);
    return absl::OkStatus();
  }
  absl::Status WriteGrads(const float* host) override {
    std::copy(host, host + g_.size(), g_.begin());
    return absl::OkStatus();
  }
  absl::Status WriteX(uint64_t b, size_t n, const float* host, bool start) override {
    if (b > state_.x.size() || n > state_.x.size() - b) {
      return absl::OutOfRangeError("WriteX: range outside the parameters");
    }
    // The master goes to the worker's copy of it, which is x_sync where
    // the worker trains a local model apart from it.
    const bool local = !state_.x_sync.empty();
    if (local) std::copy(host, host + n, state_.x_sync.begin() + b);
    if (!local || start) std::copy(host, host + n, state_.x.begin() + b);
    return absl::OkStatus();
  }
  absl::StatusOr<WorkerState> SaveState(const Parts& parts) override {
    auto copy = [&parts](const std::vector<float>& v) {
      return parts.buffers != nullptr ? parts.buffers->Copy(v) : SnapshotFloats(v);
    };
    held_.Release(state_.mbar.data());  // m̄ whole again for the copy
    WorkerState s;
    if (parts.x) s.x = copy(state_.x);
    if (parts.mbar) s.mbar = copy(state_.mbar);
    s.e = copy(state_.e);
    if (parts.den) s.den = copy(state_.den);
    // Held by some optimizers only (zero-one-adam's), and then by no one else.
    if (!state_.v.empty()) s.v = copy(state_.v);
    if (!state_.x_sync.empty()) s.x_sync = copy(state_.x_sync);
    s.lrs = state_.lrs;
    s.frozen = state_.frozen;
    return s;
  }
  absl::Status RestoreState(const WorkerState& s) override {
    if (absl::Status st = CheckWorkerStateFits(opt_->options(), g_.size(), s); !st.ok()) return st;
    state_ = s;
    held_.Clear();
    return absl::OkStatus();
  }
  bool can_evaluate() const override { return evaluator_ != nullptr; }
  absl::StatusOr<EvalResult> Evaluate() override {
    if (evaluator_ == nullptr) return absl::FailedPreconditionError("the model has no test set");
    return evaluator_->Evaluate(state_.x.data());
  }

 private:
  const Model* model_;
  const WorkerOptimizer* opt_;
  const Evaluator* evaluator_;
  const std::string device_ = "cpu";
  float StepLr(uint64_t step) const {
    return lr_ && step_ == step ? *lr_ : LearningRate(opt_->options(), step);
  }

  WorkerState state_;
  // Parts of state_.mbar held as the replies they came in (the compression
  // phase's momentum replies): released into it before anyone reads it.
  HeldMomentum held_;
  std::vector<float> g_;
  // The step BeginStep began, and its learning rate.
  std::optional<uint64_t> step_;
  std::optional<float> lr_;
};

}  // namespace

absl::StatusOr<double> Replica::ComputeGradientInParts(uint32_t rank, uint64_t step,
                                                       const Model::ReleaseFn& release) {
  absl::StatusOr<double> loss = ComputeGradient(rank, step);
  if (!loss.ok()) return loss;
  if (absl::Status st = release(0, num_params()); !st.ok()) return st;
  return loss;
}

std::unique_ptr<Replica> NewCpuReplica(uint64_t d, const Model* model,
                                       const WorkerOptimizer* optimizer) {
  return std::make_unique<CpuReplica>(d, model, optimizer);
}

}  // namespace onebit
