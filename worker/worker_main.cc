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
#include "job/run_folder.h"
#include "job/security_flags.h"
#include "models/model.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "onebit/worker.h"
#include "worker/device.h"
#include "worker/worker_internal.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator address host:port (required)");
ABSL_FLAG(int32_t, rank, -1, "worker rank to request; -1: any free one");
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

int Main(int argc, char** argv) {
  KeepLargeBuffers();
  ParseFlagsOrExit(argc, argv,
                   "onebit-worker --coordinator HOST:PORT [--rank R] [--device D]\n"
                   "Trains the job's built-in model: computes gradients, pushes them to the "
                   "servers, applies the replies.");
  WorkerOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (o.coordinator.empty()) ExitFlagError("coordinator", "required");
  o.rank = absl::GetFlag(FLAGS_rank);
  if (o.rank < -1) ExitFlagError("rank", "must be -1 (any) or a rank");
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
  // A --device this machine cannot use is a usage error (exit 2), found
  // before joining so that it holds up no job; Connect chooses it again.
  if (auto choice = ChooseDevice(o.device); !choice.ok()) {
    ExitError(2, std::string(choice.status().message()));
  }
  // Last: every other flag is checked first.
  const SecurityFlags security = SecurityFlagsOrExit();
  o.secret_file = security.secret_file;
  o.insecure = security.insecure;
  // SIGTERM (Kubernetes, onebit-launch): stop the job after a checkpoint.
  o.stop_signal = StopOnSignals();
  auto connected = ConnectWithModel(o, NewModel);
  if (!connected.ok()) ExitError(1, std::string(connected.status().message()));
  Worker& w = **connected;
  const uint32_t rank = w.rank();
  auto fail = [&](absl::string_view what, const absl::Status& st) {
    ExitError(1, absl::StrCat("worker ", rank, ": ", what, st.message()));
  };
  Replica& rep = WorkerAccess::replica(w);
  const control::TrainingConfig& cfg = WorkerAccess::config(w);
  std::fprintf(stderr, "worker %u: training on %s\n", rank, w.device().c_str());
  if (absl::Status st = w.BroadcastParameters(); !st.ok() && !IsRolledBack(st)) fail("", st);

  const uint64_t steps = cfg.steps();
  const uint64_t per_epoch = WorkerAccess::model(w)->steps_per_epoch();
  const bool evaluate = rank == 0 && cfg.eval_every() > 0 && rep.can_evaluate();
  double last_accuracy = -1;
  const int64_t stall = absl::GetFlag(FLAGS_stall_at_step);
  const bool overlap = absl::GetFlag(FLAGS_overlap);
  const absl::Duration progress_every = absl::GetFlag(FLAGS_progress_interval);
  const absl::Time t0 = absl::Now();
  absl::Time last_progress = t0;
  uint64_t total_up = 0, total_down = 0, total_chunks = 0, overlapped = 0;
  // Seconds of forward + backward per step (pushes excluded), by phase.
  std::vector<double> fwd_bwd_warmup, fwd_bwd_compress;
  // A resumed job continues at its checkpoint's step; the data order is the
  // step's. So does a job that rolled back (then steps_done() went back).
  const uint64_t first = w.steps_done();
  // What the worker said about a push or a step: the job rolled back (that
  // step again), stopped on request, or failed (which exits here).
  enum class Next { kGoOn, kRetry, kStop };
  auto outcome = [&](const absl::Status& st) {
    if (st.ok()) return Next::kGoOn;
    if (IsRolledBack(st) || absl::IsCancelled(st)) {
      std::fprintf(stderr, "worker %u: %s\n", rank, std::string(st.message()).c_str());
      return IsRolledBack(st) ? Next::kRetry : Next::kStop;
    }
    fail("", st);
    return Next::kStop;  // not reached
  };
  // Finish() too may find that the job rolled back.
  while (true) {
    for (uint64_t step = w.steps_done(); step < steps; step = w.steps_done()) {
      if (stall >= 0 && step == static_cast<uint64_t>(stall)) {
        std::fprintf(stderr, "worker %u: stalling at step %llu (--stall_at_step)\n", rank,
                     static_cast<unsigned long long>(step));
        absl::Status st;
        while ((st = WorkerAccess::WaitForJobEnd(w, absl::Seconds(1))).ok()) {
        }
        fail("", WorkerAccess::Fail(w, st));  // with the rows of the steps before
      }
      absl::Status pushed;       // a push's error: the worker has handled it already
      absl::Duration in_pushes;  // of the backward's time, the releases' (encoding, sending)
      auto release = [&](uint64_t b, uint64_t e) {
        const absl::Time p0 = absl::Now();
        pushed = w.GradientsReady(b, e);
        in_pushes += absl::Now() - p0;
        return pushed;
      };
      const absl::Time g0 = absl::Now();
      auto loss = overlap ? rep.ComputeGradientInParts(rank, step, release)
                          : rep.ComputeGradient(rank, step);
      const double fwd_bwd_s = absl::ToDoubleSeconds(absl::Now() - g0 - in_pushes);
      if (Next n = outcome(pushed); n != Next::kGoOn) {
        if (n == Next::kRetry) continue;
        return absl::GetFlag(FLAGS_exit_code_when_stopped);
      }
      if (!loss.ok()) fail("", WorkerAccess::Fail(w, loss.status()));
      StepOptions so;
      so.loss = *loss;
      if (per_epoch > 0) so.epoch = static_cast<double>(step + 1) / per_epoch;
      auto stats = w.Step(so);
      if (Next n = outcome(stats.status()); n != Next::kGoOn) {
        if (n == Next::kRetry) continue;
        return absl::GetFlag(FLAGS_exit_code_when_stopped);
      }
      // Rank 0 scores its replica (equal to every other) on the test set.
      if (evaluate && ((step + 1) % cfg.eval_every() == 0 || step + 1 == steps)) {
        auto eval = rep.Evaluate();
        if (!eval.ok()) {
          fail("", WorkerAccess::Fail(
                       w, absl::Status(eval.status().code(),
                                       absl::StrCat("evaluation: ", eval.status().message()))));
        }
        if (absl::Status st = w.ReportEvaluation(eval->loss, eval->accuracy); !st.ok())
          fail("", st);
        last_accuracy = eval->accuracy;
      }
      total_up += stats->bytes_up;
      total_down += stats->bytes_down;
      total_chunks += stats->chunks;
      (stats->compressed ? fwd_bwd_compress : fwd_bwd_warmup).push_back(fwd_bwd_s);
      overlapped += stats->chunks_overlapped;
      const absl::Time now = absl::Now();
      if (now - last_progress >= progress_every || step + 1 == steps) {
        last_progress = now;
        const double elapsed = absl::ToDoubleSeconds(now - t0);
        const double rate = static_cast<double>(step + 1 - first) / std::max(elapsed, 1e-9);
        const std::string epoch =
            per_epoch > 0 ? absl::StrFormat(" epoch %.2f", so.epoch) : std::string();
        const std::string acc =
            last_accuracy >= 0 ? absl::StrFormat(" test acc %.4f", last_accuracy) : std::string();
        std::fprintf(stderr,
                     "worker %u: step %llu/%llu%s loss %.6g%s %s %.2f steps/s up %.1f MB down %.1f "
                     "MB ETA %.0fs\n",
                     rank, static_cast<unsigned long long>(step + 1),
                     static_cast<unsigned long long>(steps), epoch.c_str(), *loss, acc.c_str(),
                     stats->compressed ? "compress" : "warmup", rate, total_up / 1e6,
                     total_down / 1e6, static_cast<double>(steps - step - 1) / rate);
      }
    }

    std::fprintf(
        stderr, "worker %u: %llu of %llu chunks (%.1f %%) went out during the backward%s\n", rank,
        static_cast<unsigned long long>(overlapped), static_cast<unsigned long long>(total_chunks),
        total_chunks > 0 ? 100.0 * overlapped / total_chunks : 0.0,
        overlap ? "" : " (--overlap=false)");
    // Under the same load as the steps: what a step cannot be faster than.
    auto median_ms = [](std::vector<double> v) {
      if (v.empty()) return std::string("-");
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      return absl::StrFormat("%.3f", v[v.size() / 2] * 1e3);
    };
    std::fprintf(stderr,
                 "worker %u: forward + backward per step (median ms): warm-up %s, compression %s\n",
                 rank, median_ms(fwd_bwd_warmup).c_str(), median_ms(fwd_bwd_compress).c_str());
    const std::string dump = absl::GetFlag(FLAGS_dump_x);
    if (!dump.empty()) {
      std::vector<float> x(w.num_params());
      absl::Status st = w.ReadParams(x.data());
      if (st.ok()) st = WriteFloats(dump, x);
      if (!st.ok()) {
        fail("", WorkerAccess::Fail(
                     w, absl::Status(st.code(), absl::StrCat("--dump_x: ", st.message()))));
      }
    }
    absl::Status finished = w.Finish();
    if (IsRolledBack(finished)) {
      std::fprintf(stderr, "worker %u: %s\n", rank, std::string(finished.message()).c_str());
      continue;
    }
    if (!finished.ok()) fail("", finished);
    break;
  }
  return 0;
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
