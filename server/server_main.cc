// onebit-server: registers with the coordinator, binds a ZeroMQ ROUTER on its
// data port and serves one shard (server/ps_server.h) until the coordinator
// says the job is over.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "net/checksum.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/flags.h"
#include "net/health.h"
#include "net/job_config.h"
#include "net/run_folder.h"
#include "server/ps_server.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator address host:port (required)");
ABSL_FLAG(int32_t, shard, -1, "the shard (server rank) to serve; -1: any free one");
ABSL_FLAG(std::string, bind_host, "0.0.0.0", "address to bind the data and health ports on");
ABSL_FLAG(int32_t, data_port, 0, "ZeroMQ data port; 0: any free port");
ABSL_FLAG(std::string, advertise_host, "",
          "address workers use to reach this server (default: the hostname)");
ABSL_FLAG(int32_t, health_port, 0, "grpc.health.v1 port; 0: any free port");
ABSL_FLAG(absl::Duration, register_timeout, absl::Seconds(60),
          "how long to wait for the coordinator and the whole cluster to register");
ABSL_FLAG(std::string, dump_x, "", "write the final master shard (raw fp32) to this file");
ABSL_FLAG(std::string, dump_error, "",
          "write the final server error feedback e_s of the shard (raw fp32) to this file");

namespace onebit {
namespace {

int Main(int argc, char** argv) {
  KeepLargeBuffers();
  ParseFlagsOrExit(argc, argv,
                   "onebit-server --coordinator HOST:PORT [--data-port P] [--advertise-host H]\n"
                   "Serves one shard of the parameters over ZeroMQ.");
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) ExitFlagError("coordinator", "required");
  const int data_port = absl::GetFlag(FLAGS_data_port);
  if (data_port < 0 || data_port > 65535) ExitFlagError("data_port", "must be in [0, 65535]");
  const int health_port = absl::GetFlag(FLAGS_health_port);
  if (health_port < 0 || health_port > 65535) ExitFlagError("health_port", "must be in [0, 65535]");
  std::string advertise = absl::GetFlag(FLAGS_advertise_host);
  if (advertise.empty()) advertise = Hostname();
  const std::string bind_host = absl::GetFlag(FLAGS_bind_host);

  zmq::context_t ctx(1);
  zmq::socket_t socket(ctx, zmq::socket_type::router);
  socket.set(zmq::sockopt::router_mandatory, 1);
  ConfigureDataSocket(&socket);
  const std::string bind_ep = absl::StrCat("tcp://", bind_host, ":", data_port == 0 ? "*" : "",
                                           data_port == 0 ? "" : absl::StrCat(data_port));
  try {
    socket.bind(bind_ep);
  } catch (const zmq::error_t& e) {
    ExitError(1, absl::StrCat("cannot bind the data port ", bind_ep, ": ", e.what()));
  }
  const std::string last = socket.get(zmq::sockopt::last_endpoint);
  int bound_port = 0;
  if (!absl::SimpleAtoi(last.substr(last.rfind(':') + 1), &bound_port)) {
    ExitError(1, absl::StrCat("cannot read the bound port from ", last));
  }
  int health_bound = 0;
  auto health = StartHealthServer(bind_host, health_port, &health_bound);
  if (!health.ok()) ExitError(1, std::string(health.status().message()));

  auto stub = control::Coordinator::NewStub(MakeChannel(coordinator));
  control::RegisterRequest req;
  req.set_role(control::SERVER);
  req.set_requested_rank(absl::GetFlag(FLAGS_shard));
  req.set_data_endpoint(absl::StrCat("tcp://", advertise, ":", bound_port));
  req.set_health_endpoint(absl::StrCat(advertise, ":", health_bound));
  req.set_host(Hostname());
  auto reg =
      RegisterWithCoordinator(stub.get(), coordinator, req, absl::GetFlag(FLAGS_register_timeout));
  if (!reg.ok()) ExitError(1, std::string(reg.status().message()));
  const control::TrainingConfig& cfg = reg->config();
  const uint32_t rank = reg->rank();

  auto map = ShardMap::Deserialize(reg->shard_map());
  if (!map.ok())
    ExitError(1, absl::StrCat("bad shard map from the coordinator: ", map.status().message()));
  auto optimizer = OptimizerOptionsFromConfig(cfg);
  if (!optimizer.ok()) ExitError(1, std::string(optimizer.status().message()));
  auto freeze = FreezeOptionsFromConfig(cfg);
  if (!freeze.ok()) ExitError(1, std::string(freeze.status().message()));
  PsServerOptions o;
  o.job.job_id = reg->job_id();
  o.job.workers = cfg.workers();
  o.job.steps = cfg.steps();
  o.job.map = *map;
  o.job.chunk_elems = cfg.chunk_elems();
  o.shard = rank;
  o.optimizer = *optimizer;
  o.freeze = *freeze;
  o.step_timeout = absl::Milliseconds(cfg.step_timeout_ms());
  const absl::Duration hb_timeout = absl::Milliseconds(cfg.heartbeat_timeout_ms());

  Heartbeater hb(stub.get(), coordinator, control::SERVER, rank, reg->job_id(),
                 std::clamp(hb_timeout / 10, absl::Milliseconds(20), absl::Seconds(1)), hb_timeout);
  hb.Start();
  o.report_freeze_check = [&hb](uint64_t completed, double change) {
    hb.ReportFreezeCheck(completed, change);
  };
  const uint64_t window = o.freeze.window;
  o.freeze_decision = [&hb, window](uint64_t completed) {
    return hb.FreezeDecision(completed, window);
  };
  auto server = PsServer::Create(o, &socket);
  if (!server.ok()) FailAndExit(&hb, std::string(server.status().message()));
  const Range r = map->shard(rank);
  std::fprintf(stderr, "server %u: shard [%llu, %llu) on tcp://%s:%d, job %016llx\n", rank,
               static_cast<unsigned long long>(r.begin), static_cast<unsigned long long>(r.end),
               advertise.c_str(), bound_port, static_cast<unsigned long long>(reg->job_id()));

  absl::Status done_status;
  PsServer& ps = **server;
  absl::Status st = ps.Serve(
      [&] {
        hb.SetStep(ps.state().step);
        // A job without a fixed length ends where the workers finished.
        if (cfg.steps() == 0 && done_status.ok() && !ps.finished()) {
          if (auto end = hb.end_step()) done_status = ps.SetEndStep(*end);
        }
        return hb.command() != control::CONTINUE || !done_status.ok();
      },
      [&] {
        control::ShardChecksum c;
        c.set_shard(rank);
        c.set_begin(r.begin);
        c.set_end(r.end);
        const ServerShardState& state = ps.state();
        c.set_crc32(Crc32OfFloats(state.x.data(), state.x.size()));
        c.set_floored(state.floored);
        if (!state.replica.empty()) {
          // --server-reply delta: the workers' replica trails the master.
          c.set_has_replica(true);
          c.set_replica_crc32(Crc32OfFloats(state.replica.data(), state.replica.size()));
          double diff = 0;
          for (size_t i = 0; i < state.x.size(); ++i) {
            diff = std::max(diff, std::fabs(static_cast<double>(state.x[i]) - state.replica[i]));
          }
          c.set_max_abs_diff(diff);
        }
        done_status = hb.Done({c});
      });
  if (!st.ok()) FailAndExit(&hb, absl::StrCat("server ", rank, ": ", st.message()));
  if (!done_status.ok())
    FailAndExit(&hb, absl::StrCat("server ", rank, ": ", done_status.message()));

  auto dump = [](const std::string& flag, const std::string& path, const std::vector<float>& v) {
    if (path.empty()) return;
    absl::Status st = WriteFloats(path, v);
    if (!st.ok()) ExitError(1, absl::StrCat("--", flag, ": ", st.message()));
  };
  dump("dump_x", absl::GetFlag(FLAGS_dump_x), ps.state().x);
  dump("dump_error", absl::GetFlag(FLAGS_dump_error), ps.state().e);
  if (hb.command() == control::SHUTDOWN && ps.finished()) {
    std::fprintf(stderr, "server %u: done after %llu steps\n", rank,
                 static_cast<unsigned long long>(ps.state().step));
    return 0;
  }
  ExitError(1, absl::StrCat("server ", rank, ": job aborted: ",
                            hb.command() == control::SHUTDOWN
                                ? "the coordinator ended the job before the last step"
                                : hb.reason()));
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
