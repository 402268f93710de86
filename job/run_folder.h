// The run folder every launch writes (docs/design.md §2): metrics.csv, one row per
// step, and summary.json.
#ifndef ONEBIT_JOB_RUN_FOLDER_H_
#define ONEBIT_JOB_RUN_FOLDER_H_

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace onebit {

struct MetricsRow {
  uint64_t step = 0;
  std::string phase;  // "warmup" or "compress"
  double loss = 0;    // mean over workers, in rank order
  double wall_s = 0;  // max over workers, since training began
  uint64_t bytes_up = 0;
  uint64_t bytes_down = 0;
  double step_s = 0;  // max over workers of this step's duration
  double push_s = 0;  // max over workers; see StepMetrics in control.proto
  double reply_s = 0;
  double epoch = 0;                 // fractional epochs done (mlp); 0 otherwise
  std::optional<double> test_loss;  // when the test set was scored after this step
  std::optional<double> test_accuracy;
};

struct Summary {
  std::string optimizer;
  float lr = 0;  // the base learning rate of the job's schedule
  uint32_t workers = 0;
  uint32_t servers = 0;
  uint64_t params = 0;
  uint64_t steps = 0;
  std::optional<uint64_t> freeze_step;
  double wall_s = 0;
  uint64_t bytes_up = 0;
  uint64_t bytes_down = 0;
  uint64_t bytes_up_fp32 = 0;
  uint64_t bytes_down_fp32 = 0;
  std::optional<double> final_loss;
  // The loss grew by orders of magnitude (job/loss_watch.h); the job may
  // still be "ok".
  bool diverged = false;
  std::optional<double> test_accuracy;
  std::optional<double> test_loss;
  bool replicas_equal = false;
  std::string status;  // "ok" or the failure
  std::string job_id;
  std::string worker_codec;
  std::string server_codec;
  std::string error_feedback;
  std::string server_reply;
  std::string freeze;  // "step:N", "auto:...", "var_freeze_step:N"; "none": never compresses
  // --freeze auto: every decided check (steps completed, the largest change
  // of v over the shards), and why the job ran without the freeze when it
  // never fired (empty otherwise).
  std::vector<std::pair<uint64_t, double>> freeze_checks;
  std::string freeze_warning;
  float v_floor = 0;
  uint64_t v_floored = 0;  // coordinates the floor raised at the freeze
  uint64_t compress_steps = 0;
  uint64_t rounds = 0;  // steps that communicated (zero-one-adam's local steps do not)
  uint64_t bytes_up_warmup = 0;
  uint64_t bytes_up_compress = 0;
  uint64_t bytes_down_warmup = 0;
  uint64_t bytes_down_compress = 0;
  bool workers_agree = false;                     // every worker's replica equals every other's
  std::optional<double> max_replica_master_diff;  // --server-reply delta
  std::vector<std::string> worker_devices;        // by rank: "cpu", "cuda:0 (NVIDIA H200)", ...
  uint64_t checkpoints = 0;                       // complete checkpoints written
  std::optional<uint64_t> last_checkpoint_step;
  // Checkpoints that could not be written (each scheduled step at most
  // once) and the last one's error ("step 40: worker 1: cannot write ...").
  // durable: every scheduled checkpoint was written; nullopt without a
  // --checkpoint_dir. A job may end "ok" and not durable.
  uint64_t checkpoint_errors = 0;
  std::string last_checkpoint_error;
  std::optional<bool> durable;
  std::optional<uint64_t> resumed_from_step;  // the checkpoint this run continued from
  std::optional<uint64_t> stopped_at_step;    // stopped on request, checkpointed there
  uint32_t restarts = 0;                      // times the job was started again from a checkpoint
  uint64_t rolled_back_steps = 0;             // steps done after a checkpoint, lost and run again
  // Of the restarts: those the running processes rolled back for, without
  // being started again themselves (a lost process came back).
  uint32_t rollbacks = 0;
};

// Creates dir (and parents) when missing.
absl::Status MakeDirs(const std::string& dir);

// metrics.csv as the job runs: the header at Open(), rows appended and
// flushed as they complete, so a crash of anything (the coordinator
// included) leaves every row written so far. Not thread-safe.
class MetricsLog {
 public:
  // Creates or truncates `path`; writes the header and `first_rows` (a
  // resumed job's rows of the steps before its checkpoint).
  static absl::StatusOr<MetricsLog> Open(const std::string& path,
                                         const std::vector<MetricsRow>& first_rows = {});
  MetricsLog(MetricsLog&& other) noexcept;
  MetricsLog& operator=(MetricsLog&& other) noexcept;
  ~MetricsLog();

  absl::Status Append(const std::vector<MetricsRow>& rows);
  // Flushes to the disk (fsync) and closes; Append() fails after it.
  absl::Status Close();

 private:
  MetricsLog(std::FILE* f, std::string path) : f_(f), path_(std::move(path)) {}
  std::FILE* f_ = nullptr;
  std::string path_;
};

absl::Status WriteMetricsCsv(const std::string& path, const std::vector<MetricsRow>& rows);
// The rows of a metrics.csv this library wrote (a missing file: none).
// Errors name the file and line.
absl::StatusOr<std::vector<MetricsRow>> ReadMetricsCsv(const std::string& path);
// Atomic (a temporary file, fsync, rename) and always valid JSON: a
// non-finite number is written as null; fp32 settings (lr, v_floor) as the
// shortest text that reads back as the same float (0.002, not
// 0.0020000000949949026).
absl::Status WriteSummaryJson(const std::string& path, const Summary& s);
// What an earlier run's summary.json says of the job's restarts; nullopt
// when there is none or it does not say.
struct RestartHistory {
  uint32_t restarts = 0;
  uint64_t rolled_back_steps = 0;
};
std::optional<RestartHistory> ReadRestartHistory(const std::string& summary_path);
// A finished job's summary.json ("status": "ok") in `dir`: an error naming
// it, so that a new job does not overwrite its results; OK otherwise.
absl::Status CheckNotFinished(const std::string& dir);
// Writes v as raw fp32 (the --dump_x files); errors name the path.
absl::Status WriteFloats(const std::string& path, const std::vector<float>& v);
// JSON string literal with escapes.
std::string JsonQuote(const std::string& s);

}  // namespace onebit

#endif  // ONEBIT_JOB_RUN_FOLDER_H_
