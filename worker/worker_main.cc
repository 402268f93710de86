// onebit-worker: registers with the coordinator, connects to every server and
// runs the training loop: gradient -> push every shard -> wait for the
// replies -> apply. Reports per-step metrics through its heartbeat and the
// checksums of its replica at the end.
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "net/checksum.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/flags.h"
#include "net/health.h"
#include "net/job_config.h"
#include "net/run_folder.h"
#include "worker/device.h"
#include "worker/model.h"
#include "worker/ps_client.h"
#include "worker/replica.h"

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
ABSL_FLAG(absl::Duration, progress_interval, absl::Seconds(1),
          "how often to print the progress line on stderr");

namespace onebit {
namespace {

int Main(int argc, char** argv) {
  KeepLargeBuffers();
  ParseFlagsOrExit(argc, argv,
                   "onebit-worker --coordinator HOST:PORT [--rank R]\n"
                   "Trains: computes gradients, pushes them to the servers, applies the replies.");
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) ExitFlagError("coordinator", "required");
  const int health_port = absl::GetFlag(FLAGS_health_port);
  if (health_port < 0 || health_port > 65535) ExitFlagError("health_port", "must be in [0, 65535]");
  std::string advertise = absl::GetFlag(FLAGS_advertise_host);
  if (advertise.empty()) advertise = Hostname();
  // Before joining: a worker that cannot use its device must not hold up a job.
  auto device = ChooseDevice(absl::GetFlag(FLAGS_device));
  if (!device.ok()) ExitError(2, std::string(device.status().message()));
  if (!device->notice.empty()) std::fprintf(stderr, "onebit-worker: %s\n", device->notice.c_str());

  int health_bound = 0;
  auto health = StartHealthServer(absl::GetFlag(FLAGS_bind_host), health_port, &health_bound);
  if (!health.ok()) ExitError(1, std::string(health.status().message()));

  auto stub = control::Coordinator::NewStub(MakeChannel(coordinator));
  control::RegisterRequest req;
  req.set_role(control::WORKER);
  req.set_requested_rank(absl::GetFlag(FLAGS_rank));
  req.set_health_endpoint(absl::StrCat(advertise, ":", health_bound));
  req.set_host(Hostname());
  req.set_device(DeviceName(*device));
  auto reg =
      RegisterWithCoordinator(stub.get(), coordinator, req, absl::GetFlag(FLAGS_register_timeout));
  if (!reg.ok()) ExitError(1, std::string(reg.status().message()));
  const control::TrainingConfig& cfg = reg->config();
  const uint32_t rank = reg->rank();
  const absl::Duration hb_timeout = absl::Milliseconds(cfg.heartbeat_timeout_ms());
  Heartbeater hb(stub.get(), coordinator, control::WORKER, rank, reg->job_id(),
                 std::clamp(hb_timeout / 10, absl::Milliseconds(20), absl::Seconds(1)), hb_timeout);
  hb.Start();

  auto map = ShardMap::Deserialize(reg->shard_map());
  if (!map.ok()) FailAndExit(&hb, absl::StrCat("bad shard map: ", map.status().message()));
  auto model = NewModel(cfg);
  if (!model.ok()) FailAndExit(&hb, std::string(model.status().message()));
  const uint64_t d = (*model)->num_params();
  if (d != map->num_params()) FailAndExit(&hb, "model size differs from the shard map");

  auto opt_options = OptimizerOptionsFromConfig(cfg);
  if (!opt_options.ok()) FailAndExit(&hb, std::string(opt_options.status().message()));
  auto optimizer = WorkerOptimizer::Create(*opt_options);
  if (!optimizer.ok()) FailAndExit(&hb, std::string(optimizer.status().message()));

  zmq::context_t ctx(static_cast<int>(std::min<uint32_t>(cfg.servers(), 2)));
  PsClientOptions po;
  po.job_id = reg->job_id();
  po.rank = rank;
  po.map = *map;
  po.chunk_elems = cfg.chunk_elems();
  po.optimizer = optimizer->get();
  for (const auto& s : reg->servers()) po.server_endpoints.push_back(s.data_endpoint());
  // The server gives up on a missing push after the step timeout and tells
  // us why; this is the backstop for a server that died.
  po.reply_timeout = 2 * absl::Milliseconds(cfg.step_timeout_ms());
  auto client = PsClient::Connect(po, &ctx);
  if (!client.ok()) FailAndExit(&hb, std::string(client.status().message()));

  auto replica = NewReplica(*device, model->get(), optimizer->get());
  if (!replica.ok()) {
    FailAndExit(&hb, absl::StrCat("worker ", rank, ": --device ", absl::GetFlag(FLAGS_device), ": ",
                                  replica.status().message()));
  }
  Replica& rep = **replica;
  if (absl::Status st = rep.Init(); !st.ok()) {
    FailAndExit(
        &hb, absl::StrCat("worker ", rank, ": initialising on ", rep.device(), ": ", st.message()));
  }
  std::fprintf(stderr, "worker %u: training on %s\n", rank, rep.device().c_str());
  std::vector<float> x(d);
  if (rank == 0) {
    absl::Status st = rep.ReadX(x.data());
    if (st.ok()) st = (*client)->SendInit(x.data());
    if (!st.ok()) FailAndExit(&hb, absl::StrCat("worker 0: sending the initial x: ", st.message()));
  }
  auto check = [&]() -> absl::Status {
    if (hb.command() == control::CONTINUE) return absl::OkStatus();
    return absl::AbortedError(absl::StrCat("job aborted by the coordinator: ", hb.reason()));
  };

  const uint64_t steps = cfg.steps();
  const uint64_t per_epoch = (*model)->steps_per_epoch();
  const bool evaluate = rank == 0 && cfg.eval_every() > 0 && rep.can_evaluate();
  double last_accuracy = -1;
  const int64_t stall = absl::GetFlag(FLAGS_stall_at_step);
  const absl::Duration progress_every = absl::GetFlag(FLAGS_progress_interval);
  const absl::Time t0 = absl::Now();
  absl::Time last_progress = t0;
  uint64_t total_up = 0, total_down = 0;
  for (uint64_t step = 0; step < steps; ++step) {
    if (stall >= 0 && step == static_cast<uint64_t>(stall)) {
      std::fprintf(stderr, "worker %u: stalling at step %llu (--stall_at_step)\n", rank,
                   static_cast<unsigned long long>(step));
      while (hb.WaitForCommand(absl::Seconds(1)) == control::CONTINUE) {
      }
      ExitError(1, absl::StrCat("worker ", rank, ": ", check().message()));
    }
    const absl::Time s0 = absl::Now();
    auto loss = rep.ComputeGradient(rank, step);
    if (!loss.ok()) FailAndExit(&hb, absl::StrCat("worker ", rank, ": ", loss.status().message()));
    const Phase phase = rep.phase();
    absl::Status st = (*client)->PushPull(step, &rep, check);
    if (!st.ok()) FailAndExit(&hb, absl::StrCat("worker ", rank, ": ", st.message()));
    const absl::Time s1 = absl::Now();
    control::StepMetrics m;
    m.set_step(step);
    m.set_loss(static_cast<float>(*loss));
    m.set_wall_s(absl::ToDoubleSeconds(s1 - t0));
    m.set_step_s(absl::ToDoubleSeconds(s1 - s0));
    m.set_bytes_up((*client)->last_bytes_up());
    m.set_bytes_down((*client)->last_bytes_down());
    m.set_push_s((*client)->last_push_s());
    m.set_reply_s((*client)->last_reply_s());
    m.set_phase(phase == Phase::kCompress ? "compress" : "warmup");
    if (per_epoch > 0) m.set_epoch(static_cast<double>(step + 1) / per_epoch);
    // Rank 0 scores its replica (equal to every other) on the test set.
    if (evaluate && ((step + 1) % cfg.eval_every() == 0 || step + 1 == steps)) {
      auto eval = rep.Evaluate();
      if (!eval.ok())
        FailAndExit(&hb, absl::StrCat("worker 0: evaluation: ", eval.status().message()));
      m.set_has_eval(true);
      m.set_test_loss(eval->loss);
      m.set_test_accuracy(eval->accuracy);
      last_accuracy = eval->accuracy;
    }
    total_up += m.bytes_up();
    total_down += m.bytes_down();
    hb.AddMetrics(m);
    hb.SetStep(step + 1);
    if (s1 - last_progress >= progress_every || step + 1 == steps) {
      last_progress = s1;
      const double elapsed = absl::ToDoubleSeconds(s1 - t0);
      const double rate = static_cast<double>(step + 1) / std::max(elapsed, 1e-9);
      const std::string epoch =
          per_epoch > 0 ? absl::StrFormat(" epoch %.2f", m.epoch()) : std::string();
      const std::string acc =
          last_accuracy >= 0 ? absl::StrFormat(" test acc %.4f", last_accuracy) : std::string();
      std::fprintf(stderr,
                   "worker %u: step %llu/%llu%s loss %.6g%s %s %.2f steps/s up %.1f MB down %.1f "
                   "MB ETA %.0fs\n",
                   rank, static_cast<unsigned long long>(step + 1),
                   static_cast<unsigned long long>(steps), epoch.c_str(), *loss, acc.c_str(),
                   m.phase().c_str(), rate, total_up / 1e6, total_down / 1e6,
                   static_cast<double>(steps - step - 1) / rate);
    }
  }

  if (absl::Status st = rep.ReadX(x.data()); !st.ok()) {
    FailAndExit(
        &hb, absl::StrCat("worker ", rank, ": reading x from ", rep.device(), ": ", st.message()));
  }
  std::vector<control::ShardChecksum> sums;
  for (uint32_t k = 0; k < map->num_shards(); ++k) {
    const Range r = map->shard(k);
    control::ShardChecksum c;
    c.set_shard(k);
    c.set_begin(r.begin);
    c.set_end(r.end);
    c.set_crc32(Crc32OfFloats(x.data() + r.begin, r.size()));
    sums.push_back(c);
  }
  const std::string dump = absl::GetFlag(FLAGS_dump_x);
  if (!dump.empty()) {
    absl::Status st = WriteFloats(dump, x);
    if (!st.ok()) FailAndExit(&hb, absl::StrCat("--dump_x: ", st.message()));
  }

  absl::Status st = hb.Done(sums);
  if (!st.ok()) FailAndExit(&hb, absl::StrCat("worker ", rank, ": ", st.message()));
  return 0;
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
