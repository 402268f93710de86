// onebit-coordinator: holds the job's one training config, forms the cluster
// (ranks, shard map, server endpoints), watches heartbeats, collects metrics
// and checksums, and writes the run folder when given --out.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "net/flags.h"
#include "net/health.h"
#include "net/job_config.h"
#include "net/run_folder.h"
#include "server/coordinator.h"

ABSL_FLAG(std::string, bind_host, "0.0.0.0", "address to listen on");
ABSL_FLAG(int32_t, port, 7070, "gRPC port; 0: any free port (see --port_file)");
ABSL_FLAG(std::string, port_file, "", "write the bound port to this file once listening");
ABSL_FLAG(std::string, out, "", "run folder: metrics.csv and summary.json");
ABSL_FLAG(absl::Duration, register_timeout, absl::Seconds(60),
          "how long to wait for all servers and workers to register");

namespace onebit {
namespace {

uint64_t NewJobId() {
  std::random_device rd;
  uint64_t id = (uint64_t{rd()} << 32) ^ rd() ^
                static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return id == 0 ? 1 : id;
}

int Main(int argc, char** argv) {
  const control::TrainingConfig cfg = ConfigFromCommandLineOrExit(
      argc, argv,
      "onebit-coordinator --workers N --servers S [--model synthetic --dim D --steps T ...]\n"
      "Forms the cluster, hands out ranks and the shard map, watches it, writes --out.");
  const int port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) ExitFlagError("port", "must be in [0, 65535]");
  if (cfg.model() != kExternalModel) {
    auto map = ShardMap::Create(cfg.dim(), cfg.servers(), cfg.block_size());
    if (!map.ok()) ExitError(2, std::string(map.status().message()));
  }
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    absl::Status st = MakeDirs(out);
    if (!st.ok()) ExitFlagError("out", st.message());
  }

  const uint64_t job_id = NewJobId();
  CoordinatorService service(cfg, job_id, absl::GetFlag(FLAGS_register_timeout));
  EnableHealthService();
  grpc::ServerBuilder builder;
  ConfigureExclusivePort(&builder);
  const std::string addr = absl::StrCat(absl::GetFlag(FLAGS_bind_host), ":", port);
  int bound = 0;
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), &bound);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || bound == 0) {
    ExitError(1, absl::StrCat("cannot listen on ", addr, ": address in use or not available"));
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    const std::string tmp = port_file + ".tmp";
    std::ofstream(tmp) << bound << "\n";
    if (std::rename(tmp.c_str(), port_file.c_str()) != 0) {
      ExitError(1, absl::StrCat("cannot write --port_file ", port_file));
    }
  }
  std::fprintf(stderr,
               "coordinator: job %016llx on %s:%d, waiting for %u servers and %u workers "
               "(%s, d=%llu, %llu steps)\n",
               static_cast<unsigned long long>(job_id), absl::GetFlag(FLAGS_bind_host).c_str(),
               bound, cfg.servers(), cfg.workers(), cfg.optimizer().c_str(),
               static_cast<unsigned long long>(cfg.dim()),
               static_cast<unsigned long long>(cfg.steps()));

  while (true) {
    service.Tick();
    const auto s = service.state();
    if (s == CoordinatorService::State::kFinished || s == CoordinatorService::State::kFailed) {
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  const double wall = service.WallSeconds();
  Summary summary = service.MakeSummary();
  int code = 0;
  std::string verdict = "job finished";
  if (service.state() == CoordinatorService::State::kFailed) {
    code = 1;
    verdict = absl::StrCat("job failed: ", service.reason());
  } else if (!summary.workers_agree) {
    code = 1;
    verdict = "job finished but the replicas differ from the masters";
    summary.status = verdict;
  } else if (!summary.replicas_equal) {
    // --server-reply delta with a lossy reply codec: by design (docs/design.md §1.4).
    verdict =
        absl::StrFormat("job finished; replicas trail the masters by the server error (largest %g)",
                        summary.max_replica_master_diff.value_or(0.0));
  }
  if (!out.empty()) {
    absl::Status st = WriteMetricsCsv(out + "/metrics.csv", service.MetricsRows());
    if (st.ok()) st = WriteSummaryJson(out + "/summary.json", summary);
    if (!st.ok()) {
      std::fprintf(stderr, "coordinator: %s\n", std::string(st.message()).c_str());
      code = 1;
    }
  }
  // Let every live process hear the outcome through its heartbeat, bounded.
  const absl::Time deadline =
      absl::Now() + std::max(absl::Seconds(2), absl::Milliseconds(cfg.heartbeat_timeout_ms()) / 2);
  while (!service.EveryoneTold() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  server->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
  std::fprintf(stderr, "coordinator: %s (%.3f s, final loss %s)\n", verdict.c_str(), wall,
               summary.final_loss ? absl::StrFormat("%.6g", *summary.final_loss).c_str() : "n/a");
  return code;
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
