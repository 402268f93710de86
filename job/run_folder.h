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
#include "proto/run.pb.h"

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
// summary.json (proto/run.proto), atomically (a temporary file, fsync,
// rename): one line per field in field order, numbers as JSON numbers (not
// protobuf's quoted 64-bit integers), an unset optional field and a
// non-finite number as null; fp32 settings (lr, v_floor) as the shortest
// text that reads back as the same float (0.002, not 0.0020000000949949026).
// Fills in compress_ratio_up/down from the byte counts.
absl::Status WriteSummaryJson(const std::string& path, const run::Summary& s);
// A summary.json read with protobuf's JSON parser (fields it does not know
// are skipped: a newer writer's). Errors: NotFound when there is no file;
// InvalidArgument naming the file and the problem.
absl::StatusOr<run::Summary> ReadSummaryJson(const std::string& path);
// What an earlier run's summary.json says of the job's restarts; nullopt
// when there is none or it cannot be read.
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
