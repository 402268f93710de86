// RunServer (include/onebit/server.h): the data port, PsServer
// (server/ps_server.h) serving one shard, and the shard's checkpoints; the
// job's control plane (registering, the heartbeat, rejoining, reporting
// checkpoint files) is job/member.h's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <optional>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/optimizer_state.h"
#include "job/config.h"
#include "job/member.h"
#include "job/run_folder.h"
#include "metrics/endpoint.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/health.h"
#include "onebit/server.h"
#include "security/curve.h"
#include "security/data_seal.h"
#include "server/ps_server.h"
#include "server/server_metrics.h"
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
// RegisterReply tells the job's frame limit and cipher, then bound with
// them (a listener takes the socket's options when it binds).
struct DataPort {
  zmq::socket_t* socket;
  std::optional<ReservedPort> reserved;  // until bound
  std::string bind_host;
  int port = 0;
  const CurveKeys* keys = nullptr;  // null: --insecure
  uint64_t frame_limit = 0;         // 0: not bound yet
  bool sealed = false;              // bound for --data_cipher aes-gcm (PLAIN), else CURVE
  std::string bound_endpoint = {};

  // Binds with `limit` and the cipher; again after a roll-back whose job
  // has another.
  absl::Status Open(uint64_t limit, bool seal) {
    if (limit == frame_limit && seal == sealed) return absl::OkStatus();
    const std::string endpoint = absl::StrCat("tcp://", bind_host, ":", port);
    try {
      if (frame_limit != 0) socket->unbind(bound_endpoint);
      ConfigureServerDataSocket(socket, limit);
      if (keys != nullptr && seal) MakePlainServer(socket);
      if (keys != nullptr && !seal) MakeCurveServer(socket, *keys);
      if (reserved) reserved->Release();
      reserved.reset();
      socket->bind(endpoint);
      bound_endpoint = socket->get(zmq::sockopt::last_endpoint);
    } catch (const zmq::error_t& e) {
      return absl::UnavailableError(
          absl::StrCat("cannot bind the data port ", endpoint, ": ", e.what()));
    }
    frame_limit = limit;
    sealed = seal;
    return absl::OkStatus();
  }
};

// What a server keeps across the job's incarnations (formings of the
// cluster: a roll-back makes a new one).
struct ServerProcess {
  const ServerOptions& options;
  std::string advertise;
  DataPort data_port;
  ZapHandler* zap;  // the data port's; null under --insecure
  JobMember member;
  std::vector<uint64_t> earlier;     // the data-plane ids of the incarnations before
  ServerMetrics* metrics = nullptr;  // null: none
};

// What a server registers as.
control::RegisterRequest ServerRequest(const ServerOptions& o, const std::string& advertise,
                                       const CurveKeys& keys, int data_port, int health_port) {
  control::RegisterRequest req;
  req.set_role(control::SERVER);
  req.set_curve_public_key(keys.public_key);
  req.set_requested_rank(o.shard);
  req.set_data_endpoint(absl::StrCat("tcp://", advertise, ":", data_port));
  req.set_health_endpoint(absl::StrCat(advertise, ":", health_port));
  req.set_host(Hostname());
  return req;
}

// Admits this incarnation's workers to the data port: by their CURVE keys,
// or under a sealed data plane by the PLAIN passwords of the secrets this
// server shares with them (`keys`: its own; returned, index = rank).
absl::StatusOr<std::vector<PairSecret>> AdmitWorkers(const control::RegisterReply& reg,
                                                     const CurveKeys& keys, uint64_t data_plane_id,
                                                     ZapHandler* zap) {
  const uint32_t workers = reg.config().cluster().workers();
  if (reg.worker_curve_keys_size() != static_cast<int>(workers)) {
    return absl::DataLossError(absl::StrCat("the coordinator sent ", reg.worker_curve_keys_size(),
                                            " workers' keys for ", workers, " workers"));
  }
  std::map<std::string, std::string> clients;
  std::vector<PairSecret> sealed;
  for (uint32_t w = 0; w < workers; ++w) {
    const std::string& key = reg.worker_curve_keys(w);
    if (!DataPlaneSealed(reg.config())) {
      clients[key] = WorkerPeerId(w);
      continue;
    }
    auto secret = PairSecret::Agree(keys, key, key, keys.public_key, data_plane_id, w, reg.rank());
    if (!secret.ok()) {
      return absl::DataLossError(
          absl::StrCat("worker ", w, "'s key from the coordinator: ", secret.status().message()));
    }
    clients[secret->Password()] = WorkerPeerId(w);
    sealed.push_back(*std::move(secret));
  }
  if (DataPlaneSealed(reg.config())) {
    zap->Allow({});
    zap->AllowPasswords(std::move(clients));
  } else {
    zap->AllowPasswords({});
    zap->Allow(std::move(clients));
  }
  return sealed;
}

// The optimizer of shard `rank` (`range`), once its state fits in memory:
// too large for this machine is an error naming the bytes, not the OOM
// killer.
absl::StatusOr<OptimizerOptions> ShardOptimizer(const control::RegisterReply& reg,
                                                const Range& range) {
  auto optimizer = OptimizerOptionsFromConfig(reg.config());
  if (!optimizer.ok()) return optimizer.status();
  const StateSize size = ServerShardSize(*optimizer, range.size());
  if (absl::Status st = CheckMemory(absl::StrCat("shard ", reg.rank(), " of ", range.size(),
                                                 " parameters (", size.arrays, ")"),
                                    size.bytes);
      !st.ok()) {
    return st;
  }
  optimizer->weight_decay_ranges = DecayRangesOf(reg.weight_decay_ranges());
  optimizer->lr_scale_ranges = LrScaleRangesOf(reg.lr_scale_ranges());
  optimizer->layer_ends.assign(reg.layer_ends().begin(), reg.layer_ends().end());
  return optimizer;
}

// PsServer's options for the incarnation p.member registered in, but for
// checkpoints; binds the data port with the job's frame limit.
absl::StatusOr<PsServerOptions> IncarnationOptions(ServerProcess& p) {
  const control::RegisterReply& reg = p.member.registration();
  const control::TrainingConfig& cfg = reg.config();
  auto map = ShardMap::Deserialize(reg.shard_map());
  if (!map.ok()) {
    return absl::DataLossError(
        absl::StrCat("bad shard map from the coordinator: ", map.status().message()));
  }
  auto optimizer = ShardOptimizer(reg, map->shard(reg.rank()));
  if (!optimizer.ok()) return optimizer.status();
  auto freeze = FreezeOptionsFromConfig(cfg);
  if (!freeze.ok()) return freeze.status();
  PsServerOptions po;
  if (p.zap != nullptr) {
    auto sealed = AdmitWorkers(reg, *p.data_port.keys, p.member.data_plane_id(), p.zap);
    if (!sealed.ok()) return sealed.status();
    po.sealed = *std::move(sealed);
    po.authenticated = true;
  }
  po.metrics = p.metrics;
  po.peers_heard = p.member.peers_heard();
  po.job.job_id = p.member.data_plane_id();
  po.earlier_job_ids = p.earlier;
  po.job.workers = cfg.cluster().workers();
  po.job.steps = cfg.model().steps();
  po.job.map = *map;
  po.job.chunk_elems = ChunkElemsFor(cfg.compression().chunk_elems(), po.job.map);
  po.job.compressed_chunk_elems = cfg.compression().compressed_chunk_elems();
  po.job.connections = DataConnectionsFor(cfg.compression().data_connections());
  if (absl::Status st =
          p.data_port.Open(ServerFrameLimit(po.job.chunk_elems, po.job.compressed_chunk_elems),
                           DataPlaneSealed(cfg));
      !st.ok()) {
    return st;
  }
  po.shard = reg.rank();
  po.optimizer = *optimizer;
  po.freeze = *freeze;
  po.step_timeout = absl::Milliseconds(cfg.timeouts().step_ms());
  po.startup_timeout = kStartupSteps * po.step_timeout;
  Heartbeater& hb = p.member.heartbeat();
  po.report_freeze_check = [&hb](uint64_t completed, double change) {
    hb.ReportFreezeCheck(completed, change);
  };
  const uint64_t window = po.freeze.window;
  po.freeze_decision = [&hb, window](uint64_t completed) {
    return hb.FreezeDecision(completed, window);
  };
  return po;
}

// Saves the shard after its step, written beside serving. A den of the
// frozen v is left out where loading makes it again from v.
// `step`: s.step, or a local step before it that left s as it was
// (zero-one-adam's servers skip local steps).
void CheckpointShard(JobMember& member, const ServerShardState& s, uint64_t step,
                     OptimizerKind kind) {
  const bool with_den = !TraitsOf(kind).den_of_frozen_v;
  // Only a snapshot's error comes back, and copying the shard cannot fail.
  member
      .Checkpoint(step,
                  [&](std::shared_ptr<SnapshotBuffers> buffers) -> absl::StatusOr<StateWriter> {
                    return SaveServerShard(s, with_den, std::move(buffers), step);
                  })
      .IgnoreError();
}

// Checkpoints: the scheduled ones at the step's end, and the state to go
// on from where the coordinator names a checkpoint (po->restored).
absl::Status AddCheckpoints(JobMember& member, PsServerOptions* po) {
  if (member.registration().config().checkpoint().every() > 0) {
    po->on_step_end = [&member, kind = po->optimizer.kind](const ServerShardState& s) {
      if (member.CheckpointDue(s.step)) CheckpointShard(member, s, s.step, kind);
    };
  }
  return member.LoadCheckpoint([po](const control::ResumePoint& resume) -> absl::Status {
    auto restored = LoadShardFromCheckpoint(resume, po->job.map.shard(po->shard), po->shard);
    if (!restored.ok()) return restored.status();
    if (absl::Status st = RestoreDenominators(po->optimizer.eps, &*restored); !st.ok()) return st;
    po->restored = *std::move(restored);
    if (po->metrics != nullptr) po->metrics->Resumed();
    return absl::OkStatus();
  });
}

// Serves steps until the job ends or the coordinator says otherwise
// (STOP, REJOIN, ABORT): OK, or the data plane's failure, else Done's or
// the end step's.
absl::Status ServeSteps(JobMember& member, PsServer& ps, const PsServerOptions& po,
                        const ZapHandler* zap) {
  Heartbeater& hb = member.heartbeat();
  absl::Status done_status;
  uint64_t last_step = 0;
  absl::Time last_change = absl::Now(), last_kick = absl::Now();
  std::optional<absl::Time> done_at;  // when this shard reported Done
  absl::Status st = ps.Serve(
      [&] {
        hb.SetStep(ps.state().step);
        if (po.metrics != nullptr && zap != nullptr)
          po.metrics->SetHandshakesRefused(zap->refused());
        // Stopping: no push comes past the stop step; save the shard there
        // (zero-one-adam's: the stop may be a local step the shard skipped).
        if (auto stop = hb.stop_step(); stop && ps.StateIsOfStep(*stop)) {
          CheckpointShard(member, ps.state(), *stop, po.optimizer.kind);
        }
        // A job without a fixed length ends where the workers finished.
        if (po.job.steps == 0 && done_status.ok() && !ps.finished()) {
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
        // Done: the workers report theirs within moments, and the command
        // to end comes with a heartbeat; ask often for a while rather than
        // wait out the interval (a second by default) in every job. All
        // servers together at most 50 times a second, as the heartbeats.
        if (done_at) {
          const absl::Time now = absl::Now();
          const absl::Duration every =
              absl::Milliseconds(20) * static_cast<int64_t>(po.job.map.num_shards());
          if (now - *done_at < absl::Seconds(2) && now - last_kick >= every) {
            last_kick = now;
            hb.Kick();
          }
        }
        return hb.command() != control::CONTINUE || !done_status.ok();
      },
      [&] {
        member.FlushCheckpoints();  // the last checkpoint's part goes with Done
        done_status = hb.Done({ChecksumOf(ps.state(), po.shard, po.job.map.shard(po.shard))});
        done_at = absl::Now();
        if (!done_status.ok()) {
          // Refused by a coordinator started again while this shard ran its
          // last steps (it knows this process no more): its REJOIN comes
          // with the next heartbeat, and the job rolls back.
          hb.Kick();
          hb.WaitForCommand(
              absl::Milliseconds(member.registration().config().timeouts().heartbeat_ms()));
        }
      });
  return st.ok() ? done_status : st;
}

// How serving ended, the coordinator not having said REJOIN: OK when the
// job finished; else why not, reported to the coordinator where it is this
// server's failure. Writes --dump_x and --dump_error of a job that ran.
absl::Status Ended(const ServerOptions& o, JobMember& member, const PsServer& ps,
                   const absl::Status& served) {
  if (!served.ok()) {
    member.ReportFailure(served);
    return member.Named(served);
  }
  const Heartbeater& hb = member.heartbeat();
  if (hb.command() == control::STOP) {
    member.FlushCheckpoints();
    return absl::CancelledError(
        absl::StrCat("server ", member.rank(), ": the job stopped: ", hb.reason()));
  }
  for (auto [name, path, v] : {std::tuple{"dump_x", &o.dump_x, &ps.state().x},
                               {"dump_error", &o.dump_error, &ps.state().e}}) {
    if (path->empty()) continue;
    if (absl::Status w = WriteFloats(*path, *v); !w.ok()) {
      return absl::Status(w.code(), absl::StrCat(name, ": ", w.message()));
    }
  }
  if (hb.command() == control::SHUTDOWN && ps.finished()) {
    std::fprintf(stderr, "server %u: done after %llu steps; requests came on %zu connections\n",
                 member.rank(), static_cast<unsigned long long>(ps.state().step),
                 ps.connections_seen());
    if (const std::string parts = ps.StepSummary(); !parts.empty()) {
      std::fprintf(stderr, "server %u: per step (median ms): %s\n", member.rank(), parts.c_str());
    }
    return absl::OkStatus();
  }
  return absl::AbortedError(absl::StrCat("server ", member.rank(), ": job aborted: ",
                                         hb.command() == control::SHUTDOWN
                                             ? "the coordinator ended the job before the last step"
                                             : hb.reason()));
}

// One incarnation, from its registration to the end of the job (false) or
// to the coordinator's REJOIN (true: register again).
absl::StatusOr<bool> ServeIncarnation(ServerProcess& p) {
  JobMember& member = p.member;
  // From here on a failure is the job's: the coordinator hears why.
  auto fail = [&member](const absl::Status& st) {
    member.ReportFailure(st);
    return member.Named(st);
  };
  auto po = IncarnationOptions(p);
  if (!po.ok()) return fail(po.status());
  if (absl::Status st = AddCheckpoints(member, &*po); !st.ok()) return fail(st);
  auto server = PsServer::Create(*po, p.data_port.socket);
  if (!server.ok()) return fail(server.status());
  const Range r = po->job.map.shard(po->shard);
  std::fprintf(stderr, "server %u: shard [%llu, %llu) on tcp://%s:%d, job %016llx%s\n", po->shard,
               static_cast<unsigned long long>(r.begin), static_cast<unsigned long long>(r.end),
               p.advertise.c_str(), p.data_port.port,
               static_cast<unsigned long long>(member.registration().job_id()),
               po->sealed.empty() ? "" : "; data plane sealed with AES-256-GCM");
  const absl::Status served = ServeSteps(member, **server, *po, p.zap);
  // Whatever failed meanwhile came of the loss the job rolls back for.
  if (member.rolling_back()) return true;
  if (absl::Status st = Ended(p.options, member, **server, served); !st.ok()) return st;
  return false;
}

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
  if (absl::Status st = CheckMetricsPort(o.metrics_port); !st.ok()) {
    return Invalid("metrics_port", st.message());
  }
  if (absl::Status st = CheckMetricsLinger(o.metrics_linger); !st.ok()) {
    return Invalid("metrics_linger", st.message());
  }
  auto security = ResolveSecurity(o.secret_file, o.insecure, "ServerOptions.secret_file");
  if (!security.ok()) return security.status();
  std::fprintf(stderr, "%s\n", SecurityNotice(*security, "server").c_str());
  const std::string advertise = o.advertise_host.empty() ? Hostname() : o.advertise_host;

  // Its I/O threads are fixed before the first socket, so before the job
  // is known: a server has a connection per worker (or several), spread
  // over them.
  zmq::context_t ctx(DataIoThreads(kMaxDataConnections));
  // Admits no worker until the cluster has formed and their keys are known.
  std::unique_ptr<ZapHandler> zap;
  CurveKeys keys;
  zmq::socket_t socket(ctx, zmq::socket_type::router);
  if (!security->insecure()) {
    auto started = ZapHandler::Start(&ctx, "server");
    if (!started.ok()) return started.status();
    zap = *std::move(started);
    keys = NewCurveKeys();
  }
  auto reserved = ReservedPort::Reserve(o.bind_host, o.data_port);
  if (!reserved.ok()) return reserved.status();
  const int bound_port = reserved->port();
  int health_bound = 0;
  auto health = StartHealthServer(o.bind_host, o.health_port, &health_bound);
  if (!health.ok()) return health.status();
  // The metrics listen from the start (a port taken fails the server before
  // it joins); they are made once the shard is known.
  std::unique_ptr<MetricsEndpoint> endpoint;
  std::unique_ptr<ServerMetrics> metrics;
  const std::string metrics_host = o.metrics_host.empty() ? o.bind_host : o.metrics_host;
  if (o.metrics_port >= 0) {
    auto e = MetricsEndpoint::Start(metrics_host, o.metrics_port, {{"role", "server"}});
    if (!e.ok()) return e.status();
    endpoint = *std::move(e);
  }

  JobMemberOptions mo;
  mo.coordinator = o.coordinator;
  mo.register_timeout = o.register_timeout;
  mo.stop_signal = o.stop_signal;
  mo.snapshot_arrays = 7;  // a shard's state has at most 7
  // Set before the first checkpoint (after Join), read on the writer's thread.
  mo.on_written = [&metrics](const absl::StatusOr<WrittenFile>& f) {
    if (metrics != nullptr) {
      metrics->checkpoints().Written(f.ok(), f.ok() ? static_cast<double>(f->size) : 0,
                                     f.ok() ? f->seconds : 0);
    }
  };
  ServerProcess p{
      o,
      advertise,
      DataPort{&socket, *std::move(reserved), o.bind_host, bound_port,
               security->insecure() ? nullptr : &keys},
      zap.get(),
      JobMember(mo, *security, ServerRequest(o, advertise, keys, bound_port, health_bound)),
      {}};
  if (absl::Status st = p.member.Join(); !st.ok()) return st;
  if (endpoint != nullptr) {
    metrics = std::make_unique<ServerMetrics>(endpoint.get(), p.member.rank());
    p.metrics = metrics.get();
    std::fprintf(stderr, "server %u: metrics on http://%s:%d/metrics\n", p.member.rank(),
                 metrics_host.c_str(), endpoint->port());
  }
  absl::Status result;
  while (true) {
    absl::StatusOr<bool> rejoin = ServeIncarnation(p);
    if (!rejoin.ok() || !*rejoin) {
      result = rejoin.status();
      break;
    }
    p.earlier.push_back(p.member.data_plane_id());
    if (metrics != nullptr) metrics->RolledBack();
    if (absl::Status st = p.member.Rejoin(); !st.ok()) {
      p.member.ReportFailure(st);
      result = p.member.Named(st);
      break;
    }
  }
  if (endpoint != nullptr) LingerForLastScrape(o.metrics_linger, o.stop_signal);
  return result;
}

}  // namespace onebit
