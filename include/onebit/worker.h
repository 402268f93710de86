// onebit-ps from the worker's side: the training loop is yours, the optimizer
// is the job's. A Worker joins a job (onebit-coordinator, onebit-launch),
// holds the model's parameters as one flat fp32 vector, and turns each
// step's gradient into an update through the parameter servers: momentum,
// error feedback and 1-bit compression on the way out, the servers' reply
// applied on the way back, so every worker's parameters stay equal, bit for
// bit, to every other's and to the servers' master copy.
//
//   onebit::WorkerOptions o;
//   o.coordinator = "10.0.0.1:7070";
//   o.num_params = d;
//   auto w = onebit::Worker::Connect(o);          // check w.ok()
//   InitMyModel((*w)->params());                  // any values: rank 0's win
//   (*w)->BroadcastParameters();
//   while ((*w)->steps_done() < steps) {           // resumed or rolled back: there
//     onebit::StepOptions s;
//     s.loss = MyBackward(MyBatch((*w)->steps_done()), (*w)->params(), (*w)->grads());
//     auto stats = (*w)->Step(s);                  // IsRolledBack: go on
//   }
//   (*w)->Finish();
//
// Every call returns an error instead of exiting; after a failed call the
// worker has told the coordinator, the job is over, and later calls return
// the same error. One exception: IsRolledBack(error) (see there), after
// which the worker goes on. Calls must not overlap (one thread at a time; they may come
// from different threads).
#ifndef ONEBIT_WORKER_H_
#define ONEBIT_WORKER_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace onebit {

// Parameters [begin, end) whose decoupled weight decay is `weight_decay`
// instead of the job's (e.g. 0 for biases and norms).
struct WeightDecayRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  float weight_decay = 0.0f;
};

// Parameters [begin, end) that step at the job's learning rate times
// `scale` (param groups with their own lr, e.g. layer-wise lr decay). The
// scale multiplies the lr of every step, so a schedule (or
// set_learning_rate) moves all ranges alike.
struct LearningRateScale {
  uint64_t begin = 0;
  uint64_t end = 0;
  float scale = 1.0f;
};

struct WorkerOptions {
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
  // The rank to ask for; -1: any free one.
  int rank = -1;
  // In a job of K local ranks per worker (--local_ranks K: a host's K GPUs
  // or processes push as one worker), this process's place in its worker:
  // 0 joins the job as the worker, adds its local ranks' gradients (mean,
  // in local-rank order) and pushes for the host; 1..K-1 hand their
  // gradient to it through shared memory and take the new parameters from
  // it, on the same host, with the same `coordinator` and `rank` (their
  // worker's, required). Their calls are the worker's, made together;
  // GradientsReady pushes nothing early (the host's gradient is whole at
  // Step), DeferGradientScale is not available, ReportEvaluation on a
  // local rank >= 1 does nothing and GatherOptimizerState is local rank
  // 0's. On a GPU the gradients meet in host memory (copied there and back).
  int local_rank = 0;
  // d, the length of params() and grads(): the number of parameters of your
  // model. Every worker must declare the same d; a --model external job is
  // sharded by it. 0: the job's built-in model decides (onebit-worker).
  uint64_t num_params = 0;
  // Ranges of x with their own weight decay: sorted, disjoint, within d.
  // Every worker must declare the same, else the job fails naming both.
  std::vector<WeightDecayRange> weight_decay;
  // Ranges of x with their own lr scale: sorted, disjoint, within d, each
  // scale finite and >= 0. Every worker must declare the same, else the job
  // fails naming both.
  std::vector<LearningRateScale> lr_scale;
  // The ends of your model's tensors in x, in order, the last one d (for
  // W0 of 784 x 256 then b0 of 256: {200704, 200960, ...}). onebit-lamb's
  // trust ratios are per tensor, and a --model external job using it
  // needs them; other optimizers ignore them. Every worker must declare
  // the same, else the job fails naming both.
  std::vector<uint64_t> layer_ends;
  // Your model's tensors outside params() (buffers such as batch-norm
  // statistics, frozen parameters), by name with a CRC-32 of their bytes.
  // The job does not train or broadcast them, so every rank must start
  // them equal: every worker must declare the same list, else the job fails
  // naming the first tensor that differs. Empty: nothing to check.
  struct LocalTensor {
    std::string name;
    uint32_t crc32 = 0;
  };
  std::vector<LocalTensor> local_state;
  // Job settings your program chooses, name -> value as onebit-coordinator's
  // flags take them (e.g. {"optimizer", "onebit-adam"}, {"beta2", "0.99"}):
  // optimizer and compression settings only. They apply where the job left
  // the default; one the job sets to another value fails the job naming
  // both, and every worker must declare the same. job() shows the result.
  std::map<std::string, std::string> settings;
  // Where params() and grads() live: "cpu" (host memory); "cuda" or
  // "cuda:N" (a GPU; an error when none is usable or the library was built
  // without CUDA); "auto" (GPU 0 when usable, else the CPU); "cuda-twin"
  // (the GPU code path on the CPU, for tests).
  std::string device = "cpu";
  // This worker's address for the cluster status; default: the hostname.
  std::string advertise_host;
  // Where its grpc.health.v1 service listens; port 0: any free port.
  std::string bind_host = "0.0.0.0";
  int health_port = 0;
  // How long to wait for the coordinator and the rest of the cluster; > 0,
  // finite.
  absl::Duration register_timeout = absl::Seconds(60);
  // Prometheus metrics of this worker (steps and their parts as
  // histograms: gradient, push, wait, apply; bytes up and down by phase,
  // the compression ratio, rounds and local steps, the loss reported;
  // labels role="worker", rank) over HTTP at /metrics on
  // metrics_host:metrics_port; -1: none, 0: any free port (the log says
  // which). metrics_host empty: bind_host. A successful Finish() returns
  // only after metrics_linger more (ended early by stop_signal; at most
  // 1 h), so that the last scrape sees the end.
  int metrics_port = -1;
  std::string metrics_host;
  absl::Duration metrics_linger = absl::ZeroDuration();
  // When set and it becomes non-zero (a signal number, e.g. from a SIGTERM
  // handler), the job stops after a checkpoint at the next step boundary:
  // Step() then returns CANCELLED (see there).
  const std::atomic<int>* stop_signal = nullptr;
};

// Options from the environment onebit-launch --worker_cmd (or a Kubernetes
// manifest) sets: ONEBIT_COORDINATOR (required), ONEBIT_RANK (else RANK;
// else any), ONEBIT_LOCAL_RANK (local_rank; else 0), ONEBIT_DEVICE, ONEBIT_ADVERTISE_HOST,
// ONEBIT_SECRET_FILE (see secret_file), ONEBIT_INSECURE=1 (insecure), ONEBIT_METRICS_PORT,
// ONEBIT_METRICS_HOST, ONEBIT_METRICS_LINGER (e.g. "8s"); `num_params` as
// given.
// An error names a missing or malformed variable.
absl::StatusOr<WorkerOptions> WorkerOptionsFromEnvironment(uint64_t num_params);

// For programs that should survive preemption: catches SIGTERM (what
// Kubernetes sends) and SIGINT process-wide, where their disposition is
// still the default, and returns the flag to pass as
// WorkerOptions::stop_signal. The first signal asks the job to stop after a
// checkpoint; a second ends the process as before. Safe to call again.
const std::atomic<int>* StopOnSignals();

// Whether `status` (from Step, GradientsReady, BroadcastParameters or
// Finish) says that the job rolled back to its last complete checkpoint: a
// process was lost and came back, or the coordinator was restarted. The
// worker has rejoined: params() hold the checkpoint's x and steps_done()
// its step. Continue your loop, and your data order, at steps_done(), as
// after a resume; the job ends bit for bit where it would have.
bool IsRolledBack(const absl::Status& status);

// The job this worker belongs to, fixed once Connect returns.
struct JobInfo {
  uint64_t job_id = 0;
  uint32_t rank = 0;
  uint32_t workers = 0;
  // --local_ranks K, and this process's local rank in [0, K): its data is
  // that of rank * K + local_rank among workers * K.
  uint32_t local_ranks = 1;
  uint32_t local_rank = 0;
  uint32_t servers = 0;
  uint64_t num_params = 0;
  // Steps the job runs; 0: until every worker has called Finish().
  uint64_t steps = 0;
  std::string model;      // "external" for your own, or a built-in's name
  std::string optimizer;  // "onebit-adam", "adam", "ef-sgd", ...
  float lr = 0;           // the base learning rate of the job's schedule
  // Every job setting as a JSON object, by the flags' names
  // ({"lr": 0.01, "optimizer": "onebit-adam", "step_timeout": "30s", ...}).
  std::string config_json;
};

struct StepOptions {
  // Your loss at this step, for metrics.csv and the coordinator's divergence
  // watch. A reported loss that is not finite (NaN, ±inf, or beyond fp32's
  // range, in which metrics travel) fails the step and the job, before
  // anything is applied, with an error naming the rank, the step and the
  // value, as the built-in models' losses do.
  // Reported: has_loss is true, or loss is not NaN. So a NaN without
  // has_loss means "none reported" (the default, and what programs written
  // before has_loss pass); set has_loss to have a NaN loss fail the step.
  double loss = std::numeric_limits<double>::quiet_NaN();
  bool has_loss = false;
  // Fractional epochs done after this step, for metrics.csv (0: none).
  double epoch = 0;
  // The factor this step's gradients count with, given exactly when the
  // step was made to wait for one (Worker::DeferGradientScale): finite,
  // >= 0 (a clip coefficient).
  std::optional<float> gradient_scale;
};

// The job's optimizer state as of the start of step `step`, gathered from
// every server and this worker (Worker::GatherOptimizerState).
struct OptimizerState {
  uint64_t step = 0;    // steps completed
  bool frozen = false;  // in the compression phase: v is frozen
  // The servers' arrays, d floats each, in x's order: "x" (the master copy),
  // and those the job's optimizer holds there now: "m" (Adam's first
  // moment; the warm-up's, or 0/1 Adam's and 1-bit LAMB's), "v" (the
  // second moment; frozen after the freeze), "den" (the frozen sqrt(v) +
  // eps), "e" (the servers' error feedback).
  std::map<std::string, std::vector<float>> server;
  // This worker's own, d floats each: "mbar" (after the freeze the momentum
  // its replica steps with: the servers' averaged one under momentum
  // replies), "e" (its error feedback), "den", "v", "x_sync" (0/1 Adam).
  std::map<std::string, std::vector<float>> worker;
  // The Adam steps a seeded state had taken before this job
  // (SeedOptimizerState): bias correction counts from bias_steps + step.
  uint64_t bias_steps = 0;
};

// An Adam state taken elsewhere, e.g. torch.optim.AdamW's exp_avg,
// exp_avg_sq and step, to start a job from (Worker::SeedOptimizerState).
struct AdamSeed {
  uint64_t steps = 0;    // Adam steps it has taken; bias correction goes on from them
  std::vector<float> m;  // the first moment, d floats in x's order
  std::vector<float> v;  // the second moment (not bias-corrected), d floats, >= 0
};

struct StepStats {
  uint64_t step = 0;        // the step just completed (0-based)
  bool compressed = false;  // it ran in the compression phase (1-bit)
  uint64_t bytes_up = 0;    // sent to the servers, headers included
  uint64_t bytes_down = 0;  // received from them
  double step_s = 0;        // from the first push to the last reply applied
  double push_s = 0;        // see metrics.csv: same-host clocks only
  double reply_s = 0;
  // Chunks the step pushed, and how many of them went out before its last
  // GradientsReady() call, i.e. while the rest of the backward was running.
  uint64_t chunks = 0;
  uint64_t chunks_overlapped = 0;
};

class Worker {
 public:
  // Registers with the coordinator and waits until the whole cluster has
  // (at most options.register_timeout), then connects to every server.
  // params() and grads() are zero.
  static absl::StatusOr<std::unique_ptr<Worker>> Connect(const WorkerOptions& options);

  // Without Finish(), tells the coordinator that this worker left: the job
  // fails rather than waiting for it.
  ~Worker();

  const JobInfo& job() const;
  uint32_t rank() const { return job().rank; }
  uint64_t num_params() const { return job().num_params; }
  // Where the buffers live, e.g. "cpu" or "cuda:0 (NVIDIA H200)"; and
  // whether that is device memory (then params() and grads() are device
  // pointers).
  const std::string& device() const;
  bool on_device() const;

  // The parameters x[0, d) and the gradient g[0, d). Your model reads x and
  // writes g; Step() reads g and updates x. Write x yourself only before
  // BroadcastParameters(). g is scratch for Step(): write all of it every
  // step. The pointers stay valid for the Worker's life.
  float* params();
  float* grads();

  // Before the first step: rank 0's params() become every worker's and the
  // servers' master copy, so each rank may initialise its model its own
  // way. Blocks until this worker has them. In a job that resumed from a
  // checkpoint (steps_done() > 0 right after Connect), every rank gets the
  // checkpoint's x instead: continue your loop, and your data order, at
  // steps_done().
  absl::Status BroadcastParameters();

  // The learning rate of this step and the following ones (until changed),
  // instead of the job's schedule; every worker must set the same, else the
  // step fails and nothing is applied. Call before the step's first
  // GradientsReady(); lr finite and >= 0.
  absl::Status SetLearningRate(float lr);

  // Overlap: g[begin, end) is final for the current step, so the chunks it
  // completes are compressed and pushed now, while you compute the rest.
  // Ranges may come in any order and overlap; the result equals a plain
  // Step(). x must not change meanwhile: replies are applied in Step().
  absl::Status GradientsReady(uint64_t begin, uint64_t end);

  // Completes the step: pushes what GradientsReady has not, waits for every
  // server's reply (each wait bounded by the job's step timeout) and applies
  // them to params().
  //
  // INVALID_ARGUMENT: options.loss was reported and is not finite (see
  // StepOptions); the job has failed, as after any other error.
  // CANCELLED: the job stopped on request (a SIGTERM to one of its
  // processes) before this step, after a complete checkpoint of
  // steps_done() steps; the message says by whom. Exit successfully without
  // Finish(): running the job again resumes it there.
  // IsRolledBack(): the step did not happen; the job continues at
  // steps_done() (see IsRolledBack).
  absl::StatusOr<StepStats> Step(const StepOptions& options = {});

  // Your test-set score after the step just completed, for metrics.csv
  // (test_loss, test_accuracy) and, from rank 0, summary.json. Call between
  // Step() and the next step's first push. An error before the first step.
  absl::Status ReportEvaluation(double test_loss, double test_accuracy);

  // Steps completed (from the checkpoint's step in a resumed job), and
  // whether the next runs in the compression phase.
  uint64_t steps_done() const;
  bool compressing() const;

  // Copies params() to host memory (d floats).
  absl::Status ReadParams(float* out) const;

  // The optimizer state as of now, for inspection or to continue elsewhere
  // (the job's own --checkpoint_dir stays the way to resume it): requires
  // BroadcastParameters() and no step in progress (not between a
  // GradientsReady and its Step). Every server answers from its shard
  // without changing anything; the other workers need not take part. Holds
  // up to 5 d floats from the servers and 5 d of this worker's.
  absl::StatusOr<OptimizerState> GatherOptimizerState();

  // Starts the job's optimizer from `seed` instead of zero moments: Adam's
  // m and v on every shard, and seed.steps as the steps bias correction
  // has counted. Requires BroadcastParameters(), a job at step 0 (not
  // resumed from a checkpoint), no GradientsReady yet, and an optimizer
  // whose state is then Adam's on the servers alone (adam, onebit-adam,
  // naive-onebit-adam). Rank 0 sends it and waits until every server has
  // it; any other rank checks it only (rank 0's becomes the job's, as its
  // parameters do). A seed of the wrong size or with a value that is not
  // finite (v < 0) is refused naming the element, and changes nothing.
  absl::Status SeedOptimizerState(const AdamSeed& seed);

  // For a dynamic loss scale (torch's GradScaler): whether any rank's
  // gradient of the coming step overflowed, given this rank's
  // `found_inf`. Every rank calls it before the step's first
  // GradientsReady; it returns once all have (through server 0). When it
  // returns true every rank must skip the step (push nothing; the step
  // does not advance) and vote again before the next try.
  absl::StatusOr<bool> AgreeOnOverflow(bool found_inf);

  // Clipping with overlap: the coming step pushes its gradients as
  // GradientsReady releases them, before the factor they count with is
  // known; Step(StepOptions{.gradient_scale = s}) then sends s to every
  // server, which multiplies each of this worker's pushes by it (in
  // float32) before summing: bitwise what multiplying the gradient by s
  // before pushing gives. Possible only while CanDeferGradientScale():
  // the step pushes the gradient itself, in fp32 (a warm-up step, or a
  // zero-one-adam variance step, with the default fp32 warm-up codec; not
  // a 1-bit step, whose push is made from the scaled gradient). Call
  // before the step's first GradientsReady; an error otherwise, naming the
  // reason. CanDeferGradientScale() is false for a worker that can take no
  // step (failed, stopped or finished).
  bool CanDeferGradientScale() const;
  absl::Status DeferGradientScale();

  // Ends this worker's part: sends the checksums of its parameters to the
  // coordinator, which compares them with every other replica and the
  // masters. In a job with a fixed step count, call it after the last step.
  absl::Status Finish();

  // Ends the job now with this reason (shown by the coordinator).
  void Abort(absl::string_view reason);

  struct Impl;

 private:
  explicit Worker(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend struct WorkerAccess;
};

}  // namespace onebit

#endif  // ONEBIT_WORKER_H_
