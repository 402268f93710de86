// onebit-worker: the built-in models (models/registry.h) trained by the
// library's Worker (include/onebit/worker.h): gradient -> Step() -> repeat,
// with the test set scored on rank 0 and a progress line.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "job/flags.h"
#include "job/metrics_flags.h"
#include "job/run_folder.h"
#include "job/security_flags.h"
#include "metrics/endpoint.h"
#include "models/model.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "onebit/worker.h"
#include "util/crash_report.h"
#include "util/process_exit.h"
#include "worker/device.h"
#include "worker/worker_internal.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator address host:port (required)");
ABSL_FLAG(int32_t, rank, -1, "worker rank to request; -1: any free one");
ABSL_FLAG(int32_t, local_rank, 0,
          "with --local_ranks K in the job: this process's local rank in [0, K); 0 is the worker "
          "(it pushes the mean of its local ranks' gradients), 1..K-1 join it on this host "
          "(--rank names the worker, required)");
ABSL_FLAG(std::string, bind_host, "0.0.0.0", "address to bind the health port on");
ABSL_FLAG(std::string, advertise_host, "", "this worker's address for others (default: hostname)");
ABSL_FLAG(int32_t, health_port, 0, "grpc.health.v1 port; 0: any free port");
ABSL_FLAG(absl::Duration, register_timeout, absl::Seconds(60),
          "how long to wait for the coordinator and the whole cluster to register");
ABSL_FLAG(std::string, dump_x, "", "write the final replica (raw fp32) to this file");
ABSL_FLAG(int64_t, stall_at_step, -1,
          "fault injection for tests: stop pushing at this step (hang until killed or aborted)");
ABSL_FLAG(std::string, device, "auto",
          "where the replica, its optimizer state and the gradient live: cpu; cuda or cuda:N "
          "(a GPU; an error when none is usable); auto (GPU 0 when one is usable, else the "
          "CPU); cuda-twin (the GPU worker's code on the CPU twins of its kernels, for "
          "testing without a GPU)");
ABSL_FLAG(int32_t, exit_code_when_stopped, 0,
          "exit with this code when the job stopped on request (SIGTERM to one of its processes) "
          "after a complete checkpoint; e.g. 75, which a Kubernetes Job's podFailurePolicy ignores "
          "(deploy/k8s): the pod is started again and the job resumes");
ABSL_FLAG(bool, overlap, true,
          "push each part of the gradient as soon as the backward has finished it (the mlp: "
          "layer by layer, the last layer first), while the rest is computed; false: push "
          "after the whole backward. The results are the same bit for bit");
ABSL_FLAG(absl::Duration, progress_interval, absl::Seconds(1),
          "how often to print the progress line on stderr (0: after every step)");

namespace onebit {
namespace {

// The worker's options from its flags; exits naming the flag at a bad one.
WorkerOptions OptionsFromFlags() {
  WorkerOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (o.coordinator.empty()) ExitFlagError("coordinator", "required");
  o.rank = absl::GetFlag(FLAGS_rank);
  if (o.rank < -1) ExitFlagError("rank", "must be -1 (any) or a rank");
  o.local_rank = absl::GetFlag(FLAGS_local_rank);
  if (o.local_rank < 0 || o.local_rank > 255) ExitFlagError("local_rank", "must be in [0, 256)");
  if (o.local_rank > 0 && o.rank < 0) {
    ExitFlagError("local_rank", "a local rank >= 1 needs --rank (its worker's)");
  }
  if (const int code = absl::GetFlag(FLAGS_exit_code_when_stopped); code < 0 || code > 255) {
    ExitFlagError("exit_code_when_stopped", "must be in [0, 255] (an exit status)");
  }
  o.health_port = absl::GetFlag(FLAGS_health_port);
  if (o.health_port < 0 || o.health_port > 65535) {
    ExitFlagError("health_port", "must be in [0, 65535]");
  }
  o.bind_host = absl::GetFlag(FLAGS_bind_host);
  o.advertise_host = absl::GetFlag(FLAGS_advertise_host);
  o.device = absl::GetFlag(FLAGS_device);
  o.register_timeout = absl::GetFlag(FLAGS_register_timeout);
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    ExitFlagError("register_timeout", st.message());
  }
  const MetricsFlags metrics = MetricsFlagsOrExit();
  o.metrics_port = metrics.port;
  o.metrics_host = metrics.host;
  o.metrics_linger = metrics.linger;
  // A --device this machine cannot use is a usage error (exit 2), found
  // before joining so that it holds up no job; Connect chooses it again.
  if (auto choice = ChooseDevice(o.device); !choice.ok()) {
    ExitError(2, std::string(choice.status().message()));
  }
  // Last: every other flag is checked first.
  const SecurityFlags security = SecurityFlagsOrExit();
  o.secret_file = security.secret_file;
  o.insecure = security.insecure;
  return o;
}

// The job's built-in model trained step by step, with its progress lines;
// a failure exits the process. One thread.
class TrainingLoop {
 public:
  explicit TrainingLoop(Worker* w)
      : w_(*w),
        rank_(w->rank()),
        data_rank_(WorkerAccess::data_rank(*w)),
        name_(w->job().local_rank > 0 ? absl::StrCat("worker ", w->rank(), ".", w->job().local_rank)
                                      : absl::StrCat("worker ", w->rank())),
        rep_(WorkerAccess::replica(*w)),
        cfg_(WorkerAccess::config(*w)),
        per_epoch_(WorkerAccess::model(*w)->steps_per_epoch()),
        evaluate_(data_rank_ == 0 && cfg_.model().eval_every() > 0 && rep_.can_evaluate()),
        stall_(absl::GetFlag(FLAGS_stall_at_step)),
        overlap_(absl::GetFlag(FLAGS_overlap)),
        progress_every_(absl::GetFlag(FLAGS_progress_interval)) {}

  // The process's exit code.
  int Run() {
    std::fprintf(stderr, "%s: training on %s\n", name_.c_str(), w_.device().c_str());
    if (absl::Status st = w_.BroadcastParameters(); !st.ok() && !IsRolledBack(st)) Fail(st);
    t0_ = last_progress_ = absl::Now();
    // A resumed job continues at its checkpoint's step; the data order is
    // the step's. So does a job that rolled back (then steps_done() went
    // back).
    first_ = w_.steps_done();
    // Finish() too may find that the job rolled back.
    while (true) {
      for (uint64_t step = w_.steps_done(); step < cfg_.model().steps(); step = w_.steps_done()) {
        if (stall_ >= 0 && step == static_cast<uint64_t>(stall_)) Stall(step);
        if (TrainStep(step) == Next::kStop) return absl::GetFlag(FLAGS_exit_code_when_stopped);
      }
      Report();
      DumpX();
      absl::Status finished = w_.Finish();
      if (IsRolledBack(finished)) {
        std::fprintf(stderr, "%s: %s\n", name_.c_str(), std::string(finished.message()).c_str());
        continue;
      }
      if (!finished.ok()) Fail(finished);
      return 0;
    }
  }

 private:
  // What the worker said about a push or a step: the job rolled back (that
  // step again), stopped on request, or failed (which exits here).
  enum class Next { kGoOn, kRetry, kStop };
  Next OutcomeOf(const absl::Status& st) {
    if (st.ok()) return Next::kGoOn;
    if (IsRolledBack(st) || absl::IsCancelled(st)) {
      std::fprintf(stderr, "%s: %s\n", name_.c_str(), std::string(st.message()).c_str());
      return IsRolledBack(st) ? Next::kRetry : Next::kStop;
    }
    Fail(st);
  }

  [[noreturn]] void Fail(const absl::Status& st) {
    ExitError(1, absl::StrCat(name_, ": ", st.message()));
  }
  // Fails the job with `st` (the worker reports it with the rows of the
  // steps before), then exits.
  [[noreturn]] void FailJob(const absl::Status& st) { Fail(WorkerAccess::Fail(w_, st)); }

  // --stall_at_step: stops pushing until the job ends without it.
  [[noreturn]] void Stall(uint64_t step) {
    std::fprintf(stderr, "worker %u: stalling at step %llu (--stall_at_step)\n", rank_,
                 static_cast<unsigned long long>(step));
    absl::Status st;
    while ((st = WorkerAccess::WaitForJobEnd(w_, absl::Seconds(1))).ok()) {
    }
    FailJob(st);
  }

  Next TrainStep(uint64_t step) {
    absl::Status pushed;       // a push's error: the worker has handled it already
    absl::Duration in_pushes;  // of the backward's time, the releases' (encoding, sending)
    auto release = [&](uint64_t b, uint64_t e) {
      const absl::Time p0 = absl::Now();
      pushed = w_.GradientsReady(b, e);
      in_pushes += absl::Now() - p0;
      return pushed;
    };
    const absl::Time g0 = absl::Now();
    auto loss = overlap_ ? rep_.ComputeGradientInParts(data_rank_, step, release)
                         : rep_.ComputeGradient(data_rank_, step);
    const double fwd_bwd_s = absl::ToDoubleSeconds(absl::Now() - g0 - in_pushes);
    if (Next n = OutcomeOf(pushed); n != Next::kGoOn) return n;
    if (!loss.ok()) FailJob(loss.status());
    StepOptions so;
    so.loss = *loss;
    if (per_epoch_ > 0) so.epoch = static_cast<double>(step + 1) / per_epoch_;
    auto stats = w_.Step(so);
    if (Next n = OutcomeOf(stats.status()); n != Next::kGoOn) return n;
    MaybeEvaluate(step);
    total_up_ += stats->bytes_up;
    total_down_ += stats->bytes_down;
    total_chunks_ += stats->chunks;
    (stats->compressed ? fwd_bwd_compress_ : fwd_bwd_warmup_).push_back(fwd_bwd_s);
    overlapped_ += stats->chunks_overlapped;
    MaybeShowProgress(step, so, *loss, stats->compressed);
    return Next::kGoOn;
  }

  // Rank 0 scores its replica (equal to every other) on the test set.
  void MaybeEvaluate(uint64_t step) {
    const uint64_t steps = cfg_.model().steps();
    if (!evaluate_ || ((step + 1) % cfg_.model().eval_every() != 0 && step + 1 != steps)) return;
    auto eval = rep_.Evaluate();
    if (!eval.ok()) {
      FailJob(absl::Status(eval.status().code(),
                           absl::StrCat("evaluation: ", eval.status().message())));
    }
    if (absl::Status st = w_.ReportEvaluation(eval->loss, eval->accuracy); !st.ok()) Fail(st);
    last_accuracy_ = eval->accuracy;
  }

  void MaybeShowProgress(uint64_t step, const StepOptions& so, double loss, bool compressed) {
    const uint64_t steps = cfg_.model().steps();
    const absl::Time now = absl::Now();
    if (now - last_progress_ < progress_every_ && step + 1 != steps) return;
    last_progress_ = now;
    const double elapsed = absl::ToDoubleSeconds(now - t0_);
    const double rate = static_cast<double>(step + 1 - first_) / std::max(elapsed, 1e-9);
    const std::string epoch =
        per_epoch_ > 0 ? absl::StrFormat(" epoch %.2f", so.epoch) : std::string();
    const std::string acc =
        last_accuracy_ >= 0 ? absl::StrFormat(" test acc %.4f", last_accuracy_) : std::string();
    std::fprintf(stderr,
                 "%s: step %llu/%llu%s loss %.6g%s %s %.2f steps/s up %.1f MB down %.1f "
                 "MB ETA %.0fs\n",
                 name_.c_str(), static_cast<unsigned long long>(step + 1),
                 static_cast<unsigned long long>(steps), epoch.c_str(), loss, acc.c_str(),
                 compressed ? "compress" : "warmup", rate, total_up_ / 1e6, total_down_ / 1e6,
                 static_cast<double>(steps - step - 1) / rate);
  }

  // The overlap achieved, and the forward + backward time per step.
  void Report() const {
    std::fprintf(stderr, "%s: %llu of %llu chunks (%.1f %%) went out during the backward%s\n",
                 name_.c_str(), static_cast<unsigned long long>(overlapped_),
                 static_cast<unsigned long long>(total_chunks_),
                 total_chunks_ > 0 ? 100.0 * overlapped_ / total_chunks_ : 0.0,
                 overlap_ ? "" : " (--overlap=false)");
    // Under the same load as the steps: what a step cannot be faster than.
    auto median_ms = [](std::vector<double> v) {
      if (v.empty()) return std::string("-");
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      return absl::StrFormat("%.3f", v[v.size() / 2] * 1e3);
    };
    std::fprintf(
        stderr, "%s: forward + backward per step (median ms): warm-up %s, compression %s\n",
        name_.c_str(), median_ms(fwd_bwd_warmup_).c_str(), median_ms(fwd_bwd_compress_).c_str());
    // Where the steps' time went (local rank 0 speaks for its host).
    if (const std::string parts = WorkerAccess::StepParts(w_); !parts.empty()) {
      std::fprintf(stderr, "%s: step parts (median ms): %s\n", name_.c_str(), parts.c_str());
    }
  }

  // --dump_x: the final replica.
  void DumpX() {
    const std::string dump = absl::GetFlag(FLAGS_dump_x);
    if (dump.empty()) return;
    std::vector<float> x(w_.num_params());
    absl::Status st = w_.ReadParams(x.data());
    if (st.ok()) st = WriteFloats(dump, x);
    if (!st.ok()) FailJob(absl::Status(st.code(), absl::StrCat("--dump_x: ", st.message())));
  }

  Worker& w_;
  const uint32_t rank_;
  const uint32_t data_rank_;  // rank_ * K + its local rank
  const std::string name_;    // "worker R", or "worker R.k" for local rank k >= 1
  Replica& rep_;
  const control::TrainingConfig& cfg_;
  const uint64_t per_epoch_;
  const bool evaluate_;
  const int64_t stall_;
  const bool overlap_;
  const absl::Duration progress_every_;
  absl::Time t0_, last_progress_;
  uint64_t first_ = 0;
  double last_accuracy_ = -1;
  uint64_t total_up_ = 0, total_down_ = 0, total_chunks_ = 0, overlapped_ = 0;
  // Seconds of forward + backward per step (pushes excluded), by phase.
  std::vector<double> fwd_bwd_warmup_, fwd_bwd_compress_;
};

int Main(int argc, char** argv) {
  ReportCrashes(argc > 0 ? argv[0] : "");
  KeepLargeBuffers();
  ParseFlagsOrExit(argc, argv,
                   "onebit-worker --coordinator HOST:PORT [--rank R] [--device D]\n"
                   "Trains the job's built-in model: computes gradients, pushes them to the "
                   "servers, applies the replies.");
  WorkerOptions o = OptionsFromFlags();
  // SIGTERM (Kubernetes, onebit-launch): stop the job after a checkpoint.
  o.stop_signal = StopOnSignals();
  auto connected = ConnectWithModel(o, NewModel);
  if (!connected.ok()) ExitError(1, std::string(connected.status().message()));
  return TrainingLoop(connected->get()).Run();
}

}  // namespace
}  // namespace onebit

// Ends without static destructors (util/process_exit.h says why).
int main(int argc, char** argv) { onebit::ExitWithoutTeardown(onebit::Main(argc, argv)); }
