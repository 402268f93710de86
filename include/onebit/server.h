// onebit-ps's other two roles as library calls: a parameter server holding
// one shard of the master copy and its optimizer state, and the coordinator
// that forms the cluster and watches it. onebit-server and
// onebit-coordinator are thin programs over these; a program may also run
// them itself (e.g. a server beside a worker in one process, on a thread).
//
// Both block until the job is over, return OK when it ended well and an error
// naming the cause otherwise, and never exit. They may run on any thread;
// each call is independent (no global state).
#ifndef ONEBIT_SERVER_H_
#define ONEBIT_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace onebit {

struct ServerOptions {
  // "host:port" of the job's coordinator. Required.
  std::string coordinator;
  // The job secret (a file of at least 32 bytes, e.g. 64 hex digits; every
  // process of the job must have the same): both planes are authenticated
  // and encrypted with keys made from it. Empty: $ONEBIT_SECRET_FILE. One
  // of a secret and `insecure` is required.
  std::string secret_file;
  // No secret: neither plane is authenticated or encrypted (trusted
  // networks and tests only).
  bool insecure = false;
  // The shard (server rank) to serve; -1: any free one.
  int shard = -1;
  // Where the ZeroMQ data port and the grpc.health.v1 port listen; port 0:
  // any free one.
  std::string bind_host = "0.0.0.0";
  int data_port = 0;
  int health_port = 0;
  // The address workers reach this server at; default: the hostname.
  std::string advertise_host;
  // How long to wait for the coordinator and the whole cluster; > 0, finite.
  absl::Duration register_timeout = absl::Seconds(60);
  // Prometheus metrics of this shard (bytes pushed and replied by phase,
  // step and update times, refused requests by reason, pending pushes,
  // checkpoint writes, roll-backs; labels role="server", shard) over HTTP
  // at /metrics on metrics_host:metrics_port; -1: none, 0: any free port
  // (the log says which). metrics_host empty: bind_host. After the job,
  // they stay up metrics_linger (ended early by stop_signal; at most 1 h).
  int metrics_port = -1;
  std::string metrics_host;
  absl::Duration metrics_linger = absl::ZeroDuration();
  // When not empty: the final master shard and server error, raw fp32.
  std::string dump_x;
  std::string dump_error;
  // When set and it becomes non-zero (a signal number, e.g. from a SIGTERM
  // handler), the job stops after a checkpoint at the next step boundary
  // (and this returns CANCELLED), or fails where it has no --checkpoint_dir.
  const std::atomic<int>* stop_signal = nullptr;
};

// Registers, serves the shard until the coordinator ends the job, and reports
// the shard's checksum. OK: the job finished and this shard ran every step.
// CANCELLED: the job stopped on request after a complete checkpoint (running
// it again resumes it).
absl::Status RunServer(const ServerOptions& options);

struct CoordinatorOptions {
  // The job's settings as a JSON object, keys as onebit-coordinator's flags
  // (e.g. {"workers": 4, "servers": 2, "model": "external", "optimizer":
  // "onebit-adam"}); a DeepSpeed config's "optimizer" section works too.
  // Settings not given take their defaults.
  std::string config_json = "{}";
  // As ServerOptions::secret_file and ::insecure.
  std::string secret_file;
  bool insecure = false;
  std::string bind_host = "0.0.0.0";
  int port = 7070;  // 0: any free port
  // A second port, on bind_host, serving only grpc.health.v1 (always
  // SERVING), in plaintext: for probes that cannot speak the main port's
  // protocol (Kubernetes' gRPC probes). 0: any free port.
  int health_port = 0;
  // Called once listening, with the port (useful with port 0).
  std::function<void(int port)> on_listening;
  // Prometheus metrics of the job (steps, loss, bytes, step times, processes
  // alive, restarts, checkpoints) over HTTP at /metrics on
  // metrics_host:metrics_port; -1: none, 0: any free port (the log says
  // which). metrics_host empty: bind_host.
  int metrics_port = -1;
  std::string metrics_host;
  // After the job ends, the metrics stay up this long (ended early by
  // stop_signal), so that the next scrape sees the outcome; at most 1 h.
  absl::Duration metrics_linger = absl::ZeroDuration();
  // When not empty: the run folder. metrics.csv is appended as steps
  // complete; summary.json is written at the end, ok or failed. A folder
  // holding a finished job's summary.json is refused, not overwritten.
  std::string out;
  // When set and it becomes non-zero (a signal number, e.g. from a SIGTERM
  // handler): a job with a --checkpoint_dir stops after a checkpoint at the
  // next step boundary (the summary says "stopped: ..." and this returns
  // CANCELLED; starting the job again resumes it), any other ends as failed
  // ("stopped by SIGTERM"); the run folder is written either way.
  const std::atomic<int>* stop_signal = nullptr;
  // When not empty: a file whose first line, when stop_signal fires, says
  // who stopped the job and why, for the summary ("stopped by <line>");
  // onebit-launch writes it before it passes a stop on. Absent or empty:
  // "stopped by SIGTERM to the coordinator".
  std::string stop_reason_file;
  // How long to wait for every server and worker to register; > 0, finite.
  absl::Duration register_timeout = absl::Seconds(60);
};

// Forms the cluster, runs the job to its end and writes the run folder. OK:
// every process finished and every replica equals the masters (or, under
// --server_reply delta, trails them by design); CANCELLED: it stopped on
// request after a complete checkpoint; else the job's failure.
absl::Status RunCoordinator(const CoordinatorOptions& options);

}  // namespace onebit

#endif  // ONEBIT_SERVER_H_
