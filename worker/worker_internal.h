// What the shipped onebit-worker needs of a Worker beyond the public API
// (include/onebit/worker.h): a built-in model chosen from the job's config,
// which computes the gradient on the replica itself, and the evaluation of
// the test set in the step's metrics. Not installed.
#ifndef ONEBIT_WORKER_WORKER_INTERNAL_H_
#define ONEBIT_WORKER_WORKER_INTERNAL_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/model.h"
#include "onebit/worker.h"
#include "proto/control.pb.h"
#include "worker/replica.h"

namespace onebit {

// Builds the job's model once its config is known; it must have the job's
// d parameters. The Worker owns it.
using ModelFactory =
    std::function<absl::StatusOr<std::unique_ptr<Model>>(const control::TrainingConfig&)>;

// Connect, with x initialised by the model (the same on every rank, so the
// broadcast changes nothing) and Replica::ComputeGradient available.
absl::StatusOr<std::unique_ptr<Worker>> ConnectWithModel(const WorkerOptions& options,
                                                         const ModelFactory& make_model);

struct WorkerAccess {
  static std::unique_ptr<Worker> Wrap(std::unique_ptr<Worker::Impl> impl);
  static Replica& replica(Worker& w);
  static const control::TrainingConfig& config(const Worker& w);
  static const Model* model(const Worker& w);
  // The rank whose data this process trains on: worker rank * K + local
  // rank (--local_ranks K; models/model.h DataRanks).
  static uint32_t data_rank(const Worker& w);
  // The medians of its steps' parts by phase (ms): the gradient's time
  // (from the last step's end; a leader's includes its local ranks'),
  // encoding and sending the pushes, waiting for replies, applying them.
  // "" before any step that pushed.
  static std::string StepParts(const Worker& w);
  // Fails the job with `st` (reported as "worker R: <message>"); returns it.
  static absl::Status Fail(Worker& w, const absl::Status& st);
  // Waits while the job runs, at most `timeout`; the coordinator's reason
  // once it has ended, else OK.
  static absl::Status WaitForJobEnd(Worker& w, absl::Duration timeout);
};

}  // namespace onebit

#endif  // ONEBIT_WORKER_WORKER_INTERNAL_H_
