// RunServer (include/onebit/server.h): registration, the data port, the
// heartbeat, and PsServer (server/ps_server.h) serving one shard.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/async_writer.h"
#include "checkpoint/checkpoint_dir.h"
#include "checkpoint/optimizer_state.h"
#include "job/config.h"
#include "job/run_folder.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/health.h"
#include "onebit/server.h"
#include "security/curve.h"
#include "server/ps_server.h"
#include "util/checksum.h"
#include "util/memory.h"

namespace onebit {
namespace {

absl::Status Invalid(absl::string_view field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat("ServerOptions.", field, ": ", why));
}

control::ShardChecksum ChecksumOf(const ServerShardState& state, uint32_t shard, const Range& r) {
  control::ShardChecksum c;
  c.set_shard(shard);
  c.set_begin(r.begin);
  c.set_end(r.end);
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
  return c;
}

// This shard's state from every server file of the checkpoint (saved by
// global range: any earlier number of servers).
absl::StatusOr<ServerShardState> LoadShardFromCheckpoint(const control::ResumePoint& resume,
                                                         const Range& r, uint32_t shard) {
  std::vector<StateReader> files;
  for (const std::string& name : resume.server_files()) {
    auto f = StateReader::Open(absl::StrCat(resume.dir(), "/", name));
    if (!f.ok()) return f.status();
    // Only the files whose range meets this shard's are needed.
    const bool meets = f->header().begin() < r.end && r.begin < f->header().end();
    if (r.size() > 0 && !meets) continue;
    files.push_back(*std::move(f));
  }
  std::vector<const StateReader*> parts;
  for (const StateReader& f : files) parts.push_back(&f);
  ServerShardState s;
  s.shard = shard;
  if (absl::Status st = LoadServerShard(parts, r.begin, r.end, &s); !st.ok()) {
    return absl::Status(st.code(),
                        absl::StrCat("resuming from ", resume.dir(), ": ", st.message()));
  }
  if (s.step != resume.step()) {
    return absl::DataLossError(absl::StrCat("resuming from ", resume.dir(),
                                            ": its files are of step ", s.step,
                                            ", its manifest of step ", resume.step()));
  }
  std::fprintf(stderr, "server %u: resuming from %s (step %llu)\n", shard, resume.dir().c_str(),
               static_cast<unsigned long long>(s.step));
  return s;
}

// The data socket and its port: held (ReservedPort) until the first
// RegisterReply tells the job's frame limit, then bound with it.
struct DataPort {
  zmq::socket_t* socket;
  std::optional<ReservedPort> reserved;  // until bound
  std::string bind_host;
  int port = 0;
  uint64_t frame_limit = 0;  // 0: not bound yet
  std::string bound_endpoint;

  // Binds with `limit`; again after a roll-back whose job has another.
  absl::Status Open(uint64_t limit) {
    if (limit == frame_limit) return absl::OkStatus();
    const std::string endpoint = absl::StrCat("tcp://", bind_host, ":", port);
    try {
      if (frame_limit != 0) socket->unbind(bound_endpoint);
      ConfigureServerDataSocket(socket, limit);
      if (reserved) reserved->Release();
      reserved.reset();
      socket->bind(endpoint);
      bound_endpoint = socket->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot bind the data port ", endpoint, ": ", e.what()));
    }
    frame_limit = limit;
    return absl::OkStatus();
  }
};

// One forming of the cluster, from its RegisterReply to the end of the job
// or to the coordinator's REJOIN (then *rejoin is set and this returns OK).
// `zap`: the data port's ZAP handler; null under --insecure.
absl::Status ServeIncarnation(const ServerOptions& o, const control::RegisterReply& reg,
                              DataPort& data_port, ZapHandler* zap,
                              control::Coordinator::Stub* stub, const std::string& advertise,
                              const std::vector<uint64_t>& earlier, bool* rejoin);

}  // namespace

absl::Status RunServer(const ServerOptions& o) {
  if (o.coordinator.empty()) return Invalid("coordinator", "required (host:port)");
  if (o.shard < -1) return Invalid("shard", "must be -1 (any) or a shard");
  for (auto [name, port] : {std::pair{"data_port", o.data_port}, {"health_port", o.health_port}}) {
    if (port < 0 || port > 65535) return Invalid(name, "must be in [0, 65535]");
  }
  if (absl::Status st = CheckTimeout(o.register_timeout); !st.ok()) {
    return Invalid("register_timeout", st.message());
  }
  auto security = ResolveSecurity(o.secret_file, o.insecure, "ServerOptions.secret_file");
  if (!security.ok()) return security.status();
  std::fprintf(stderr, "%s\n", SecurityNotice(*security, "server").c_str());
  const std::string advertise = o.advertise_host.empty() ? Hostname() : o.advertise_host;

  zmq::context_t ctx(1);
  // Admits no worker until the cluster has formed and their keys are known.
  std::unique_ptr<ZapHandler> zap;
  CurveKeys keys;
  zmq::socket_t socket(ctx, zmq::socket_type::router);
  if (!security->insecure()) {
    auto started = ZapHandler::Start(&ctx, "server");
    if (!started.ok()) return started.status();
    zap = *std::move(started);
    keys = NewCurveKeys();
    MakeCurveServer(&socket, keys);
  }
  auto reserved = ReservedPort::Reserve(o.bind_host, o.data_port);
  if (!reserved.ok()) return reserved.status();
  const int bound_port = reserved->port();
  DataPort data_port{&socket, *std::move(reserved), o.bind_host, bound_port};
  int health_bound = 0;
  auto health = StartHealthServer(o.bind_host, o.health_port, &health_bound);
  if (!health.ok()) return health.status();

  auto stub = control::Coordinator::NewStub(MakeChannel(o.coordinator, *security));
  control::RegisterRequest req;
  req.set_role(control::SERVER);
  req.set_curve_public_key(keys.public_key);
  req.set_requested_rank(o.shard);
  req.set_data_endpoint(absl::StrCat("tcp://", advertise, ":", bound_port));
  req.set_health_endpoint(absl::StrCat(advertise, ":", health_bound));
  req.set_host(Hostname());
  std::optional<uint64_t> rejoin_from;  // the incarnation this server was told to leave
  std::vector<uint64_t> earlier;        // and the data-plane ids of all before
  absl::Duration wait = o.register_timeout;
  while (true) {
    if (rejoin_from) req.set_rejoin_from(*rejoin_from);
    auto reg = RegisterWithCoordinator(stub.get(), o.coordinator, req, wait);
    if (!reg.ok()) {
      if (!rejoin_from) return reg.status();
      return absl::Status(reg.status().code(),
                          absl::StrCat("server ", req.requested_rank(),
                                       ": registering again: ", reg.status().message()));
    }
    bool rejoin = false;
    absl::Status st =
        ServeIncarnation(o, *reg, data_port, zap.get(), stub.get(), advertise, earlier, &rejoin);
    if (!rejoin) return st;
    earlier.push_back(DataPlaneId(reg->job_id(), reg->incarnation()));
    rejoin_from = reg->incarnation();
    req.set_requested_rank(static_cast<int>(reg->rank()));
    wait = std::max(o.register_timeout, RejoinWait(reg->config()));
  }
}

namespace {

absl::Status ServeIncarnation(const ServerOptions& o, const control::RegisterReply& reg,
                              DataPort& data_port, ZapHandler* zap,
                              control::Coordinator::Stub* stub, const std::string& advertise,
                              const std::vector<uint64_t>& earlier, bool* rejoin) {
  const control::TrainingConfig& cfg = reg.config();
  const uint32_t rank = reg.rank();
  const std::unique_ptr<Heartbeater> heartbeat =
      MakeHeartbeater(stub, o.coordinator, control::SERVER, reg);
  Heartbeater& hb = *heartbeat;
  hb.WatchStopSignal(o.stop_signal);
  hb.Start();
  // From here on a failure is the job's: the coordinator hears why.
  auto fail = [&](const absl::Status& st) {
    absl::Status named(st.code(), absl::StrCat("server ", rank, ": ", st.message()));
    hb.ReportError(std::string(named.message()));
    return named;
  };

  auto map = ShardMap::Deserialize(reg.shard_map());
  if (!map.ok()) {
    return fail(absl::DataLossError(
        absl::StrCat("bad shard map from the coordinator: ", map.status().message())));
  }
  auto optimizer = OptimizerOptionsFromConfig(cfg);
  if (!optimizer.ok()) return fail(optimizer.status());
  // Before the shard is allocated: too large for this machine is an error
  // naming the bytes, not the OOM killer.
  const Range shard_range = map->shard(rank);
  const StateSize size = ServerShardSize(*optimizer, shard_range.size());
  if (absl::Status st = CheckMemory(absl::StrCat("shard ", rank, " of ", shard_range.size(),
                                                 " parameters (", size.arrays, ")"),
                                    size.bytes);
      !st.ok()) {
    return fail(st);
  }
  optimizer->weight_decay_ranges = DecayRangesOf(reg.weight_decay_ranges());
  optimizer->layer_ends.assign(reg.layer_ends().begin(), reg.layer_ends().end());
  auto freeze = FreezeOptionsFromConfig(cfg);
  if (!freeze.ok()) return fail(freeze.status());
  PsServerOptions po;
  if (zap != nullptr) {
    if (reg.worker_curve_keys_size() != static_cast<int>(cfg.workers())) {
      return fail(
          absl::DataLossError(absl::StrCat("the coordinator sent ", reg.worker_curve_keys_size(),
                                           " workers' keys for ", cfg.workers(), " workers")));
    }
    std::map<std::string, std::string> clients;
    for (uint32_t w = 0; w < cfg.workers(); ++w)
      clients[reg.worker_curve_keys(w)] = WorkerPeerId(w);
    zap->Allow(std::move(clients));
    po.authenticated = true;
  }
  po.job.job_id = DataPlaneId(reg.job_id(), reg.incarnation());
  po.earlier_job_ids = earlier;
  po.job.workers = cfg.workers();
  po.job.steps = cfg.steps();
  po.job.map = *map;
  po.job.chunk_elems = ChunkElemsFor(cfg.chunk_elems(), po.job.map);
  if (absl::Status st = data_port.Open(ServerFrameLimit(po.job.chunk_elems)); !st.ok()) {
    return fail(st);
  }
  po.shard = rank;
  po.optimizer = *optimizer;
  po.freeze = *freeze;
  po.step_timeout = absl::Milliseconds(cfg.step_timeout_ms());
  po.report_freeze_check = [&hb](uint64_t completed, double change) {
    hb.ReportFreezeCheck(completed, change);
  };
  const uint64_t window = po.freeze.window;
  po.freeze_decision = [&hb, window](uint64_t completed) {
    return hb.FreezeDecision(completed, window);
  };
  // Checkpoints: a snapshot at the step boundary, written beside serving.
  AsyncStateWriter writer([&hb](uint64_t step, const absl::StatusOr<WrittenFile>& written) {
    hb.ReportCheckpointPart(PartOf(step, written));
  });
  uint64_t checkpointed = 0;  // the last step written
  // The last snapshot's arrays, for the next (a shard has at most 7).
  auto buffers = std::make_shared<SnapshotBuffers>(7);
  // `step`: s.step, or a local step before it that left s as it was.
  auto checkpoint = [&](const ServerShardState& s, uint64_t step) {
    if (step == 0 || step == checkpointed) return;
    checkpointed = step;
    auto dir = MakeStepDir(cfg.checkpoint_dir(), step);
    if (!dir.ok()) {
      hb.ReportCheckpointPart(PartOf(step, dir.status()));
      return;
    }
    // A den of the frozen v is made again from v on loading.
    writer.Submit(step,
                  SaveServerShard(s, /*with_den=*/!TraitsOf(po.optimizer.kind).den_of_frozen_v,
                                  buffers, step),
                  *dir, absl::StrCat("server-", s.shard, ".state"));
  };
  const uint64_t every = cfg.checkpoint_every();
  if (every > 0) {
    po.on_step_end = [&, every](const ServerShardState& s) {
      if (s.step % every == 0) checkpoint(s, s.step);
    };
  }
  if (reg.has_resume()) {
    auto restored = LoadShardFromCheckpoint(reg.resume(), map->shard(rank), rank);
    if (!restored.ok()) return fail(restored.status());
    if (absl::Status st = RestoreDenominators(po.optimizer.eps, &*restored); !st.ok()) {
      return fail(st);
    }
    po.restored = *std::move(restored);
  }
  auto server = PsServer::Create(po, data_port.socket);
  if (!server.ok()) return fail(server.status());
  const Range r = map->shard(rank);
  std::fprintf(stderr, "server %u: shard [%llu, %llu) on tcp://%s:%d, job %016llx\n", rank,
               static_cast<unsigned long long>(r.begin), static_cast<unsigned long long>(r.end),
               advertise.c_str(), data_port.port, static_cast<unsigned long long>(reg.job_id()));

  absl::Status done_status;
  PsServer& ps = **server;
  uint64_t last_step = 0;
  absl::Time last_change = absl::Now(), last_kick = absl::Now();
  absl::Status st = ps.Serve(
      [&] {
        hb.SetStep(ps.state().step);
        // Stopping: no push comes past the stop step; save the shard there
        // (zero-one-adam's: the stop may be a local step the shard skipped).
        if (auto stop = hb.stop_step(); stop && ps.StateIsOfStep(*stop)) {
          checkpoint(ps.state(), *stop);
        }
        // A job without a fixed length ends where the workers finished.
        if (cfg.steps() == 0 && done_status.ok() && !ps.finished()) {
          if (auto end = hb.end_step()) done_status = ps.SetEndStep(*end);
          // Idle: the workers may have finished; ask now rather than at the
          // next heartbeat (up to a second later).
          const absl::Time now = absl::Now();
          if (ps.state().step != last_step) {
            last_step = ps.state().step;
            last_change = now;
          } else if (now - last_change > absl::Milliseconds(100) &&
                     now - last_kick > absl::Milliseconds(100)) {
            last_kick = now;
            hb.Kick();
          }
        }
        return hb.command() != control::CONTINUE || !done_status.ok();
      },
      [&] {
        writer.Flush();  // the last checkpoint's part goes with Done
        done_status = hb.Done({ChecksumOf(ps.state(), rank, r)});
      });
  if (hb.command() == control::REJOIN) {
    // Whatever failed meanwhile came of the loss the job rolls back for.
    writer.Flush();
    std::fprintf(stderr, "server %u: %s: registering again\n", rank, hb.reason().c_str());
    *rejoin = true;
    return absl::OkStatus();
  }
  if (!st.ok()) return fail(st);
  if (!done_status.ok()) return fail(done_status);
  if (hb.command() == control::STOP) {
    writer.Flush();
    return absl::CancelledError(absl::StrCat("server ", rank, ": the job stopped: ", hb.reason()));
  }

  for (auto [name, path, v] : {std::tuple{"dump_x", &o.dump_x, &ps.state().x},
                               {"dump_error", &o.dump_error, &ps.state().e}}) {
    if (path->empty()) continue;
    if (absl::Status w = WriteFloats(*path, *v); !w.ok()) {
      return absl::Status(w.code(), absl::StrCat(name, ": ", w.message()));
    }
  }
  if (hb.command() == control::SHUTDOWN && ps.finished()) {
    std::fprintf(stderr, "server %u: done after %llu steps\n", rank,
                 static_cast<unsigned long long>(ps.state().step));
    return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat("server ", rank, ": job aborted: ",
                                         hb.command() == control::SHUTDOWN
                                             ? "the coordinator ended the job before the last step"
                                             : hb.reason()));
}

}  // namespace
}  // namespace onebit
