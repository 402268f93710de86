// The coordinator's view of a job between its metrics rows: what its
// Prometheus metrics (coordinator/job_metrics.h) show besides the rows.
// A plain value.
#ifndef ONEBIT_COORDINATOR_JOB_STATE_H_
#define ONEBIT_COORDINATOR_JOB_STATE_H_

#include <cstdint>
#include <optional>

namespace onebit {

// The coordinator's view of the job between rows.
struct JobState {
  uint32_t workers_expected = 0;
  uint32_t servers_expected = 0;
  uint32_t workers_alive = 0;  // registered and neither finished nor lost
  uint32_t servers_alive = 0;
  uint32_t restarts = 0;
  uint32_t rollbacks = 0;
  uint64_t rolled_back_steps = 0;
  uint64_t checkpoints = 0;  // complete checkpoints written by this coordinator's job
  uint64_t checkpoint_errors = 0;
  std::optional<uint64_t> last_checkpoint_step;
  std::optional<double> freeze_change;  // the last decided --freeze auto check
  bool finished = false;                // ended, whatever the outcome
  // Calls refused: without the job's credential, malformed (a bad role or
  // key, metrics that do not fit), registrations turned away (rank taken,
  // registration closed, a contradicting declaration); and this process's
  // failed TLS handshakes.
  uint64_t refused_unauthenticated = 0;
  uint64_t refused_malformed = 0;
  uint64_t refused_registration = 0;
  uint64_t failed_handshakes = 0;
  // What a plain fp32 parameter server moves each way in one step (d floats
  // per worker; 0 until d is known).
  uint64_t fp32_bytes_per_step = 0;
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_JOB_STATE_H_
