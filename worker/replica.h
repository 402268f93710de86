// What a worker trains: its replica of x, the optimizer state beside it and
// the gradient of its model, wherever they live. CpuReplica keeps them in
// host memory (optim/optimizer.h's WorkerOptimizer on a WorkerState);
// DeviceReplica (worker/device_replica.h) keeps them on a GPU. PsClient drives
// a replica chunk by chunk; every replica of a job, on any device, applies the
// same replies with the same arithmetic, so replicas stay bitwise equal.
//
// Not thread-safe: one thread drives a replica.
#ifndef ONEBIT_WORKER_REPLICA_H_
#define ONEBIT_WORKER_REPLICA_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/state_file.h"
#include "models/evaluator.h"
#include "models/model.h"
#include "optim/optimizer.h"

namespace onebit {

class Replica {
 public:
  virtual ~Replica() = default;

  // Where it lives, for logs: "cpu", "cuda:0 (NVIDIA H200)", "cuda-twin".
  virtual const std::string& device() const = 0;
  virtual uint64_t num_params() const = 0;
  virtual Phase phase() const = 0;
  // The optimizer whose codecs and reply sizes the replica follows.
  virtual const WorkerOptimizer& optimizer() const = 0;

  // x = the model's initial parameters (zero without a model), the rest of
  // the state zero.
  virtual absl::Status Init() = 0;
  // x and the gradient, d floats each, in the replica's memory (host or
  // device): a caller's own model reads x and writes the gradient there.
  // Push reads the gradient; Apply may use it as scratch.
  virtual float* params() = 0;
  virtual float* grads() = 0;
  // Computes and keeps the gradient of worker `rank`'s loss at x for `step`;
  // returns the loss. FailedPrecondition without a model.
  virtual absl::StatusOr<double> ComputeGradient(uint32_t rank, uint64_t step) = 0;
  // ComputeGradient, calling `release` as ranges of the gradient become
  // final (Model::GradientInParts), so that they can be pushed while the
  // rest is computed; the same gradient bit for bit. The default (a
  // device's model, which finishes on the device) releases [0, d) at the end.
  virtual absl::StatusOr<double> ComputeGradientInParts(uint32_t rank, uint64_t step,
                                                        const Model::ReleaseFn& release);
  // Once per step, before its first Push (or its LocalStep), with the
  // step's learning rate (without it, the job's schedule's).
  virtual absl::Status BeginStep(uint64_t step, float lr) = 0;
  // The push of elements [b, b + n) for `step` from the kept gradient:
  // optimizer().push_codec(optimizer().KindOf(step, phase())).EncodedSize(n)
  // bytes into host memory out, complete when this returns.
  virtual absl::Status Push(uint64_t step, uint64_t b, size_t n, uint8_t* out) = 0;
  // The part [b, b + n) of a step that sends nothing for it (StepKind::kLocal
  // there: the whole model, or a diloco fragment that does not sync then):
  // the replica's own update from the kept gradient; FinishStep follows
  // after the step's replies (at once when the whole step is local).
  virtual absl::Status LocalStep(uint64_t step, uint64_t b, size_t n) = 0;
  // Applies the server's reply for [b, b + n) (host memory, ReplyBytes bytes;
  // see WorkerOptimizer::Apply). A device may still be working when this
  // returns, but `reply` is no longer needed.
  // `lr`: the step's learning rate.
  virtual absl::Status Apply(uint64_t step, float lr, bool last_warmup, const uint8_t* reply,
                             uint64_t b, size_t n) = 0;
  // At the end of step `step` = optimizer().MergeStep(pushed) > pushed, once
  // every reply of sync step `pushed` for [b, b + n) has been applied:
  // WorkerOptimizer::Merge (diloco with --sync_delay joins its local model
  // with the outer step). Before FinishStep.
  virtual absl::Status Merge(uint64_t pushed, uint64_t step, uint64_t b, size_t n) = 0;
  // After the last reply of a step: waits for the device and reports its
  // errors; `entered_compression`: that step was the last of the warm-up.
  virtual absl::Status FinishStep(bool entered_compression) = 0;

  // Copies x[0, d) to host memory.
  virtual absl::Status ReadX(float* x) = 0;
  // The gradient g[0, d) to and from host memory: how the local ranks of a
  // host meet (docs/design.md §1.9).
  virtual absl::Status ReadGrads(float* host) = 0;
  virtual absl::Status WriteGrads(const float* host) = 0;
  // Local ranks on devices add their gradients there (docs/design.md
  // §1.9). ExportGrads: a handle of the gradient's device memory that
  // another process of this host maps (cuda::Backend::export_memory),
  // prefixed by the backend's name and a colon; a CPU replica has none
  // (Unimplemented). SyncGrads: the work writing the gradient is done, for
  // another process to read it. MeanGradsWith: g = the mean, in the order
  // of MeanInOrder (optim/update_kernels.h) and bitwise as it, of g and the
  // gradients exported as `peers` (in local-rank order), on this device;
  // each handle is mapped at its first use and kept. Requires that the
  // peers' gradients are complete and stay unchanged until it returns.
  virtual absl::StatusOr<std::string> ExportGrads() {
    return absl::UnimplementedError("the gradient is in host memory");
  }
  virtual absl::Status SyncGrads() { return absl::OkStatus(); }
  virtual absl::Status MeanGradsWith(const std::vector<std::string>& /*peers*/) {
    return absl::UnimplementedError("the gradient is in host memory");
  }
  // The master's parameters [b, b + n) = host[0, n), as a pull delivers
  // them: into x, or where the worker trains a local model apart from the
  // master (zero-one-adam after the freeze, diloco, WorkerState::x_sync)
  // into x_sync, so that a resumed worker keeps the local x it restored.
  // `start`: the job's start (step 0), where the local model is the master
  // too: into both.
  virtual absl::Status WriteX(uint64_t b, size_t n, const float* host, bool start) = 0;
  // Which arrays SaveState copies (e, the phase, and the arrays only some
  // optimizers hold, v, x_sync and lrs, always).
  struct Parts {
    bool x = true;
    bool mbar = true;
    bool den = true;
    // Where the copies come from (null: fresh memory).
    SnapshotBuffers* buffers = nullptr;
  };
  // A host copy of the state (the arrays `parts` names, e, the phase)
  // between steps, for checkpoints; the same on every device for the same
  // steps.
  virtual absl::StatusOr<WorkerState> SaveState(const Parts& parts) = 0;
  // Replaces the state with one SaveState gave (any device's, same d and
  // optimizer). An error, changing nothing, when the sizes do not fit.
  virtual absl::Status RestoreState(const WorkerState& s) = 0;
  // Whether Evaluate works: the model has a test set.
  virtual bool can_evaluate() const = 0;
  // Scores x on the model's test set.
  virtual absl::StatusOr<EvalResult> Evaluate() = 0;
};

// The replica of d parameters in host memory. `model` (may be null: the
// caller computes gradients into grads()) and `optimizer` must outlive it;
// a model must have d parameters.
std::unique_ptr<Replica> NewCpuReplica(uint64_t d, const Model* model,
                                       const WorkerOptimizer* optimizer);

}  // namespace onebit

#endif  // ONEBIT_WORKER_REPLICA_H_
