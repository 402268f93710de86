// The workers' metrics, step by step: each worker's report of a step, the
// step's row once every worker has reported it (job/run_folder.h
// MetricsRow: mean loss, slowest times, summed bytes), which rows have been
// taken for metrics.csv, and the divergence watch over them.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_METRICS_TABLE_H_
#define ONEBIT_COORDINATOR_METRICS_TABLE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "job/loss_watch.h"
#include "job/run_folder.h"
#include "proto/control.pb.h"

namespace onebit {

class MetricsTable {
 public:
  // A resumed job: `prior_rows`, metrics.csv's rows of the steps before
  // its checkpoint, count for the summary and the divergence watch.
  void Resume(std::vector<MetricsRow> prior_rows);
  // The rows before `step` are written already (resuming from its checkpoint).
  void SkipTo(uint64_t step) { taken_ = step; }

  // Worker `rank` (of `workers`) reports `m` having run `steps_done` of a
  // job of `job_steps` (0: not fixed). A row written already is ignored;
  // one beyond the steps the worker has run (or the job has) is refused:
  // returned is what to log, so that what a worker can make the coordinator
  // hold is bounded by the steps it has run.
  std::optional<std::string> Add(uint32_t rank, const control::StepMetrics& m, uint64_t steps_done,
                                 uint64_t job_steps, size_t workers);

  // The prior rows, then every complete row so far (step order).
  std::vector<MetricsRow> Rows(size_t workers) const;
  // The rows completed since the last call, in step order; each passes the
  // divergence watch (job/loss_watch.h), which logs a warning naming
  // remedy() the first time the loss is found to have diverged.
  std::vector<MetricsRow> TakeNew(size_t workers, absl::FunctionRef<std::string()> remedy);
  // A roll-back: the rows not taken yet are reported again (those taken
  // stay: the steps run again reproduce them bit for bit).
  void DropUntaken();

  const std::vector<MetricsRow>& prior_rows() const { return prior_rows_; }
  // Every row before this step has been taken (or was written before).
  uint64_t taken() const { return taken_; }
  bool diverged() const { return loss_watch_.diverged(); }

 private:
  // The row of `step` once each of `workers` has reported it.
  std::optional<MetricsRow> Row(uint64_t step, size_t workers) const;

  // step -> per-worker metrics of that step
  std::map<uint64_t, std::vector<std::optional<control::StepMetrics>>> reports_;
  uint64_t taken_ = 0;                  // TakeNew: the next step's row
  LossWatch loss_watch_;                // over prior_rows_, then the rows taken
  std::vector<MetricsRow> prior_rows_;  // before a resumed job's checkpoint
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_METRICS_TABLE_H_
