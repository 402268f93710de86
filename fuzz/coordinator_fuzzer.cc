// The coordinator's handlers of each RPC's request (coordinator/coordinator.h
// CoordinatorService: Register, Heartbeat, Done, Status), called directly
// with a default grpc::ServerContext on a fresh small job per input, as
// gRPC would call them with the decoded request. After each call the
// target does what RunCoordinator's loop does with the service's state
// (takes the new metrics rows, writes no file but reports each complete
// checkpoint written), so that the requests reach roll-backs, stops, the
// automatic freeze and the final summary.
//
// The job's register timeout is 0 and its rejoin timeout 1 ms: Register
// never waits for the rest of the cluster longer than that.
//
// Input: a byte of flags (bit 0: the job, kJobs; bit 1: form the cluster
// first, every process registering as it should), then up to kMaxCalls
// calls: a byte (bits 0-1: the RPC; bit 6: set the request's job id to the
// job's; bit 7: set its incarnation to the one the last successful
// Register replied) and the serialized request (length-prefixed).
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "coordinator/coordinator.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_target.h"
#include "google/protobuf/stubs/logging.h"
#include "job/config.h"
#include "job/settings.h"

namespace onebit {
namespace {

constexpr uint64_t kJobId = 0x0b1e55ed00c0ffee;
constexpr int kMaxCalls = 32;

struct JobSpec {
  uint32_t servers, workers;
  uint64_t declared_d;  // what each worker declares when registering (external)
  std::vector<std::pair<const char*, const char*>> settings;
};
const JobSpec kJobs[] = {
    {1, 1, 0, {{"model", "synthetic"}, {"dim", "100"}, {"steps", "4"}, {"optimizer", "sgd"}}},
    {2, 2, 1000, {{"model", "external"}, {"optimizer", "onebit-adam"}, {"freeze", "auto:0.05:2"}}},
};
constexpr size_t kNumJobs = sizeof(kJobs) / sizeof(kJobs[0]);

// The service under test: a resolved, valid config as onebit-coordinator
// builds it (once per job: resolving is most of the cost), with checkpoints
// (nothing is written: the target reports them written itself) so that
// roll-backs are possible.
std::unique_ptr<CoordinatorService> NewService(size_t job) {
  struct Config {
    control::TrainingConfig config = DefaultJobConfig();
    std::set<std::string> given;
  };
  static const std::vector<Config>* configs = [] {
    auto* v = new std::vector<Config>;
    for (const JobSpec& spec : kJobs) {
      Config c;
      auto set = [&](const char* name, const std::string& value) {
        FUZZ_CHECK(SetJobSetting(*FindJobSetting(name), value, &c.config).ok());
        c.given.insert(name);
      };
      set("servers", std::to_string(spec.servers));
      set("workers", std::to_string(spec.workers));
      for (const auto& [name, value] : spec.settings) set(name, value);
      set("block_size", "32");
      set("chunk_elems", "64");
      set("checkpoint_dir", "/nonexistent/onebit-fuzz");
      set("checkpoint_every", "2");
      set("rejoin_timeout", "1ms");
      FUZZ_CHECK(ResolveConfig(c.given, &c.config).ok());
      FUZZ_CHECK(ValidateConfig(c.config).ok());
      v->push_back(std::move(c));
    }
    return v;
  }();
  const Config& c = (*configs)[job];
  return std::make_unique<CoordinatorService>(c.config, c.given, kJobId, absl::ZeroDuration(),
                                              Security{});
}

control::RegisterRequest Registration(const JobSpec& spec, control::Role role, uint32_t rank) {
  control::RegisterRequest r;
  r.set_role(role);
  r.set_requested_rank(static_cast<int32_t>(rank));
  r.set_host("fuzzhost");
  if (role == control::SERVER) {
    r.set_data_endpoint("tcp://fuzzhost:" + std::to_string(7000 + rank));
  } else {
    r.set_num_params(spec.declared_d);
    r.set_device("cpu");
  }
  return r;
}

class Harness {
 public:
  explicit Harness(size_t job) : spec_(kJobs[job]), service_(NewService(job)) {}

  // Every process registers once, in order; the last one forms the cluster
  // (the others' calls return at once: the register timeout is 0).
  void Form() {
    for (control::Role role : {control::SERVER, control::WORKER}) {
      const uint32_t n = role == control::SERVER ? spec_.servers : spec_.workers;
      for (uint32_t rank = 0; rank < n; ++rank) Register(Registration(spec_, role, rank));
    }
    FUZZ_CHECK(service_->state() == CoordinatorService::State::kRunning);
  }

  void Call(uint8_t op, const std::string& bytes) {
    grpc::ServerContext ctx;
    switch (op & 3) {
      case 0: {
        control::RegisterRequest req;
        if (req.ParseFromString(bytes)) Register(req);
        break;
      }
      case 1: {
        control::HeartbeatRequest req;
        if (!req.ParseFromString(bytes)) break;
        if (op & 0x40) req.set_job_id(kJobId);
        if (op & 0x80) req.set_incarnation(incarnation_);
        if (op & 0x20) req.set_credential(CredentialOf(req.role(), req.rank()));
        control::HeartbeatReply reply;
        grpc::Status st = service_->Heartbeat(&ctx, &req, &reply);
        FUZZ_CHECK(!st.ok() || reply.command() != control::COMMAND_UNSPECIFIED);
        break;
      }
      case 2: {
        control::DoneRequest req;
        if (!req.ParseFromString(bytes)) break;
        if (op & 0x40) req.set_job_id(kJobId);
        if (op & 0x80) req.set_incarnation(incarnation_);
        if (op & 0x20) req.set_credential(CredentialOf(req.role(), req.rank()));
        control::DoneReply reply;
        (void)service_->Done(&ctx, &req, &reply);
        break;
      }
      case 3: {
        control::StatusRequest req;
        if (!req.ParseFromString(bytes)) break;
        control::StatusReply reply;
        FUZZ_CHECK(service_->Status(&ctx, &req, &reply).ok());
        FUZZ_CHECK(reply.job_id() == kJobId);
        FUZZ_CHECK(reply.processes_size() == static_cast<int>(spec_.servers + spec_.workers));
        break;
      }
    }
    Own();
  }

  // What the owner polls at the end: the summary, and whether all heard it.
  void Finish() {
    Own();
    const run::Summary s = service_->MakeSummary();
    FUZZ_CHECK(s.workers() == spec_.workers && s.servers() == spec_.servers);
    FUZZ_CHECK(!s.replicas_equal() || s.status() == "ok");
    (void)service_->EveryoneTold();
  }

 private:
  void Register(const control::RegisterRequest& req) {
    grpc::ServerContext ctx;
    control::RegisterReply reply;
    grpc::Status st = service_->Register(&ctx, &req, &reply);
    if (!st.ok()) return;
    // Only a formed cluster answers, with everything a process needs.
    FUZZ_CHECK(service_->state() == CoordinatorService::State::kRunning);
    FUZZ_CHECK(reply.job_id() == kJobId);
    const uint32_t n = req.role() == control::SERVER ? spec_.servers : spec_.workers;
    FUZZ_CHECK(reply.rank() < n);
    FUZZ_CHECK(reply.servers_size() == static_cast<int>(spec_.servers));
    auto map = ShardMap::Deserialize(reply.shard_map());
    FUZZ_CHECK(map.ok() && map->num_shards() == spec_.servers);
    FUZZ_CHECK(map->num_params() == reply.config().model().dim());
    incarnation_ = reply.incarnation();
    credentials_[{req.role(), reply.rank()}] = reply.credential();
  }

  // The credential the coordinator gave that process (so that fuzzed
  // requests get past the check into the handling), "" when none.
  std::string CredentialOf(control::Role role, uint32_t rank) const {
    auto it = credentials_.find({role, rank});
    return it == credentials_.end() ? std::string() : it->second;
  }

  // RunCoordinator's loop, minus the files.
  void Own() {
    for (const auto& row : service_->TakeNewRows()) {
      FUZZ_CHECK(row.step == next_row_);
      ++next_row_;
    }
    for (checkpoint::Manifest& m : service_->TakeCompleteCheckpoints()) {
      FUZZ_CHECK(m.step() > 0 && m.files_size() > 0);
      const std::string dir = "/nonexistent/onebit-fuzz/step-" + std::to_string(m.step());
      service_->CheckpointWritten(CompleteCheckpoint{dir, std::move(m)});
    }
  }

  const JobSpec& spec_;
  std::unique_ptr<CoordinatorService> service_;
  std::map<std::pair<int, uint32_t>, std::string> credentials_;
  uint64_t incarnation_ = 0;
  uint64_t next_row_ = 0;
};

// Seeds: one call each.
std::string RegisterCall(const control::RegisterRequest& r) {
  return fuzz::Output().Byte(0).Bytes(r.SerializeAsString()).data();
}
std::string HeartbeatCall(const control::HeartbeatRequest& r) {
  return fuzz::Output().Byte(1 | 0x40 | 0x80).Bytes(r.SerializeAsString()).data();
}
std::string DoneCall(const control::DoneRequest& r) {
  return fuzz::Output().Byte(2 | 0x40 | 0x80).Bytes(r.SerializeAsString()).data();
}
std::string StatusCall() { return fuzz::Output().Byte(3).Bytes("").data(); }

control::HeartbeatRequest Beat(control::Role role, uint32_t rank, uint64_t step) {
  control::HeartbeatRequest h;
  h.set_role(role);
  h.set_rank(rank);
  h.set_job_id(kJobId);
  h.set_step(step);
  return h;
}

void AddMetrics(control::HeartbeatRequest* h, uint64_t step) {
  control::StepMetrics* m = h->add_metrics();
  m->set_step(step);
  m->set_loss(1.0f / static_cast<float>(step + 1));
  m->set_wall_s(0.1 * static_cast<double>(step + 1));
  m->set_step_s(0.1);
  m->set_bytes_up(400);
  m->set_bytes_down(400);
  m->set_phase("warmup");
}

void AddPart(google::protobuf::RepeatedPtrField<control::CheckpointPart>* parts, uint64_t step,
             const std::string& name) {
  control::CheckpointPart* p = parts->Add();
  p->set_step(step);
  p->set_name(name);
  p->set_size(1234);
  p->set_crc32(0xdeadbeef);
}

control::DoneRequest Finished(control::Role role, uint32_t rank, uint32_t shards, uint64_t steps) {
  control::DoneRequest d;
  d.set_role(role);
  d.set_rank(rank);
  d.set_job_id(kJobId);
  d.set_steps(steps);
  for (uint32_t k = 0; k < shards; ++k) {
    if (role == control::SERVER && k != rank) continue;
    control::ShardChecksum* c = d.add_checksums();
    c->set_shard(k);
    c->set_begin(0);
    c->set_end(100);
    c->set_crc32(0x1234);
  }
  return d;
}

}  // namespace

std::vector<fuzz::Seed> Seeds() {
  std::vector<fuzz::Seed> seeds;
  const uint8_t formed = 2;
  auto add = [&](const std::string& name, uint8_t flags, std::vector<std::string> calls) {
    fuzz::Output o;
    o.Byte(flags);
    for (const std::string& c : calls) o.Rest(c);
    seeds.push_back({name, o.data()});
  };
  const JobSpec& a = kJobs[0];
  const JobSpec& b = kJobs[1];
  add("formed", formed, {});
  add("status-registering", 0, {StatusCall()});
  // The cluster forms from the input's own calls.
  add("register-all", 0,
      {RegisterCall(Registration(a, control::SERVER, 0)),
       RegisterCall(Registration(a, control::WORKER, 0)), StatusCall()});
  {
    control::RegisterRequest w = Registration(b, control::WORKER, 1);
    (*w.mutable_settings())["lr"] = "0.01";
    (*w.mutable_settings())["worker_codec"] = "fp16";
    control::WeightDecayRange* r = w.add_weight_decay_ranges();
    r->set_begin(0);
    r->set_end(10);
    r->set_weight_decay(0.0f);
    control::LrScaleRange* l = w.add_lr_scale_ranges();
    l->set_begin(10);
    l->set_end(20);
    l->set_lr_scale(0.5f);
    control::RegisterRequest w0 = w;
    w0.set_requested_rank(-1);
    add("register-external-declared", 1,
        {RegisterCall(Registration(b, control::SERVER, 0)),
         RegisterCall(Registration(b, control::SERVER, 1)), RegisterCall(w0), RegisterCall(w)});
    (*w.mutable_settings())["lr"] = "0.02";
    add("register-disagree", 1 | formed, {RegisterCall(w)});
  }
  {
    control::RegisterRequest bad = Registration(a, control::SERVER, 0);
    bad.set_role(control::ROLE_UNSPECIFIED);
    control::RegisterRequest out_of_range = Registration(a, control::WORKER, 5);
    control::RegisterRequest no_endpoint = Registration(a, control::SERVER, 0);
    no_endpoint.clear_data_endpoint();
    control::RegisterRequest too_big = Registration(b, control::WORKER, 0);
    too_big.set_num_params(uint64_t{1} << 40);
    add("register-refused", 0,
        {RegisterCall(bad), RegisterCall(out_of_range), RegisterCall(no_endpoint)});
    add("register-too-big", 1, {RegisterCall(too_big)});
  }
  // A whole job: steps, metrics, a checkpoint, Done, the summary.
  {
    std::vector<std::string> calls;
    for (uint64_t step = 0; step < 4; ++step) {
      control::HeartbeatRequest s = Beat(control::SERVER, 0, step + 1);
      control::HeartbeatRequest w = Beat(control::WORKER, 0, step + 1);
      AddMetrics(&w, step);
      if (step + 1 == 2) {
        AddPart(s.mutable_checkpoint_parts(), 2, "server-0.state");
        AddPart(w.mutable_checkpoint_parts(), 2, "worker-0.state");
      }
      calls.push_back(HeartbeatCall(s));
      calls.push_back(HeartbeatCall(w));
    }
    calls.push_back(DoneCall(Finished(control::SERVER, 0, 1, 0)));
    calls.push_back(DoneCall(Finished(control::WORKER, 0, 1, 4)));
    calls.push_back(StatusCall());
    add("job-finishes", formed, calls);
    // The same, the server restarted after the checkpoint: a roll-back, and
    // every process registers again.
    calls.resize(4);
    calls.push_back(RegisterCall(Registration(a, control::SERVER, 0)));
    control::RegisterRequest again = Registration(a, control::WORKER, 0);
    again.set_rejoin_from(1);
    calls.push_back(RegisterCall(again));
    calls.push_back(HeartbeatCall(Beat(control::WORKER, 0, 2)));
    add("rollback-and-rejoin", formed, calls);
  }
  // --freeze auto on two shards, a stop with a checkpoint, a failure.
  {
    std::vector<std::string> calls;
    for (uint32_t k = 0; k < 2; ++k) {
      control::HeartbeatRequest s = Beat(control::SERVER, k, 2);
      control::FreezeCheck* c = s.add_freeze_checks();
      c->set_completed(2);
      c->set_change(0.01);
      calls.push_back(HeartbeatCall(s));
    }
    add("freeze-auto", 1 | formed, calls);
    control::HeartbeatRequest stop = Beat(control::WORKER, 0, 1);
    stop.set_stop_requested("SIGTERM");
    calls = {HeartbeatCall(stop)};
    for (uint32_t w = 0; w < 2; ++w) {
      control::HeartbeatRequest ack = Beat(control::WORKER, w, 2);
      ack.set_stop_ack(2);
      AddPart(ack.mutable_checkpoint_parts(), 2, "worker-" + std::to_string(w) + ".state");
      calls.push_back(HeartbeatCall(ack));
    }
    for (uint32_t k = 0; k < 2; ++k) {
      control::HeartbeatRequest s = Beat(control::SERVER, k, 2);
      AddPart(s.mutable_checkpoint_parts(), 2, "server-" + std::to_string(k) + ".state");
      calls.push_back(HeartbeatCall(s));
    }
    calls.push_back(HeartbeatCall(Beat(control::WORKER, 1, 2)));
    add("stop-with-checkpoint", 1 | formed, calls);
    control::HeartbeatRequest failed = Beat(control::SERVER, 1, 0);
    failed.set_error("out of memory");
    add("process-fails", 1 | formed,
        {HeartbeatCall(failed), HeartbeatCall(Beat(control::WORKER, 0, 0)), StatusCall()});
    // Of another incarnation, and of another job.
    control::HeartbeatRequest stranger = Beat(control::WORKER, 0, 0);
    stranger.set_incarnation(99);
    control::HeartbeatRequest other = Beat(control::WORKER, 0, 0);
    other.set_job_id(7);
    add("strangers", formed,
        {fuzz::Output().Byte(1).Bytes(stranger.SerializeAsString()).data(),
         fuzz::Output().Byte(1).Bytes(other.SerializeAsString()).data(),
         fuzz::Output()
             .Byte(2)
             .Bytes(Finished(control::WORKER, 3, 1, 4).SerializeAsString())
             .data()});
  }
  return seeds;
}

}  // namespace onebit

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  // Protobuf logs each string field that is not UTF-8 (the parse then
  // fails): a line per such input here.
  google::protobuf::SetLogHandler(nullptr);
  return onebit::fuzz::Initialize(argc, argv, onebit::Seeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace onebit;
  fuzz::Input in(data, size);
  const uint8_t flags = in.Byte();
  Harness h((flags & 1) % kNumJobs);
  if (flags & 2) h.Form();
  for (int i = 0; i < kMaxCalls && !in.empty(); ++i) {
    const uint8_t op = in.Byte();
    h.Call(op, in.Bytes());
  }
  h.Finish();
  return 0;
}
