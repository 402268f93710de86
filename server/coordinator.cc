#include "server/coordinator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/state_file.h"
#include "net/control.h"
#include "net/job_config.h"
#include "net/liveness.h"
#include "optim/reference.h"
#include "security/tls.h"

namespace onebit {

uint64_t NewRandomId() {
  std::random_device rd;
  const uint64_t id =
      (uint64_t{rd()} << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return id == 0 ? 1 : id;
}

const char* StateName(CoordinatorService::State s) {
  switch (s) {
    case CoordinatorService::State::kRegistering:
      return "registering";
    case CoordinatorService::State::kRunning:
      return "running";
    case CoordinatorService::State::kFinished:
      return "finished";
    case CoordinatorService::State::kFailed:
      return "failed";
    case CoordinatorService::State::kStopped:
      return "stopped";
  }
  return "?";
}

CoordinatorService::CoordinatorService(control::TrainingConfig config, std::set<std::string> given,
                                       uint64_t job_id, absl::Duration register_timeout,
                                       Security security)
    : config_(std::move(config)),
      given_(std::move(given)),
      job_id_(job_id),
      security_(std::move(security)),
      register_deadline_(absl::Now() + register_timeout),
      heartbeat_timeout_(absl::Milliseconds(config_.heartbeat_timeout_ms())),
      rejoin_timeout_(config_.checkpoint_dir().empty()
                          ? absl::ZeroDuration()
                          : absl::Milliseconds(config_.rejoin_timeout_ms())),
      servers_(config_.servers()),
      workers_(config_.workers()) {
  // The config was validated before the service was made.
  freeze_ = FreezeOptionsFromConfig(config_).value_or(FreezeOptions{});
}

absl::Status CheckResumable(const control::TrainingConfig& config,
                            const CompleteCheckpoint& checkpoint) {
  // The servers' state is saved by global range, and none of these but
  // the number of workers changes a bit of the result (see
  // LoadWorkerStateResized for that one).
  static const std::set<std::string> kMayChange = {
      "servers",          "workers",           "chunk_elems",
      "step_timeout",     "heartbeat_timeout", "checkpoint_dir",
      "checkpoint_every", "checkpoint_keep",   "resume",
      "rejoin_timeout",   "checkpoint_failure"};
  const std::vector<std::string> conflicts =
      ConfigDifferences(config, checkpoint.manifest.config(), kMayChange);
  if (conflicts.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "cannot resume from ", checkpoint.dir, ": it was written by a job with another config: ",
      absl::StrJoin(conflicts, "; "), ". Run with that config, or give another --checkpoint_dir"));
}

void CoordinatorService::ResumeFrom(CompleteCheckpoint checkpoint,
                                    std::vector<MetricsRow> prior_rows, uint32_t restarts,
                                    uint64_t rolled_back_steps, uint64_t reached) {
  absl::MutexLock l(&mu_);
  latest_ = checkpoint;
  resume_ = std::move(checkpoint);
  // Processes of the job that outlived its last coordinator must not pass
  // for this forming's.
  incarnation_ = NewRandomId();
  rejoin_why_ = "the coordinator restarted";
  prior_rows_ = std::move(prior_rows);
  for (const MetricsRow& r : prior_rows_) loss_watch_.Add(r.step, r.loss);
  restarts_ = restarts;
  rolled_back_steps_ = rolled_back_steps;
  rollback_reached_ = std::max(reached, resume_->manifest.step());
  history_changed_ = true;
}

std::string CoordinatorService::Name(control::Role role, uint32_t rank) {
  return absl::StrCat(role == control::SERVER ? "server " : "worker ", rank);
}

std::vector<CoordinatorService::Process>& CoordinatorService::Group(control::Role role) {
  return role == control::SERVER ? servers_ : workers_;
}

bool CoordinatorService::AllRegisteredLocked() const {
  for (const auto* g : {&servers_, &workers_}) {
    for (const Process& p : *g) {
      if (!p.registered) return false;
    }
  }
  return true;
}

std::string CoordinatorService::RemedyLocked() const {
  absl::StatusOr<OptimizerOptions> o = OptimizerOptionsFromConfig(config_);
  return o.ok() ? DivergenceRemedy(*o) : "a lower --lr";
}

std::string CoordinatorService::MissingLocked() const {
  std::vector<std::string> missing;
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (!servers_[i].registered) missing.push_back(absl::StrCat("server ", i));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!workers_[i].registered) missing.push_back(absl::StrCat("worker ", i));
  }
  return absl::StrJoin(missing, ", ");
}

void CoordinatorService::FailLocked(const std::string& reason) {
  if (state_ == State::kFinished || state_ == State::kFailed) return;
  state_ = State::kFailed;
  reason_ = reason;
  ended_ = absl::Now();
  std::fprintf(stderr, "coordinator: job failed: %s\n", reason.c_str());
}

grpc::Status CoordinatorService::Authenticate(const grpc::ServerContext* ctx,
                                              absl::string_view rpc) {
  grpc::Status st = CheckCallCredential(*ctx, security_);
  if (st.ok()) return st;
  return Refuse(rpc, st);
}

grpc::Status CoordinatorService::Refuse(absl::string_view rpc, grpc::Status st) {
  refusals_.Refused(absl::StrCat("a ", rpc, ": ", st.error_message()));
  return st;
}

bool CoordinatorService::IsOwnerLocked(control::Role role, uint32_t rank,
                                       const std::string& credential) const {
  const std::vector<Process>& group = role == control::SERVER ? servers_ : workers_;
  return (role == control::SERVER || role == control::WORKER) && rank < group.size() &&
         group[rank].registered && SameBytes(credential, group[rank].credential);
}

grpc::Status CoordinatorService::Register(grpc::ServerContext* ctx,
                                          const control::RegisterRequest* req,
                                          control::RegisterReply* reply) {
  if (grpc::Status st = Authenticate(ctx, "Register"); !st.ok()) return st;
  absl::MutexLock l(&mu_);
  if (req->role() != control::SERVER && req->role() != control::WORKER) {
    return Refuse("Register", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                           "role must be SERVER or WORKER"));
  }
  if (!security_.insecure() && req->curve_public_key().size() != 32) {
    return Refuse("Register",
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("a process of a secured job must give its "
                                            "32-byte CURVE public key (got ",
                                            req->curve_public_key().size(), " bytes)")));
  }
  std::vector<Process>& group = Group(req->role());
  const char* what = req->role() == control::SERVER ? "server" : "worker";
  int rank = req->requested_rank();
  if (rank >= static_cast<int>(group.size())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(what, " rank ", rank, " out of range (job has ", group.size(),
                                     " ", what, "s)"));
  }
  if (state_ == State::kRunning && rank >= 0 && !req->has_rejoin_from()) {
    // A process of this rank started again (its predecessor crashed or was
    // preempted, perhaps before its heartbeats stopped): the job rolls back.
    grpc::Status st;
    if (req->role() == control::WORKER) {
      if (absl::Status c = CheckDeclaredLocked(rank, *req); !c.ok()) {
        st = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(c.message()));
      }
    }
    std::string why_not;
    const std::string why = absl::StrCat(what, " ", rank, " registered again (restarted)");
    if (st.ok() && !RollBackLocked(why, &why_not)) {
      // Its predecessor is gone, and the job cannot go on without it.
      FailLocked(absl::StrCat(why, ", but the job cannot roll back: ", why_not));
      st = grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("job ", absl::StrFormat("%016x", job_id_),
                                     " is running: registration is closed (", why_not, ")"));
    }
    if (!st.ok()) return st;
  }
  if (state_ != State::kRegistering) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("job ", absl::StrFormat("%016x", job_id_), " is ",
                                     StateName(state_), ": registration is closed"));
  }
  if (rank >= 0 && group[rank].registered) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat(what, " rank ", rank, " is already registered",
                                     req->has_rejoin_from() ? " (by a restarted process)" : ""));
  }
  if (rank < 0) {
    for (size_t i = 0; i < group.size() && rank < 0; ++i) {
      if (!group[i].registered) rank = static_cast<int>(i);
    }
    if (rank < 0) {
      return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("all ", group.size(), " ", what, " ranks are taken"));
    }
  }
  if (req->role() == control::SERVER && req->data_endpoint().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a server must give its data_endpoint");
  }
  if (req->role() == control::WORKER) {
    absl::Status st = CheckDeclaredLocked(static_cast<uint32_t>(rank), *req);
    // Once the job is set up, a worker that declares otherwise cannot join
    // it, and the job goes on without it.
    if (!st.ok() && formed_) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(st.message()));
    }
    if (!st.ok()) {
      // The job cannot run: tell everyone now rather than at the deadline.
      FailLocked(std::string(st.message()));
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(st.message()));
    }
  }
  Process& p = group[rank];
  p.registered = true;
  p.info = *req;
  if (req->role() == control::WORKER && req->has_rejoin_from()) {
    CountRolledBackLocked(req->rejoin_steps_done());
  }
  p.last_seen = absl::Now();
  p.credential = RandomBytes(16);
  std::fprintf(stderr, "coordinator: %s %d registered (%s)\n", what, rank,
               req->data_endpoint().empty() ? req->host().c_str() : req->data_endpoint().c_str());
  if (AllRegisteredLocked()) formed_ ? ReformLocked() : FormLocked();
  const absl::Time deadline = std::min(register_deadline_, absl::FromChrono(ctx->deadline()));
  auto ready = [this]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return state_ != State::kRegistering; };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (state_ == State::kRegistering) {
    return grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("the cluster did not form in time; waiting for ", MissingLocked()));
  }
  if (state_ != State::kRunning) {
    return grpc::Status(grpc::StatusCode::ABORTED, absl::StrCat("job failed: ", reason_));
  }
  reply->set_job_id(job_id_);
  reply->set_incarnation(incarnation_);
  reply->set_rank(static_cast<uint32_t>(rank));
  reply->set_credential(group[rank].credential);
  *reply->mutable_config() = config_;
  reply->set_shard_map(map_.Serialize());
  for (uint64_t e : job_layers_) reply->add_layer_ends(e);
  for (const DecayRange& r : decay_) {
    control::WeightDecayRange* p = reply->add_weight_decay_ranges();
    p->set_begin(r.begin);
    p->set_end(r.end);
    p->set_weight_decay(r.weight_decay);
  }
  for (size_t i = 0; i < servers_.size(); ++i) {
    control::ServerInfo* s = reply->add_servers();
    s->set_rank(static_cast<uint32_t>(i));
    s->set_data_endpoint(servers_[i].info.data_endpoint());
    s->set_curve_public_key(servers_[i].info.curve_public_key());
  }
  if (req->role() == control::SERVER) {
    for (const Process& w : workers_) reply->add_worker_curve_keys(w.info.curve_public_key());
  }
  if (resume_) {
    control::ResumePoint* r = reply->mutable_resume();
    r->set_step(resume_->manifest.step());
    r->set_dir(resume_->dir);
    for (const checkpoint::ManifestFile& f : resume_->manifest.files()) {
      if (absl::StartsWith(f.name(), "server-")) r->add_server_files(f.name());
    }
    r->set_workers(resume_->manifest.config().workers());
    for (uint32_t w = 0; w < resume_->manifest.config().workers(); ++w) {
      r->add_worker_files(absl::StrCat("worker-", w, ".state"));
    }
  }
  return grpc::Status::OK;
}

absl::Status CoordinatorService::CheckDeclaredParamsLocked(uint32_t rank, uint64_t d) {
  const bool external = config_.model() == kExternalModel;
  if (d == 0) {
    if (!external) return absl::OkStatus();  // the job's built-in model decides
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank,
                     " declares no parameter count; a --model external job takes d from "
                     "its workers"));
  }
  if (d > kMaxParams) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank, " declares d = ", d, ", above the limit of ", kMaxParams));
  }
  if (!external) {
    if (d == config_.dim()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("worker ", rank, " declares d = ", d,
                                                   ", but the job's model (", config_.model(),
                                                   ") has d = ", config_.dim()));
  }
  if (!declared_by_) {
    declared_by_ = rank;
    config_.set_dim(d);
    return absl::OkStatus();
  }
  if (d == config_.dim()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("worker ", rank, " declares d = ", d,
                                                 ", but worker ", *declared_by_,
                                                 " declared d = ", config_.dim()));
}

namespace {

// Bitwise: every replica must apply the same float.
bool SameDecay(const std::vector<DecayRange>& a, const std::vector<DecayRange>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].begin != b[i].begin || a[i].end != b[i].end ||
        absl::bit_cast<uint32_t>(a[i].weight_decay) !=
            absl::bit_cast<uint32_t>(b[i].weight_decay)) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::Status CoordinatorService::CheckDeclaredDecayLocked(uint32_t rank,
                                                          const control::RegisterRequest& req) {
  if (!decay_by_) {
    decay_by_ = rank;
    decay_ = DecayRangesOf(req.weight_decay_ranges());
    return absl::OkStatus();
  }
  const std::vector<DecayRange> mine = DecayRangesOf(req.weight_decay_ranges());
  if (SameDecay(decay_, mine)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", rank, " declares the weight-decay ranges ", DecayRangesText(mine),
                   ", but worker ", *decay_by_, " declared ", DecayRangesText(decay_)));
}

absl::Status CoordinatorService::CheckDeclaredLayersLocked(uint32_t rank,
                                                           const control::RegisterRequest& req) {
  const std::vector<uint64_t> mine(req.layer_ends().begin(), req.layer_ends().end());
  if (!layers_by_ || *layers_by_ == rank) {
    layers_by_ = rank;
    layers_ = mine;
    return absl::OkStatus();
  }
  if (mine == layers_) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", rank, " declares ", mine.size(), " tensors ending at [",
                   absl::StrJoin(mine, ", "), "], but worker ", *layers_by_, " declared ",
                   layers_.size(), " ending at [", absl::StrJoin(layers_, ", "), "]"));
}

namespace {

std::string SettingsText(const std::map<std::string, std::string>& settings) {
  if (settings.empty()) return "none";
  std::vector<std::string> parts;
  for (const auto& [k, v] : settings) parts.push_back(absl::StrCat("--", k, "=", v));
  return absl::StrJoin(parts, " ");
}

}  // namespace

absl::Status CoordinatorService::CheckDeclaredSettingsLocked(uint32_t rank,
                                                             const control::RegisterRequest& req) {
  std::map<std::string, std::string> mine(req.settings().begin(), req.settings().end());
  // (After the job formed, the first worker too, registering again.)
  if (decay_by_ && (*decay_by_ != rank || formed_)) {
    if (mine == declared_) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("worker ", rank, " declares the settings ",
                                                   SettingsText(mine), ", but worker ", *decay_by_,
                                                   " declared ", SettingsText(declared_)));
  }
  // The first worker (CheckDeclaredDecayLocked has just recorded it).
  declared_ = std::move(mine);
  control::TrainingConfig trial = config_;
  std::set<std::string> given = given_;
  if (absl::Status st = ApplyDeclaredSettings(declared_, &given, &trial); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", rank, ": ", st.message()));
  }
  return absl::OkStatus();
}

void CoordinatorService::FormLocked() {
  if (!declared_.empty()) {
    if (absl::Status st = ApplyDeclaredSettings(declared_, &given_, &config_); !st.ok()) {
      FailLocked(absl::StrCat("the workers' settings: ", st.message()));
      return;
    }
    freeze_ = FreezeOptionsFromConfig(config_).value_or(FreezeOptions{});
    std::fprintf(stderr, "coordinator: the workers set %s (optimizer %s, lr %g)\n",
                 SettingsText(declared_).c_str(), config_.optimizer().c_str(), config_.lr());
  }
  // An external model's tensors are the ones its workers declared.
  job_layers_ = layers_;
  if (config_.model() != kExternalModel) {
    absl::StatusOr<std::vector<uint64_t>> ends = ModelLayerEnds(config_);
    if (!ends.ok()) {
      FailLocked(absl::StrCat("the model's tensors: ", ends.status().message()));
      return;
    }
    job_layers_ = *ends;
  }
  auto map = ShardMapForConfig(config_, job_layers_);
  if (!map.ok()) {
    FailLocked(absl::StrCat("cannot shard d = ", config_.dim(), ": ", map.status().message()));
    return;
  }
  if (absl::Status st = ValidateDecayRanges(decay_, config_.dim()); !st.ok()) {
    FailLocked(absl::StrCat("the workers' weight-decay ranges ", DecayRangesText(decay_), ": ",
                            st.message()));
    return;
  }
  if (resume_) {
    const checkpoint::Manifest& m = resume_->manifest;
    if (absl::Status st = CheckResumable(config_, *resume_); !st.ok()) {
      FailLocked(std::string(st.message()));
      return;
    }
    // The steps before the checkpoint are done: their rows, their
    // checkpoints and their --freeze auto decisions.
    rows_taken_ = m.step();
    last_checkpoint_ = m.step();
    freeze_decided_ = m.freeze_decided();
    freeze_step_ = m.freeze_step();
    bool live = false;  // processes that outlived the coordinator before this one
    for (auto* g : {&servers_, &workers_}) {
      for (Process& q : *g) {
        q.step = m.step();
        live |= q.info.has_rejoin_from();
      }
    }
    rollbacks_ += live;
    std::fprintf(stderr, "coordinator: resuming from the checkpoint of step %llu in %s\n",
                 static_cast<unsigned long long>(m.step()), resume_->dir.c_str());
  }
  map_ = *std::move(map);
  state_ = State::kRunning;
  formed_ = true;
  const absl::Time now = absl::Now();
  started_ = now;
  for (auto* g : {&servers_, &workers_}) {
    for (Process& q : *g) q.last_seen = now;
  }
  std::fprintf(
      stderr, "coordinator: all %u servers and %u workers registered; running (d = %llu)\n",
      config_.servers(), config_.workers(), static_cast<unsigned long long>(config_.dim()));
}

absl::Status CoordinatorService::CheckDeclaredLocked(uint32_t rank,
                                                     const control::RegisterRequest& req) {
  absl::Status st = CheckDeclaredParamsLocked(rank, req.num_params());
  if (st.ok()) st = CheckDeclaredDecayLocked(rank, req);
  if (st.ok()) st = CheckDeclaredLayersLocked(rank, req);
  if (st.ok()) st = CheckDeclaredSettingsLocked(rank, req);
  if (st.ok()) st = CheckDeclaredLocalStateLocked(rank, req);
  return st;
}

absl::Status CoordinatorService::CheckDeclaredLocalStateLocked(
    uint32_t rank, const control::RegisterRequest& req) {
  const auto& mine = req.local_state();
  if (!local_state_by_ || *local_state_by_ == rank) {
    local_state_by_ = rank;
    local_state_.assign(mine.begin(), mine.end());
    return absl::OkStatus();
  }
  const uint32_t first = *local_state_by_;
  bool same_names = static_cast<size_t>(mine.size()) == local_state_.size();
  const size_t n = std::min<size_t>(mine.size(), local_state_.size());
  for (size_t i = 0; i < n; ++i) {
    const control::LocalTensor& a = local_state_[i];
    const control::LocalTensor& b = mine[static_cast<int>(i)];
    if (a.name() != b.name()) {  // another model: said below
      same_names = false;
      break;
    }
    if (a.crc32() != b.crc32()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker ", rank, "'s ", b.name(), " differs from worker ", first, "'s (CRC-32 ",
          absl::Hex(b.crc32(), absl::kZeroPad8), " against ", absl::Hex(a.crc32(), absl::kZeroPad8),
          "): tensors the job does not train (buffers, frozen parameters) are not broadcast, so "
          "every rank must start them equal (seed torch alike before building the model, or "
          "load the same weights)"));
    }
  }
  if (same_names) return absl::OkStatus();
  auto names = [](auto begin, auto end) {
    std::vector<std::string> v;
    for (auto it = begin; it != end && v.size() < 8; ++it) v.push_back(it->name());
    return absl::StrCat("[", absl::StrJoin(v, ", "), end - begin > 8 ? ", ..." : "", "]");
  };
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", rank, " declares ", mine.size(), " tensors outside the optimizer ",
                   names(mine.begin(), mine.end()), ", but worker ", first, " declared ",
                   local_state_.size(), " ", names(local_state_.begin(), local_state_.end()),
                   ": every rank must build the same model"));
}

bool CoordinatorService::RollBackLocked(const std::string& why, std::string* why_not) {
  const std::optional<CompleteCheckpoint>& target = latest_;
  if (state_ != State::kRunning) {
    *why_not = absl::StrCat("the job is ", StateName(state_));
  } else if (config_.checkpoint_dir().empty()) {
    *why_not = "it has no --checkpoint_dir to roll back to";
  } else if (rejoin_timeout_ == absl::ZeroDuration()) {
    *why_not = "--rejoin_timeout is 0";
  } else if (!target) {
    *why_not = "no checkpoint is complete yet to roll back to";
  } else if (!stop_by_.empty()) {
    *why_not = absl::StrCat("the job is stopping (", stop_by_, ")");
  } else {
    for (uint32_t w = 0; w < workers_.size() && why_not->empty(); ++w) {
      if (workers_[w].done) *why_not = absl::StrCat("worker ", w, " has finished and left");
    }
  }
  if (!why_not->empty()) return false;
  const uint64_t step = target->manifest.step();
  // The heartbeats' steps may be up to a heartbeat old: the workers that
  // register again report how far they really got (CountRolledBackLocked).
  uint64_t reached = step;
  for (const Process& p : workers_) reached = std::max(reached, p.step);
  rolled_back_steps_ += reached - step;
  rollback_reached_ = reached;
  history_changed_ = true;
  ++restarts_;
  ++rollbacks_;
  resume_ = target;
  incarnation_ = NewRandomId();
  rejoin_why_ = why;
  state_ = State::kRegistering;
  register_deadline_ = absl::Now() + rejoin_timeout_;
  for (auto* g : {&servers_, &workers_}) {
    for (Process& p : *g) {
      p.registered = false;
      p.told = false;
      p.done = false;
      p.stop_ack.reset();
      p.checksums.clear();
      p.step = step;
    }
  }
  // The rows written to metrics.csv stay (the steps run again reproduce
  // them bit for bit); partial ones are reported again.
  metrics_.erase(metrics_.lower_bound(rows_taken_), metrics_.end());
  parts_.clear();
  freeze_checks_.clear();
  freeze_decided_ = target->manifest.freeze_decided();
  freeze_step_ = target->manifest.freeze_step();
  std::fprintf(stderr,
               "coordinator: %s: rolling the job back to the checkpoint of step %llu (%llu or "
               "more steps to run again); waiting up to %s for every process to register again\n",
               why.c_str(), static_cast<unsigned long long>(step),
               static_cast<unsigned long long>(reached - step),
               absl::FormatDuration(rejoin_timeout_).c_str());
  return true;
}

void CoordinatorService::ReformLocked() {
  state_ = State::kRunning;
  const absl::Time now = absl::Now();
  for (auto* g : {&servers_, &workers_}) {
    for (Process& q : *g) q.last_seen = now;
  }
  std::fprintf(stderr,
               "coordinator: every process registered again; the job continues from step %llu\n",
               static_cast<unsigned long long>(resume_->manifest.step()));
}

void CoordinatorService::CountRolledBackLocked(uint64_t steps_done) {
  // Only while rolling back (or resuming) from a checkpoint; a count past
  // the job's end would be made up.
  if (!resume_ || steps_done <= rollback_reached_ ||
      (config_.steps() > 0 && steps_done > config_.steps())) {
    return;
  }
  rolled_back_steps_ += steps_done - rollback_reached_;
  rollback_reached_ = steps_done;
  history_changed_ = true;
}

void CoordinatorService::ReplyToStrangerLocked(control::HeartbeatReply* reply) const {
  if (state_ == State::kRegistering || state_ == State::kRunning) {
    reply->set_command(control::REJOIN);
    reply->set_reason(absl::StrCat(
        rejoin_why_.empty() ? std::string("the job formed again without this process")
                            : rejoin_why_,
        resume_
            ? absl::StrCat("; rolling back to the checkpoint of step ", resume_->manifest.step())
            : std::string()));
    return;
  }
  reply->set_command(control::ABORT);
  reply->set_reason(absl::StrCat("the job is ", StateName(state_),
                                 reason_.empty() ? std::string() : absl::StrCat(": ", reason_)));
}

grpc::Status CoordinatorService::CheckJob(control::Role role, uint32_t rank,
                                          uint64_t job_id) const {
  if (job_id != job_id_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrFormat("wrong job id %016x (this job is %016x)", job_id, job_id_));
  }
  const std::vector<Process>& group = role == control::SERVER ? servers_ : workers_;
  if ((role != control::SERVER && role != control::WORKER) || rank >= group.size() ||
      !group[rank].registered) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("unknown process ", Name(role, rank)));
  }
  return grpc::Status::OK;
}

void CoordinatorService::AddMetricsLocked(uint32_t rank, const control::StepMetrics& m,
                                          uint64_t steps_done) {
  if (m.step() < rows_taken_) return;  // written already, before a roll-back
  // Metrics come after their step completes (at most one step ahead of the
  // step count they arrive with, which may be sampled just before); more is
  // refused, so that what a worker can make the coordinator hold is bounded
  // by the steps it has run.
  if (m.step() > steps_done || (config_.steps() > 0 && m.step() >= config_.steps())) {
    refusals_.Refused(absl::StrCat("a metrics row of worker ", rank, " for step ", m.step(),
                                   " (it has run ", steps_done, ")"));
    return;
  }
  auto& row = metrics_[m.step()];
  row.resize(workers_.size());
  row[rank] = m;
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx,
                                           const control::HeartbeatRequest* req,
                                           control::HeartbeatReply* reply) {
  if (grpc::Status st = Authenticate(ctx, "Heartbeat"); !st.ok()) return st;
  absl::MutexLock l(&mu_);
  if (req->job_id() == job_id_ &&
      (req->role() == control::SERVER || req->role() == control::WORKER) &&
      req->rank() < Group(req->role()).size() &&
      (!IsOwnerLocked(req->role(), req->rank(), req->credential()) ||
       req->incarnation() != incarnation_)) {
    // Of this job, but not of this forming of it (or not the process that
    // holds the rank): nothing it says counts.
    ReplyToStrangerLocked(reply);
    return grpc::Status::OK;
  }
  grpc::Status st = CheckJob(req->role(), req->rank(), req->job_id());
  if (!st.ok()) return Refuse("Heartbeat", st);
  if (config_.steps() > 0 && req->step() > config_.steps()) {
    return Refuse("Heartbeat", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                            absl::StrCat(Name(req->role(), req->rank()),
                                                         " at step ", req->step(), " of a job of ",
                                                         config_.steps(), " steps")));
  }
  Process& p = Group(req->role())[req->rank()];
  p.last_seen = absl::Now();
  p.step = req->step();
  if (req->role() == control::WORKER) {
    // A row for a step the worker has not run would be made up.
    for (const auto& m : req->metrics()) AddMetricsLocked(req->rank(), m, req->step());
  } else {
    for (const auto& c : req->freeze_checks()) AddFreezeCheckLocked(req->rank(), c);
  }
  for (const auto& c : req->checkpoint_parts())
    AddCheckpointPartLocked(req->role(), req->rank(), c);
  if (!req->stop_requested().empty()) {
    RequestStopLocked(absl::StrCat(req->stop_requested(), " to ", Name(req->role(), req->rank())));
  }
  if (req->role() == control::WORKER && req->has_stop_ack()) p.stop_ack = req->stop_ack();
  MaybeDecideStopLocked();
  reply->set_stopping(!stop_by_.empty());
  if (stop_step_) reply->set_stop_step(*stop_step_);
  reply->set_freeze_decided(freeze_decided_);
  reply->set_freeze_step(freeze_step_);
  if (end_step_) reply->set_end_step(*end_step_);
  if (!req->error().empty()) {
    p.reported_error = true;
    FailLocked(absl::StrCat(Name(req->role(), req->rank()), " failed: ", req->error()));
  }
  switch (state_) {
    case State::kFinished:
      reply->set_command(control::SHUTDOWN);
      p.told = true;
      break;
    case State::kFailed:
      reply->set_command(control::ABORT);
      reply->set_reason(reason_);
      p.told = true;
      break;
    case State::kStopped:
      reply->set_command(control::STOP);
      reply->set_reason(reason_);
      p.told = true;
      break;
    default:
      reply->set_command(control::CONTINUE);
  }
  return grpc::Status::OK;
}

void CoordinatorService::AddFreezeCheckLocked(uint32_t shard, const control::FreezeCheck& c) {
  if (!freeze_.automatic || freeze_step_ != 0) return;
  freeze_checks_[c.completed()][shard] = c.change();
  uint32_t nonempty = 0;
  for (uint32_t k = 0; k < map_.num_shards(); ++k) nonempty += map_.shard(k).size() > 0;
  // Decide in order: each check once every non-empty shard has reported it.
  while (freeze_step_ == 0) {
    auto next = freeze_checks_.find(freeze_decided_ + freeze_.window);
    if (next == freeze_checks_.end() || next->second.size() < nonempty) return;
    std::vector<double> changes;
    double largest = 0;
    for (const auto& [k, change] : next->second) {
      changes.push_back(change);
      largest = std::max(largest, change);
    }
    const uint64_t step = AutoFreezeStep(freeze_, next->first, changes);
    freeze_decided_ = next->first;
    freeze_checks_.erase(next);
    // The check's measure, for the log and summary.json: how far the rule is
    // from firing (the first check has nothing to compare with: 1).
    freeze_history_.push_back({freeze_decided_, largest});
    if (step == kNever) {
      std::fprintf(stderr,
                   "coordinator: freeze check after %llu steps: largest change of v %.4g, not "
                   "below tau %.4g yet\n",
                   static_cast<unsigned long long>(freeze_decided_), largest, freeze_.tau);
      continue;
    }
    freeze_step_ = step;
    if (largest < freeze_.tau) {
      std::fprintf(stderr,
                   "coordinator: v settled after %llu steps (largest change %.4g < tau %.4g): "
                   "the warm-up ends; compression from step %llu\n",
                   static_cast<unsigned long long>(freeze_decided_), largest, freeze_.tau,
                   static_cast<unsigned long long>(step));
    } else {
      std::fprintf(stderr,
                   "coordinator: v has not settled after %llu steps (largest change %.4g, tau "
                   "%.4g), but the warm-up takes at most %g of the job's %llu steps: compression "
                   "from step %llu\n",
                   static_cast<unsigned long long>(freeze_decided_), largest, freeze_.tau,
                   freeze_.latest_fraction, static_cast<unsigned long long>(config_.steps()),
                   static_cast<unsigned long long>(step));
    }
  }
}

grpc::Status CoordinatorService::Done(grpc::ServerContext* ctx, const control::DoneRequest* req,
                                      control::DoneReply*) {
  if (grpc::Status st = Authenticate(ctx, "Done"); !st.ok()) return st;
  absl::MutexLock l(&mu_);
  grpc::Status st = CheckJob(req->role(), req->rank(), req->job_id());
  if (!st.ok()) return Refuse("Done", st);
  if (!IsOwnerLocked(req->role(), req->rank(), req->credential())) {
    return Refuse("Done", grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                                       absl::StrCat("Done for ", Name(req->role(), req->rank()),
                                                    " without its credential")));
  }
  if (req->incarnation() != incarnation_) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("Done of an earlier incarnation of the job (", rejoin_why_,
                                     "): register again"));
  }
  if (state_ != State::kRunning) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("job is ", StateName(state_), ": ", reason_));
  }
  if (absl::Status c = CheckCoverageLocked(*req); !c.ok()) {
    return Refuse("Done",
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(c.message())));
  }
  if (config_.steps() > 0 && req->steps() > config_.steps()) {
    return Refuse("Done", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                       absl::StrCat("Done after ", req->steps(),
                                                    " steps of a job of ", config_.steps())));
  }
  Process& p = Group(req->role())[req->rank()];
  p.last_seen = absl::Now();
  p.done = true;
  p.checksums.assign(req->checksums().begin(), req->checksums().end());
  if (req->role() == control::WORKER) {
    p.step = req->steps() > 0 ? req->steps() : config_.steps();
    for (const auto& m : req->metrics()) AddMetricsLocked(req->rank(), m, p.step);
    if (config_.steps() > 0 && p.step != config_.steps()) {
      FailLocked(absl::StrCat("worker ", req->rank(), " finished after ", p.step,
                              " steps; the job has ", config_.steps()));
      return grpc::Status::OK;
    }
  }
  for (const auto& c : req->checkpoint_parts())
    AddCheckpointPartLocked(req->role(), req->rank(), c);
  MaybeFinishLocked();
  return grpc::Status::OK;
}

absl::Status CoordinatorService::CheckCoverageLocked(const control::DoneRequest& req) const {
  const uint32_t shards = map_.num_shards();
  std::vector<int> seen(shards, 0);
  for (const control::ShardChecksum& c : req.checksums()) {
    const bool mine = req.role() == control::WORKER || c.shard() == req.rank();
    if (c.shard() >= shards || !mine || c.begin() != map_.shard(c.shard()).begin ||
        c.end() != map_.shard(c.shard()).end || ++seen[c.shard()] > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("Done of ", Name(req.role(), req.rank()), ": a checksum of shard ",
                       c.shard(), " [", c.begin(), ", ", c.end(), ") that is not ",
                       req.role() == control::WORKER ? "a shard of the job's map, once"
                                                     : "this server's own shard"));
    }
  }
  for (uint32_t k = 0; k < shards; ++k) {
    if ((req.role() == control::WORKER || k == req.rank()) && seen[k] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("Done of ", Name(req.role(), req.rank()), ": no checksum of shard ", k));
    }
  }
  return absl::OkStatus();
}

void CoordinatorService::MaybeFinishLocked() {
  if (state_ != State::kRunning) return;
  if (config_.steps() == 0 && !end_step_) {
    // The workers' program decided the length: the servers finish where
    // every worker did, so all must agree.
    for (const Process& w : workers_) {
      if (!w.done) return;
    }
    for (uint32_t w = 1; w < workers_.size(); ++w) {
      if (workers_[w].step != workers_[0].step) {
        FailLocked(
            absl::StrCat("the workers finished after different numbers of steps: worker 0 "
                         "after ",
                         workers_[0].step, ", worker ", w, " after ", workers_[w].step));
        return;
      }
    }
    end_step_ = workers_[0].step;
    std::fprintf(stderr, "coordinator: every worker finished after %llu steps\n",
                 static_cast<unsigned long long>(*end_step_));
  }
  for (auto* g : {&servers_, &workers_}) {
    for (const Process& p : *g) {
      if (!p.done) return;
    }
  }
  // Every worker's checksum of each shard range must match that shard's
  // master; under --server-reply delta, the server's mirror of the replica.
  bool equal = true, agree = true;
  floored_ = 0;
  for (uint32_t k = 0; k < servers_.size(); ++k) {
    const control::ShardChecksum* master = nullptr;
    for (const auto& c : servers_[k].checksums) {
      if (c.shard() == k) master = &c;
    }
    if (master == nullptr) {
      equal = agree = false;
      continue;
    }
    floored_ += master->floored();
    const uint32_t expect = master->has_replica() ? master->replica_crc32() : master->crc32();
    if (master->has_replica()) {
      max_replica_diff_ = std::max(max_replica_diff_.value_or(0.0), master->max_abs_diff());
      equal &= master->replica_crc32() == master->crc32();
    }
    for (uint32_t w = 0; w < workers_.size(); ++w) {
      bool match = false;
      for (const auto& c : workers_[w].checksums) {
        match |= c.shard() == k && c.begin() == master->begin() && c.end() == master->end() &&
                 c.crc32() == expect;
      }
      if (!match) {
        std::fprintf(stderr, "coordinator: worker %u's replica of shard %u differs from the %s\n",
                     w, k, master->has_replica() ? "server's mirror of it" : "master");
      }
      agree &= match;
    }
  }
  equal &= agree;
  replicas_equal_ = equal;
  workers_agree_ = agree;
  state_ = State::kFinished;
  ended_ = absl::Now();
  std::fprintf(stderr, "coordinator: all processes done; replicas_equal=%s\n",
               equal ? "true" : "false");
}

grpc::Status CoordinatorService::Status(grpc::ServerContext* ctx, const control::StatusRequest*,
                                        control::StatusReply* reply) {
  if (grpc::Status st = Authenticate(ctx, "Status"); !st.ok()) return st;
  absl::MutexLock l(&mu_);
  reply->set_job_id(job_id_);
  reply->set_state(StateName(state_));
  reply->set_reason(reason_);
  *reply->mutable_config() = config_;
  const absl::Time now = absl::Now();
  for (control::Role role : {control::SERVER, control::WORKER}) {
    const std::vector<Process>& group = role == control::SERVER ? servers_ : workers_;
    for (size_t i = 0; i < group.size(); ++i) {
      const Process& p = group[i];
      control::ProcessStatus* s = reply->add_processes();
      s->set_role(role);
      s->set_rank(static_cast<uint32_t>(i));
      s->set_data_endpoint(p.info.data_endpoint());
      s->set_health_endpoint(p.info.health_endpoint());
      s->set_step(p.step);
      s->set_since_heartbeat_s(p.registered ? absl::ToDoubleSeconds(now - p.last_seen) : -1);
      s->set_done(p.done);
    }
  }
  return grpc::Status::OK;
}

void CoordinatorService::Tick() {
  std::vector<Suspect> suspects;
  {
    absl::MutexLock l(&mu_);
    CheckTimeoutsLocked(&suspects);
  }
  if (suspects.empty()) return;
  std::vector<std::string> endpoints;
  for (const Suspect& s : suspects) endpoints.push_back(s.endpoint);
  const std::vector<Liveness> answers =
      ProbeListening(endpoints, std::min(absl::Seconds(1), heartbeat_timeout_ / 4));
  absl::MutexLock l(&mu_);
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < suspects.size(); ++i) {
    std::vector<Process>& group = Group(suspects[i].role);
    if (suspects[i].rank >= group.size()) continue;
    Process& p = group[suspects[i].rank];
    if (p.credential != suspects[i].credential || p.lost) continue;  // since replaced or lost
    p.answered_at = now;
    if (answers[i] == Liveness::kListening) p.listening_at = now;
  }
}

void CoordinatorService::CheckTimeoutsLocked(std::vector<Suspect>* suspects) {
  const absl::Time now = absl::Now();
  if (state_ == State::kRegistering && now > register_deadline_) {
    if (formed_) {
      FailLocked(absl::StrCat(rejoin_why_, "; rolled back to the checkpoint of step ",
                              resume_->manifest.step(), ", but ", MissingLocked(),
                              " did not register again within ",
                              absl::FormatDuration(rejoin_timeout_)));
    } else {
      FailLocked(absl::StrCat("registration timed out; still waiting for ", MissingLocked()));
    }
    return;
  }
  if (state_ != State::kRunning) return;
  if (!stop_by_.empty() && now > stop_deadline_) {
    FailLocked(absl::StrCat("stopped by ", stop_by_, ", but the checkpoint to stop at ",
                            stop_step_ ? absl::StrCat("(step ", *stop_step_, ") ")
                                       : std::string("(none yet: not every worker answered) "),
                            "was not complete in time; resume from the previous one"));
    return;
  }
  // A probe answers for a short while: a process found listening within
  // half the timeout counts as alive.
  const absl::Duration fresh = heartbeat_timeout_ / 2;
  const absl::Duration slow_limit = kSlowFactor * heartbeat_timeout_;
  for (control::Role role : {control::SERVER, control::WORKER}) {
    std::vector<Process>& group = Group(role);
    for (size_t i = 0; i < group.size(); ++i) {
      Process& p = group[i];
      if (role == control::WORKER && p.done) continue;  // done workers exit
      const absl::Duration silent = now - p.last_seen;
      if (silent <= fresh) {
        p.slow_said = false;
        continue;
      }
      const std::string name = Name(role, static_cast<uint32_t>(i));
      const std::string ep =
          p.info.data_endpoint().empty() ? p.info.host() : p.info.data_endpoint();
      const bool listening = now - p.listening_at <= fresh;
      // No verdict on a process with an endpoint before a probe has answered
      // since it went quiet (a starved coordinator may not have probed it).
      const bool unprobed =
          !p.info.health_endpoint().empty() && p.answered_at < p.last_seen + fresh;
      if (silent > heartbeat_timeout_ && unprobed) {
        // The probe below decides it by the next tick.
      } else if (silent > heartbeat_timeout_ && listening && silent <= slow_limit) {
        if (!p.slow_said) {
          p.slow_said = true;
          std::fprintf(stderr,
                       "coordinator: %s (%s) sent no heartbeat for %s, but it still listens at "
                       "its health endpoint %s: slow (a loaded host, a slow start), not dead; "
                       "waiting up to %s\n",
                       name.c_str(), ep.c_str(), absl::FormatDuration(heartbeat_timeout_).c_str(),
                       p.info.health_endpoint().c_str(), absl::FormatDuration(slow_limit).c_str());
        }
      } else if (silent > heartbeat_timeout_) {
        p.told = true;  // the dead hear nothing; do not wait for it
        p.lost = true;
        LoseLocked(listening ? absl::StrCat(name, " (", ep, ") sent no heartbeat for ",
                                            absl::FormatDuration(slow_limit),
                                            ", although it still listens at its health endpoint "
                                            "(hung?)")
                             : absl::StrCat(name, " (", ep, ") sent no heartbeat for ",
                                            absl::FormatDuration(heartbeat_timeout_)));
        return;
      }
      // Probe it again every tenth of the timeout while it is silent.
      if (!p.info.health_endpoint().empty() && (now - p.probed_at >= heartbeat_timeout_ / 10 ||
                                                (unprobed && silent > heartbeat_timeout_))) {
        p.probed_at = now;
        suspects->push_back(
            Suspect{role, static_cast<uint32_t>(i), p.credential, p.info.health_endpoint()});
      }
    }
  }
}

void CoordinatorService::LoseLocked(const std::string& lost) {
  std::string why_not;
  if (!RollBackLocked(absl::StrCat(lost, ": presumed dead"), &why_not)) {
    FailLocked(absl::StrCat(lost, ": presumed dead",
                            rejoin_timeout_ > absl::ZeroDuration()
                                ? absl::StrCat(" (the job cannot roll back: ", why_not, ")")
                                : std::string()));
  }
}

CoordinatorService::State CoordinatorService::state() const {
  absl::MutexLock l(&mu_);
  return state_;
}

std::string CoordinatorService::reason() const {
  absl::MutexLock l(&mu_);
  return reason_;
}

bool CoordinatorService::EveryoneTold() const {
  absl::MutexLock l(&mu_);
  for (const Process& p : servers_) {
    if (p.registered && !p.told) return false;
  }
  for (const Process& p : workers_) {
    if (p.registered && !p.done && !p.told) return false;
  }
  return true;
}

bool CoordinatorService::WorkersReportedLastMetrics() const {
  absl::MutexLock l(&mu_);
  if (state_ != State::kFailed) return true;
  for (const Process& p : workers_) {
    if (p.registered && !p.done && !p.reported_error && !p.lost) return false;
  }
  return true;
}

std::optional<MetricsRow> CoordinatorService::RowLocked(uint64_t step) const {
  auto it = metrics_.find(step);
  if (it == metrics_.end()) return std::nullopt;
  const auto& per_rank = it->second;
  if (per_rank.size() != workers_.size()) return std::nullopt;
  for (const auto& m : per_rank) {
    if (!m.has_value()) return std::nullopt;
  }
  MetricsRow r;
  r.step = step;
  r.phase = per_rank[0]->phase().empty() ? "warmup" : per_rank[0]->phase();
  double loss = 0;
  for (const auto& m : per_rank) {
    loss += m->loss();
    r.wall_s = std::max(r.wall_s, m->wall_s());
    r.step_s = std::max(r.step_s, m->step_s());
    r.push_s = std::max(r.push_s, m->push_s());
    r.reply_s = std::max(r.reply_s, m->reply_s());
    r.bytes_up += m->bytes_up();
    r.bytes_down += m->bytes_down();
  }
  r.loss = loss / static_cast<double>(per_rank.size());
  r.epoch = per_rank[0]->epoch();
  if (per_rank[0]->has_eval()) {
    r.test_loss = per_rank[0]->test_loss();
    r.test_accuracy = per_rank[0]->test_accuracy();
  }
  return r;
}

std::vector<MetricsRow> CoordinatorService::MetricsRows() const {
  absl::MutexLock l(&mu_);
  std::vector<MetricsRow> rows = prior_rows_;
  for (const auto& entry : metrics_) {
    if (auto r = RowLocked(entry.first)) rows.push_back(*std::move(r));
  }
  return rows;
}

std::vector<MetricsRow> CoordinatorService::TakeNewRows() {
  absl::MutexLock l(&mu_);
  std::vector<MetricsRow> rows;
  while (auto r = RowLocked(rows_taken_)) {
    if (auto warning = loss_watch_.Add(r->step, r->loss)) {
      std::fprintf(stderr, "coordinator: warning: %s; try %s\n", warning->c_str(),
                   RemedyLocked().c_str());
    }
    rows.push_back(*std::move(r));
    ++rows_taken_;
  }
  return rows;
}

void CoordinatorService::AddCheckpointPartLocked(control::Role role, uint32_t rank,
                                                 const control::CheckpointPart& part) {
  const uint64_t every = config_.checkpoint_every();
  const uint64_t step = part.step();
  // Only the steps the schedule names, and a stop's. (A part can arrive
  // before the heartbeat that says its sender got there.)
  const bool scheduled = every > 0 && step % every == 0;
  if (step == 0 || !(scheduled || (stop_step_ && step == *stop_step_))) return;
  if (last_checkpoint_ && step <= *last_checkpoint_) return;
  // Bounded: a checkpoint still incomplete 16 checkpoints later never will be.
  while (parts_.size() >= 16 && parts_.begin()->first < step) parts_.erase(parts_.begin());
  const std::string who = Name(role, rank);
  auto& files = parts_[step];
  if (files.count("")) {
    // Failed already: this file (or what is left of it) goes too.
    failed_dirs_.push_back(step);
    return;
  }
  if (!part.error().empty()) {
    files.clear();
    files.emplace("", part);  // the mark of a failed one
    CheckpointFailedLocked(step, absl::StrCat(who, ": ", part.error()));
    return;
  }
  files[who] = part;
  // A server with an empty shard runs no steps and saves nothing.
  size_t expected = workers_.size();
  for (uint32_t k = 0; k < map_.num_shards(); ++k) expected += map_.shard(k).size() > 0;
  if (files.size() < expected) return;
  checkpoint::Manifest m;
  m.set_format(kCheckpointFormat);
  m.set_step(step);
  m.set_job_id(absl::StrFormat("%016x", job_id_));
  *m.mutable_config() = config_;
  m.set_shard_map(map_.Serialize());
  m.set_restarts(restarts_);
  m.set_rolled_back_steps(rolled_back_steps_);
  // --freeze auto as of `step`: the servers may have run ahead and had
  // later checks decided; those are decided again after a resume.
  if (freeze_decided_ <= step) {
    m.set_freeze_decided(freeze_decided_);
    m.set_freeze_step(freeze_step_);
  } else if (freeze_.automatic) {
    m.set_freeze_decided(step / freeze_.window * freeze_.window);
  }
  for (const auto& [name, f] : files) {
    checkpoint::ManifestFile* e = m.add_files();
    e->set_name(f.name());
    e->set_size(f.size());
    e->set_crc32(f.crc32());
  }
  complete_.push_back(std::move(m));
  parts_.erase(parts_.begin(), parts_.upper_bound(step));
}

void CoordinatorService::CheckpointFailed(uint64_t step, const std::string& error) {
  absl::MutexLock l(&mu_);
  CheckpointFailedLocked(step, error);
}

void CoordinatorService::CheckpointFailedLocked(uint64_t step, const std::string& error) {
  ++checkpoint_errors_;
  last_checkpoint_error_ = absl::StrCat("step ", step, ": ", error);
  failed_dirs_.push_back(step);  // the files written before the failure
  const bool fail = config_.checkpoint_failure() == "fail";
  std::fprintf(stderr, "coordinator: the checkpoint of step %llu failed: %s; %s\n",
               static_cast<unsigned long long>(step), error.c_str(),
               fail ? "the job fails (--checkpoint_failure=fail)"
                    : absl::StrCat("the job goes on without it, not durable (",
                                   last_checkpoint_
                                       ? absl::StrCat("the last complete checkpoint is of step ",
                                                      *last_checkpoint_)
                                       : std::string("no checkpoint is complete"),
                                   ")")
                          .c_str());
  if (stop_step_ && *stop_step_ == step) {
    // Nothing to stop at: the job cannot be resumed from here.
    FailLocked(absl::StrCat("stopped by ", stop_by_, ", but the checkpoint to stop at (step ", step,
                            ") could not be written: ", error));
  } else if (fail) {
    FailLocked(absl::StrCat("the checkpoint of step ", step, " could not be written: ", error,
                            " (--checkpoint_failure=fail)"));
  }
}

std::vector<uint64_t> CoordinatorService::TakeFailedCheckpoints() {
  absl::MutexLock l(&mu_);
  return std::exchange(failed_dirs_, {});
}

std::optional<CompleteCheckpoint> CoordinatorService::TakeHistoryToRecord() {
  absl::MutexLock l(&mu_);
  if (!history_changed_ || !latest_) return std::nullopt;
  history_changed_ = false;
  latest_->manifest.set_restarts(restarts_);
  latest_->manifest.set_rolled_back_steps(rolled_back_steps_);
  return latest_;
}

std::vector<checkpoint::Manifest> CoordinatorService::TakeCompleteCheckpoints() {
  absl::MutexLock l(&mu_);
  return std::exchange(complete_, {});
}

void CoordinatorService::CheckpointWritten(CompleteCheckpoint checkpoint) {
  absl::MutexLock l(&mu_);
  const uint64_t step = checkpoint.manifest.step();
  if (!latest_ || latest_->manifest.step() < step) latest_ = std::move(checkpoint);
  ++checkpoints_written_;
  last_checkpoint_ = std::max(step, last_checkpoint_.value_or(0));
  if (stop_step_ && *stop_step_ == step) StoppedLocked();
}

void CoordinatorService::RequestStop(const std::string& who) {
  absl::MutexLock l(&mu_);
  RequestStopLocked(who);
}

void CoordinatorService::RequestStopLocked(const std::string& who) {
  if (!stop_by_.empty()) return;
  if (state_ != State::kRunning || config_.checkpoint_dir().empty()) {
    if (state_ == State::kRegistering || state_ == State::kRunning) {
      FailLocked(absl::StrCat("stopped by ", who));  // nowhere to save it
    }
    return;
  }
  stop_by_ = who;
  // Long enough to write a checkpoint; within a usual grace period.
  stop_deadline_ = absl::Now() + std::max(absl::Seconds(10), 3 * heartbeat_timeout_);
  std::fprintf(stderr, "coordinator: %s: stopping at the next step boundary, with a checkpoint\n",
               who.c_str());
  MaybeDecideStopLocked();
}

void CoordinatorService::MaybeDecideStopLocked() {
  if (stop_by_.empty() || stop_step_ || state_ != State::kRunning) return;
  std::optional<uint64_t> step;
  for (const Process& w : workers_) {
    if (w.done) continue;  // finished: the job ends as it would have
    if (!w.stop_ack) return;
    step = std::max(step.value_or(0), *w.stop_ack);
  }
  if (!step) return;
  stop_step_ = step;
  std::fprintf(stderr, "coordinator: every worker heard; the job stops after %llu steps\n",
               static_cast<unsigned long long>(*step));
  // Nothing to save before the first step, nor twice.
  if (*step == 0 || (last_checkpoint_ && *last_checkpoint_ == *step)) StoppedLocked();
}

void CoordinatorService::StoppedLocked() {
  if (state_ != State::kRunning) return;
  state_ = State::kStopped;
  ended_ = absl::Now();
  reason_ = *stop_step_ == 0 ? absl::StrCat(stop_by_, " before the first step; nothing to save")
                             : absl::StrCat(stop_by_, "; the checkpoint of step ", *stop_step_,
                                            " is complete: run the job again to resume it");
  std::fprintf(stderr, "coordinator: stopped: %s\n", reason_.c_str());
}

double CoordinatorService::WallSeconds() const {
  absl::MutexLock l(&mu_);
  if (!started_) return 0;
  return absl::ToDoubleSeconds(ended_.value_or(absl::Now()) - *started_);
}

Summary CoordinatorService::MakeSummary() const {
  std::vector<MetricsRow> rows = MetricsRows();
  const double wall_s = WallSeconds();
  absl::MutexLock l(&mu_);
  Summary s;
  s.optimizer = config_.optimizer();
  s.workers = config_.workers();
  s.servers = config_.servers();
  s.params = config_.dim();
  s.steps = config_.steps() > 0 ? config_.steps() : end_step_.value_or(0);
  s.wall_s = wall_s;
  if (resume_) {
    s.resumed_from_step = resume_->manifest.step();
    // The training time before the checkpoint (the workers carry it on).
    if (!prior_rows_.empty()) s.wall_s += prior_rows_.back().wall_s;
  }
  for (const MetricsRow& r : rows) {
    s.bytes_up += r.bytes_up;
    s.bytes_down += r.bytes_down;
    const bool compress = r.phase == "compress";
    (compress ? s.bytes_up_compress : s.bytes_up_warmup) += r.bytes_up;
    (compress ? s.bytes_down_compress : s.bytes_down_warmup) += r.bytes_down;
    s.compress_steps += compress;
    s.rounds += r.bytes_up > 0;
    if (compress && !s.freeze_step) s.freeze_step = r.step;
  }
  const absl::StatusOr<OptimizerKind> kind = ParseOptimizerKind(config_.optimizer());
  s.lr = config_.lr();
  s.freeze = FreezeText(config_);
  s.freeze_checks = freeze_history_;
  if (freeze_.automatic && !s.freeze_step && kind.ok() && HasCompressionPhase(*kind)) {
    // A job meant to compress that ran plain Adam throughout: say why.
    s.freeze_warning =
        freeze_history_.empty()
            ? absl::StrCat("the automatic freeze never fired: no check was decided (one every ",
                           freeze_.window, " steps); the job ran without compression")
            : absl::StrCat("the automatic freeze never fired: the last check, after ",
                           freeze_history_.back().first, " steps, measured ",
                           absl::SixDigits(freeze_history_.back().second), " against tau ",
                           absl::SixDigits(freeze_.tau),
                           "; the job ran without compression (give --freeze_step, a larger tau, "
                           "or the job a fixed --steps, so that the warm-up ends by the latest "
                           "fraction of auto:TAU:K:F)");
  }
  s.error_feedback = config_.error_feedback();
  s.server_reply = config_.server_reply();
  s.v_floor = config_.v_floor();
  s.v_floored = floored_;
  s.workers_agree = state_ == State::kFinished && workers_agree_;
  s.max_replica_master_diff = max_replica_diff_;
  // What a plain fp32 parameter server moves: d floats each way per worker-step.
  const uint64_t fp32 = config_.dim() * sizeof(float) * config_.workers() * rows.size();
  s.bytes_up_fp32 = fp32;
  s.bytes_down_fp32 = fp32;
  if (!rows.empty()) s.final_loss = rows.back().loss;
  s.diverged = loss_watch_.diverged();
  for (const MetricsRow& r : rows) {
    if (r.test_accuracy) {
      s.test_accuracy = r.test_accuracy;
      s.test_loss = r.test_loss;
    }
  }
  s.replicas_equal = state_ == State::kFinished && replicas_equal_;
  s.status = state_ == State::kFinished ? "ok" : absl::StrCat(StateName(state_), ": ", reason_);
  s.stopped_at_step = state_ == State::kStopped ? stop_step_ : std::nullopt;
  s.restarts = restarts_;
  s.rolled_back_steps = rolled_back_steps_;
  s.rollbacks = rollbacks_;
  s.job_id = absl::StrFormat("%016x", job_id_);
  s.worker_codec = config_.worker_codec();
  s.server_codec = config_.server_codec();
  for (const Process& w : workers_) s.worker_devices.push_back(w.info.device());
  s.checkpoints = checkpoints_written_;
  s.last_checkpoint_step = last_checkpoint_;
  s.checkpoint_errors = checkpoint_errors_;
  s.last_checkpoint_error = last_checkpoint_error_;
  if (!config_.checkpoint_dir().empty()) s.durable = checkpoint_errors_ == 0;
  return s;
}

}  // namespace onebit
