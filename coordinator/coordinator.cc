#include "coordinator/coordinator.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "checkpoint/state_file.h"
#include "job/config.h"
#include "net/control.h"
#include "net/liveness.h"
#include "optim/reference.h"
#include "security/tls.h"

namespace onebit {

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
    : job_id_(job_id),
      security_(std::move(security)),
      heartbeat_timeout_(absl::Milliseconds(config.timeouts().heartbeat_ms())),
      rejoin_timeout_(config.checkpoint().dir().empty()
                          ? absl::ZeroDuration()
                          : absl::Milliseconds(config.timeouts().rejoin_ms())),
      config_(std::move(config)),
      given_(std::move(given)),
      register_deadline_(absl::Now() + register_timeout),
      members_(config_.cluster().servers(), config_.cluster().workers()),
      // The config was validated before the service was made.
      freeze_(FreezeOptionsFromConfig(config_).value_or(FreezeOptions{})) {}

absl::Status CheckResumable(const control::TrainingConfig& config,
                            const CompleteCheckpoint& checkpoint) {
  // The servers' state is saved by global range, and none of these but
  // the number of workers changes a bit of the result (see
  // LoadWorkerStateResized for that one).
  static const std::set<std::string> kMayChange = {
      "servers",          "workers",           "chunk_elems",     "compressed_chunk_elems",
      "data_connections", "data_cipher",       "step_timeout",    "heartbeat_timeout",
      "checkpoint_dir",   "checkpoint_every",  "checkpoint_keep", "resume",
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
  history_.ResumeFrom(std::move(checkpoint), restarts, rolled_back_steps, reached);
  // Processes of the job that outlived its last coordinator must not pass
  // for this forming's.
  members_.NewIncarnation("the coordinator restarted");
  metrics_.Resume(std::move(prior_rows));
}

std::string CoordinatorService::RemedyLocked() const {
  absl::StatusOr<OptimizerOptions> o = OptimizerOptionsFromConfig(config_);
  return o.ok() ? DivergenceRemedy(*o) : "a lower --lr";
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
  return Refuse(rpc, st, kUnauthenticated);
}

grpc::Status CoordinatorService::Refuse(absl::string_view rpc, grpc::Status st, Refusal why) {
  refused_[why].fetch_add(1, std::memory_order_relaxed);
  refusals_.Refused(absl::StrCat("a ", rpc, ": ", st.error_message()));
  return st;
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
  int rank = req->requested_rank();
  if (grpc::Status st = TakeRankLocked(*req, &rank); !st.ok()) {
    return Refuse("Register", st, kRegistration);
  }
  if (grpc::Status st = AdmitLocked(static_cast<uint32_t>(rank), *req); !st.ok()) {
    return Refuse("Register", st, kRegistration);
  }
  const absl::Time deadline = std::min(register_deadline_, absl::FromChrono(ctx->deadline()));
  auto ready = [this]()
                   ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return state_ != State::kRegistering; };
  mu_.AwaitWithDeadline(absl::Condition(&ready), deadline);
  if (state_ == State::kRegistering) {
    return grpc::Status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrCat("the cluster did not form in time; waiting for ", members_.Missing()));
  }
  if (state_ != State::kRunning) {
    return grpc::Status(grpc::StatusCode::ABORTED, absl::StrCat("job failed: ", reason_));
  }
  FillRegisterReplyLocked(static_cast<uint32_t>(rank), *req, reply);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::TakeRankLocked(const control::RegisterRequest& req, int* rank) {
  std::vector<Process>& group = members_.Group(req.role());
  const char* what = req.role() == control::SERVER ? "server" : "worker";
  if (*rank >= static_cast<int>(group.size())) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat(what, " rank ", *rank, " out of range (job has ", group.size(),
                                     " ", what, "s)"));
  }
  if (state_ == State::kRunning && *rank >= 0 && !req.has_rejoin_from()) {
    // A process of this rank started again (its predecessor crashed or was
    // preempted, perhaps before its heartbeats stopped): the job rolls back.
    grpc::Status st;
    if (req.role() == control::WORKER) {
      if (absl::Status c = CheckDeclaredLocked(*rank, req); !c.ok()) {
        st = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(c.message()));
      }
    }
    std::string why_not;
    const std::string why = absl::StrCat(what, " ", *rank, " registered again (restarted)");
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
  if (*rank >= 0 && group[*rank].registered) {
    return grpc::Status(grpc::StatusCode::ALREADY_EXISTS,
                        absl::StrCat(what, " rank ", *rank, " is already registered",
                                     req.has_rejoin_from() ? " (by a restarted process)" : ""));
  }
  for (size_t i = 0; i < group.size() && *rank < 0; ++i) {
    if (!group[i].registered) *rank = static_cast<int>(i);
  }
  if (*rank < 0) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        absl::StrCat("all ", group.size(), " ", what, " ranks are taken"));
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::AdmitLocked(uint32_t rank, const control::RegisterRequest& req) {
  if (req.role() == control::SERVER && req.data_endpoint().empty()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "a server must give its data_endpoint");
  }
  if (req.role() == control::WORKER) {
    absl::Status st = CheckDeclaredLocked(rank, req);
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
  Process& p = members_.Group(req.role())[rank];
  p.registered = true;
  p.info = req;
  if (req.role() == control::WORKER && req.has_rejoin_from()) {
    history_.CountRolledBack(req.rejoin_steps_done(), config_.model().steps());
  }
  p.last_seen = absl::Now();
  p.credential = RandomBytes(16);
  std::fprintf(stderr, "coordinator: %s %u registered (%s)\n",
               req.role() == control::SERVER ? "server" : "worker", rank,
               req.data_endpoint().empty() ? req.host().c_str() : req.data_endpoint().c_str());
  if (members_.AllRegistered()) formed_ ? ReformLocked() : FormLocked();
  return grpc::Status::OK;
}

void CoordinatorService::FillRegisterReplyLocked(uint32_t rank, const control::RegisterRequest& req,
                                                 control::RegisterReply* reply) const {
  reply->set_job_id(job_id_);
  reply->set_incarnation(members_.incarnation());
  reply->set_rank(rank);
  reply->set_credential(members_.Group(req.role())[rank].credential);
  *reply->mutable_config() = config_;
  reply->set_shard_map(map_.Serialize());
  for (uint64_t e : job_layers_) reply->add_layer_ends(e);
  AddRanges(declared_.decay(), declared_.lr_scale(), reply);
  const std::vector<Process>& servers = members_.servers();
  for (size_t i = 0; i < servers.size(); ++i) {
    control::ServerInfo* s = reply->add_servers();
    s->set_rank(static_cast<uint32_t>(i));
    s->set_data_endpoint(servers[i].info.data_endpoint());
    s->set_curve_public_key(servers[i].info.curve_public_key());
  }
  if (req.role() == control::SERVER) {
    for (const Process& w : members_.workers()) {
      reply->add_worker_curve_keys(w.info.curve_public_key());
    }
  }
  if (const std::optional<CompleteCheckpoint>& resume = history_.resume()) {
    control::ResumePoint* r = reply->mutable_resume();
    r->set_step(resume->manifest.step());
    r->set_dir(resume->dir);
    for (const checkpoint::ManifestFile& f : resume->manifest.files()) {
      if (absl::StartsWith(f.name(), "server-")) r->add_server_files(f.name());
    }
    r->set_workers(resume->manifest.config().cluster().workers());
    for (uint32_t w = 0; w < resume->manifest.config().cluster().workers(); ++w) {
      r->add_worker_files(absl::StrCat("worker-", w, ".state"));
    }
  }
}

absl::Status CoordinatorService::CheckDeclaredLocked(uint32_t rank,
                                                     const control::RegisterRequest& req) {
  return declared_.Check(rank, req, formed_, given_, &config_);
}

void CoordinatorService::FormLocked() {
  if (!declared_.settings().empty()) {
    if (absl::Status st = ApplyDeclaredSettings(declared_.settings(), &given_, &config_);
        !st.ok()) {
      FailLocked(absl::StrCat("the workers' settings: ", st.message()));
      return;
    }
    freeze_.set_options(FreezeOptionsFromConfig(config_).value_or(FreezeOptions{}));
    std::fprintf(stderr, "coordinator: the workers set %s (optimizer %s, lr %g)\n",
                 declared_.SettingsText().c_str(),
                 EnumText(config_.optimizer().algorithm()).c_str(), config_.optimizer().lr());
  }
  // An external model's tensors are the ones its workers declared.
  job_layers_ = declared_.layers();
  if (config_.model().name() != kExternalModel) {
    absl::StatusOr<std::vector<uint64_t>> ends = ModelLayerEnds(config_);
    if (!ends.ok()) {
      FailLocked(absl::StrCat("the model's tensors: ", ends.status().message()));
      return;
    }
    job_layers_ = *ends;
  }
  auto map = ShardMapForConfig(config_, job_layers_);
  if (!map.ok()) {
    FailLocked(
        absl::StrCat("cannot shard d = ", config_.model().dim(), ": ", map.status().message()));
    return;
  }
  if (absl::Status st = ValidateDecayRanges(declared_.decay(), config_.model().dim()); !st.ok()) {
    FailLocked(absl::StrCat("the workers' weight-decay ranges ", DecayRangesText(declared_.decay()),
                            ": ", st.message()));
    return;
  }
  if (absl::Status st = ValidateLrScaleRanges(declared_.lr_scale(), config_.model().dim());
      !st.ok()) {
    FailLocked(absl::StrCat("the workers' lr-scale ranges ",
                            LrScaleRangesText(declared_.lr_scale()), ": ", st.message()));
    return;
  }
  if (const std::optional<CompleteCheckpoint>& resume = history_.resume()) {
    const checkpoint::Manifest& m = resume->manifest;
    if (absl::Status st = CheckResumable(config_, *resume); !st.ok()) {
      FailLocked(std::string(st.message()));
      return;
    }
    // The steps before the checkpoint are done: their rows, their
    // checkpoints and their --freeze auto decisions.
    metrics_.SkipTo(m.step());
    checkpoints_.ResumeAt(m.step());
    freeze_.ResumeAt(m.freeze_decided(), m.freeze_step());
    bool live = false;  // processes that outlived the coordinator before this one
    for (auto* g : {&members_.servers(), &members_.workers()}) {
      for (Process& q : *g) {
        q.step = m.step();
        live |= q.info.has_rejoin_from();
      }
    }
    if (live) history_.CountLiveRejoin();
    std::fprintf(stderr, "coordinator: resuming from the checkpoint of step %llu in %s\n",
                 static_cast<unsigned long long>(m.step()), resume->dir.c_str());
  }
  map_ = *std::move(map);
  state_ = State::kRunning;
  formed_ = true;
  const absl::Time now = absl::Now();
  started_ = now;
  members_.SeenAllAt(now);
  std::fprintf(stderr,
               "coordinator: all %u servers and %u workers registered; running (d = %llu)\n",
               config_.cluster().servers(), config_.cluster().workers(),
               static_cast<unsigned long long>(config_.model().dim()));
}

bool CoordinatorService::RollBackLocked(const std::string& why, std::string* why_not) {
  const std::optional<CompleteCheckpoint>& target = history_.latest();
  if (state_ != State::kRunning) {
    *why_not = absl::StrCat("the job is ", StateName(state_));
  } else if (config_.checkpoint().dir().empty()) {
    *why_not = "it has no --checkpoint_dir to roll back to";
  } else if (rejoin_timeout_ == absl::ZeroDuration()) {
    *why_not = "--rejoin_timeout is 0";
  } else if (!target) {
    *why_not = "no checkpoint is complete yet to roll back to";
  } else if (stop_.stopping()) {
    *why_not = absl::StrCat("the job is stopping (", stop_.by(), ")");
  } else if (std::optional<uint32_t> w = members_.FinishedWorker()) {
    *why_not = absl::StrCat("worker ", *w, " has finished and left");
  }
  if (!why_not->empty()) return false;
  const uint64_t step = target->manifest.step();
  const uint64_t decided = target->manifest.freeze_decided();
  const uint64_t freeze_step = target->manifest.freeze_step();
  // The heartbeats' steps may be up to a heartbeat old: the workers that
  // register again report how far they really got (JobHistory::CountRolledBack).
  const uint64_t reached = members_.FurthestWorkerStep(step);
  history_.RollBack(reached);
  members_.NewIncarnation(why);
  state_ = State::kRegistering;
  register_deadline_ = absl::Now() + rejoin_timeout_;
  members_.ExpectRejoin(step);
  // The rows written to metrics.csv stay (the steps run again reproduce
  // them bit for bit); partial ones are reported again.
  metrics_.DropUntaken();
  checkpoints_.DropPending(metrics_.taken());
  freeze_.RollBackTo(decided, freeze_step);
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
  members_.SeenAllAt(absl::Now());
  std::fprintf(stderr,
               "coordinator: every process registered again; the job continues from step %llu\n",
               static_cast<unsigned long long>(history_.resume()->manifest.step()));
}

void CoordinatorService::ReplyToStrangerLocked(control::HeartbeatReply* reply) const {
  if (state_ == State::kRegistering || state_ == State::kRunning) {
    const std::optional<CompleteCheckpoint>& resume = history_.resume();
    reply->set_command(control::REJOIN);
    reply->set_reason(absl::StrCat(
        members_.rejoin_why().empty() ? std::string("the job formed again without this process")
                                      : members_.rejoin_why(),
        resume ? absl::StrCat("; rolling back to the checkpoint of step ", resume->manifest.step())
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
  if (!members_.IsRegistered(role, rank)) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("unknown process ", Membership::Name(role, rank)));
  }
  return grpc::Status::OK;
}

void CoordinatorService::AddMetricsLocked(uint32_t rank, const control::StepMetrics& m,
                                          uint64_t steps_done) {
  if (std::optional<std::string> refused =
          metrics_.Add(rank, m, steps_done, config_.model().steps(), members_.workers().size())) {
    refused_[kMalformed].fetch_add(1, std::memory_order_relaxed);
    refusals_.Refused(*refused);
  }
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext* ctx,
                                           const control::HeartbeatRequest* req,
                                           control::HeartbeatReply* reply) {
  if (grpc::Status st = Authenticate(ctx, "Heartbeat"); !st.ok()) return st;
  absl::MutexLock l(&mu_);
  if (req->job_id() == job_id_ &&
      (req->role() == control::SERVER || req->role() == control::WORKER) &&
      req->rank() < members_.Group(req->role()).size() &&
      (!members_.IsOwner(req->role(), req->rank(), req->credential()) ||
       req->incarnation() != members_.incarnation())) {
    // Of this job, but not of this forming of it (or not the process that
    // holds the rank): nothing it says counts.
    ReplyToStrangerLocked(reply);
    return grpc::Status::OK;
  }
  grpc::Status st = CheckJob(req->role(), req->rank(), req->job_id());
  if (!st.ok()) return Refuse("Heartbeat", st);
  if (config_.model().steps() > 0 && req->step() > config_.model().steps()) {
    return Refuse("Heartbeat", grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                            absl::StrCat(Membership::Name(req->role(), req->rank()),
                                                         " at step ", req->step(), " of a job of ",
                                                         config_.model().steps(), " steps")));
  }
  std::vector<Process>& peers = members_.Group(Membership::PeerRole(req->role()));
  if (req->heard_size() > static_cast<int>(peers.size())) {
    return Refuse("Heartbeat",
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat(Membership::Name(req->role(), req->rank()),
                                            " heard from ", req->heard_size(), " ",
                                            Membership::RoleName(Membership::PeerRole(req->role())),
                                            "s in a job of ", peers.size())));
  }
  for (uint32_t r : req->heard()) {
    if (r >= peers.size()) {
      return Refuse(
          "Heartbeat",
          grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                       absl::StrCat(Membership::Name(req->role(), req->rank()), " heard from ",
                                    Membership::Name(Membership::PeerRole(req->role()), r),
                                    " in a job of ", peers.size())));
    }
  }
  Process& p = members_.Group(req->role())[req->rank()];
  // What this process heard came after it sent its previous heartbeat; that
  // heartbeat's arrival dates the news, late by at most its transit.
  for (uint32_t r : req->heard()) peers[r].heard_at = std::max(peers[r].heard_at, p.last_seen);
  p.last_seen = absl::Now();
  p.step = req->step();
  if (req->role() == control::WORKER) {
    // A row for a step the worker has not run would be made up.
    for (const auto& m : req->metrics()) AddMetricsLocked(req->rank(), m, req->step());
  } else {
    for (const auto& c : req->freeze_checks())
      freeze_.Add(req->rank(), c, map_, config_.model().steps());
  }
  for (const auto& c : req->checkpoint_parts())
    AddCheckpointPartLocked(req->role(), req->rank(), c);
  if (!req->stop_requested().empty()) {
    RequestStopLocked(
        absl::StrCat(req->stop_requested(), " to ", Membership::Name(req->role(), req->rank())));
  }
  if (req->role() == control::WORKER && req->has_stop_ack()) p.stop_ack = req->stop_ack();
  MaybeDecideStopLocked();
  reply->set_stopping(stop_.stopping());
  if (stop_.step()) reply->set_stop_step(*stop_.step());
  reply->set_freeze_decided(freeze_.decided());
  reply->set_freeze_step(freeze_.step());
  if (end_step_) reply->set_end_step(*end_step_);
  if (!req->error().empty()) {
    p.reported_error = true;
    FailLocked(absl::StrCat(Membership::Name(req->role(), req->rank()), " failed: ", req->error()));
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

grpc::Status CoordinatorService::Done(grpc::ServerContext* ctx, const control::DoneRequest* req,
                                      control::DoneReply*) {
  if (grpc::Status st = Authenticate(ctx, "Done"); !st.ok()) return st;
  absl::MutexLock l(&mu_);
  grpc::Status st = CheckJob(req->role(), req->rank(), req->job_id());
  if (!st.ok()) return Refuse("Done", st);
  if (!members_.IsOwner(req->role(), req->rank(), req->credential())) {
    return Refuse("Done",
                  grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                               absl::StrCat("Done for ", Membership::Name(req->role(), req->rank()),
                                            " without its credential")));
  }
  if (req->incarnation() != members_.incarnation()) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("Done of an earlier incarnation of the job (",
                                     members_.rejoin_why(), "): register again"));
  }
  // On a loaded host the answer to a counted Done can miss the caller's
  // deadline, and it asks again: once the job has finished (with it), it is
  // told so rather than refused.
  if (state_ == State::kFinished && members_.Group(req->role())[req->rank()].done) {
    return grpc::Status::OK;
  }
  if (state_ != State::kRunning) {
    return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                        absl::StrCat("job is ", StateName(state_), ": ", reason_));
  }
  if (absl::Status c = CheckCoverageLocked(*req); !c.ok()) {
    return Refuse("Done",
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(c.message())));
  }
  if (config_.model().steps() > 0 && req->steps() > config_.model().steps()) {
    return Refuse("Done",
                  grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                               absl::StrCat("Done after ", req->steps(), " steps of a job of ",
                                            config_.model().steps())));
  }
  Process& p = members_.Group(req->role())[req->rank()];
  p.last_seen = absl::Now();
  p.done = true;
  p.checksums.assign(req->checksums().begin(), req->checksums().end());
  if (req->role() == control::WORKER) {
    p.step = req->steps() > 0 ? req->steps() : config_.model().steps();
    for (const auto& m : req->metrics()) AddMetricsLocked(req->rank(), m, p.step);
    if (config_.model().steps() > 0 && p.step != config_.model().steps()) {
      FailLocked(absl::StrCat("worker ", req->rank(), " finished after ", p.step,
                              " steps; the job has ", config_.model().steps()));
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
      return absl::InvalidArgumentError(absl::StrCat(
          "Done of ", Membership::Name(req.role(), req.rank()), ": a checksum of shard ", c.shard(),
          " [", c.begin(), ", ", c.end(), ") that is not ",
          req.role() == control::WORKER ? "a shard of the job's map, once"
                                        : "this server's own shard"));
    }
  }
  for (uint32_t k = 0; k < shards; ++k) {
    if ((req.role() == control::WORKER || k == req.rank()) && seen[k] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Done of ", Membership::Name(req.role(), req.rank()), ": no checksum of shard ", k));
    }
  }
  return absl::OkStatus();
}

void CoordinatorService::MaybeFinishLocked() {
  if (state_ != State::kRunning) return;
  const std::vector<Process>& workers = members_.workers();
  if (config_.model().steps() == 0 && !end_step_) {
    // The workers' program decided the length: the servers finish where
    // every worker did, so all must agree.
    for (const Process& w : workers) {
      if (!w.done) return;
    }
    for (uint32_t w = 1; w < workers.size(); ++w) {
      if (workers[w].step != workers[0].step) {
        FailLocked(
            absl::StrCat("the workers finished after different numbers of steps: worker 0 "
                         "after ",
                         workers[0].step, ", worker ", w, " after ", workers[w].step));
        return;
      }
    }
    end_step_ = workers[0].step;
    std::fprintf(stderr, "coordinator: every worker finished after %llu steps\n",
                 static_cast<unsigned long long>(*end_step_));
  }
  const std::vector<Process>& servers = members_.servers();
  for (const auto* g : {&servers, &workers}) {
    for (const Process& p : *g) {
      if (!p.done) return;
    }
  }
  // Every worker's checksum of each shard range must match that shard's
  // master; under --server-reply delta, the server's mirror of the replica.
  verdict_ = CompareReplicas(servers, workers);
  state_ = State::kFinished;
  ended_ = absl::Now();
  std::fprintf(stderr, "coordinator: all processes done; replicas_equal=%s\n",
               verdict_.replicas_equal ? "true" : "false");
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
    const std::vector<Process>& group = members_.Group(role);
    for (size_t i = 0; i < group.size(); ++i) {
      const Process& p = group[i];
      control::ProcessStatus* s = reply->add_processes();
      s->set_role(role);
      s->set_rank(static_cast<uint32_t>(i));
      s->set_data_endpoint(p.info.data_endpoint());
      s->set_health_endpoint(p.info.health_endpoint());
      s->set_step(p.step);
      s->set_since_heartbeat_s(p.registered ? absl::ToDoubleSeconds(now - p.last_seen) : -1);
      s->set_since_heard_s(
          p.heard_at == absl::InfinitePast() ? -1 : absl::ToDoubleSeconds(now - p.heard_at));
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
  const std::vector<Liveness> answers = ProbeListening(endpoints, ProbeTimeout());
  absl::MutexLock l(&mu_);
  const absl::Time now = absl::Now();
  for (size_t i = 0; i < suspects.size(); ++i) {
    std::vector<Process>& group = members_.Group(suspects[i].role);
    if (suspects[i].rank >= group.size()) continue;
    Process& p = group[suspects[i].rank];
    if (p.credential != suspects[i].credential || p.lost) continue;  // since replaced or lost
    p.answered_at = now;
    p.answer = answers[i];
    if (answers[i] == Liveness::kListening) p.listening_at = now;
  }
  // The verdict now, on answers just taken: a starved coordinator's next
  // tick may come later than an answer stays fresh.
  CheckTimeoutsLocked(nullptr);
}

void CoordinatorService::CheckTimeoutsLocked(std::vector<Suspect>* suspects) {
  const absl::Time now = absl::Now();
  if (state_ == State::kRegistering && now > register_deadline_) {
    if (formed_) {
      FailLocked(absl::StrCat(members_.rejoin_why(), "; rolled back to the checkpoint of step ",
                              history_.resume()->manifest.step(), ", but ", members_.Missing(),
                              " did not register again within ",
                              absl::FormatDuration(rejoin_timeout_)));
    } else {
      FailLocked(absl::StrCat("registration timed out; still waiting for ", members_.Missing()));
    }
    return;
  }
  if (state_ != State::kRunning) return;
  if (stop_.Overdue(now)) {
    FailLocked(stop_.OverdueReason());
    return;
  }
  // A probe answers for a short while: a process found listening within
  // half the timeout counts as alive.
  const absl::Duration fresh = heartbeat_timeout_ / 2;
  const absl::Duration slow_limit = kSlowFactor * heartbeat_timeout_;
  for (control::Role role : {control::SERVER, control::WORKER}) {
    std::vector<Process>& group = members_.Group(role);
    for (size_t i = 0; i < group.size(); ++i) {
      Process& p = group[i];
      if (role == control::WORKER && p.done) continue;  // done workers exit
      // A peer that heard from it in the data plane since is as good as a
      // heartbeat: it works, and only its heartbeats are late.
      const absl::Time seen = std::max(p.last_seen, p.heard_at);
      const absl::Duration silent = now - seen;
      const std::string name = Membership::Name(role, static_cast<uint32_t>(i));
      const char* peers = Membership::RoleName(Membership::PeerRole(role));
      if (now - p.last_seen <= fresh) {
        p.heard_said = false;  // its heartbeats come again; say it if they stop again
      } else if (now - p.last_seen > heartbeat_timeout_ && silent <= heartbeat_timeout_ &&
                 !p.heard_said) {
        p.heard_said = true;
        std::fprintf(stderr,
                     "coordinator: %s sent no heartbeat for %s, but its %ss still hear from it in "
                     "the data plane: working, its heartbeats late\n",
                     name.c_str(), absl::FormatDuration(heartbeat_timeout_).c_str(), peers);
      }
      if (silent <= fresh) {
        p.slow_said = false;
        continue;
      }
      const std::string ep =
          p.info.data_endpoint().empty() ? p.info.host() : p.info.data_endpoint();
      // Its last answer since it went quiet (fresh unless `unprobed`).
      const bool listening = p.answered_at > seen && p.listening_at == p.answered_at;
      // No verdict on a process with an endpoint before a probe has answered
      // since it went quiet, nor on an answer gone stale (a starved
      // coordinator may not have probed it, or in time); the slow bound
      // still holds.
      const bool unprobed = !p.info.health_endpoint().empty() &&
                            (p.answered_at < seen + fresh || now - p.answered_at > fresh);
      if (silent > heartbeat_timeout_ && unprobed && silent <= slow_limit) {
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
        // Whose silence: its heartbeats', or theirs and its peers' news of it.
        const std::string silence =
            p.heard_at > p.last_seen
                ? absl::StrCat(" sent no heartbeat, nor did its ", peers, "s hear from it, for ")
                : std::string(" sent no heartbeat for ");
        // What the probe found, so that the verdict names its evidence.
        std::string probe;
        if (!listening && p.answered_at > seen) {
          probe = p.answer == Liveness::kGone
                      ? absl::StrCat(", and its health endpoint ", p.info.health_endpoint(),
                                     " refused a connection (gone)")
                      : absl::StrCat(", and its health endpoint ", p.info.health_endpoint(),
                                     " took no connection within ",
                                     absl::FormatDuration(ProbeTimeout()));
        }
        LoseLocked(listening ? absl::StrCat(name, " (", ep, ")", silence,
                                            absl::FormatDuration(slow_limit),
                                            ", although it still listens at its health endpoint "
                                            "(hung?)")
                             : absl::StrCat(name, " (", ep, ")", silence,
                                            absl::FormatDuration(heartbeat_timeout_), probe));
        return;
      }
      // Probe it again every tenth of the timeout while it is silent.
      if (suspects != nullptr && !p.info.health_endpoint().empty() &&
          (now - p.probed_at >= heartbeat_timeout_ / 10 ||
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
  return members_.EveryoneTold();
}

bool CoordinatorService::WorkersReportedLastMetrics() const {
  absl::MutexLock l(&mu_);
  return state_ != State::kFailed || members_.WorkersSilent();
}

std::vector<MetricsRow> CoordinatorService::MetricsRows() const {
  absl::MutexLock l(&mu_);
  return metrics_.Rows(members_.workers().size());
}

std::vector<MetricsRow> CoordinatorService::TakeNewRows() {
  absl::MutexLock l(&mu_);
  return metrics_.TakeNew(members_.workers().size(),
                          [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return RemedyLocked(); });
}

void CoordinatorService::AddCheckpointPartLocked(control::Role role, uint32_t rank,
                                                 const control::CheckpointPart& part) {
  // A server with an empty shard runs no steps and saves nothing.
  size_t expected = members_.workers().size();
  for (uint32_t k = 0; k < map_.num_shards(); ++k) expected += map_.shard(k).size() > 0;
  std::optional<std::string> error = checkpoints_.AddPart(
      Membership::Name(role, rank), part, config_.checkpoint().every(), stop_.step(), expected,
      [this](uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return ManifestLocked(step); });
  if (error) CheckpointFailedLocked(part.step(), *error);
}

checkpoint::Manifest CoordinatorService::ManifestLocked(uint64_t step) const {
  checkpoint::Manifest m;
  m.set_format(kCheckpointFormat);
  m.set_step(step);
  m.set_job_id(absl::StrFormat("%016x", job_id_));
  *m.mutable_config() = config_;
  m.set_shard_map(map_.Serialize());
  m.set_restarts(history_.restarts());
  m.set_rolled_back_steps(history_.rolled_back_steps());
  // --freeze auto as of `step`.
  freeze_.Record(step, &m);
  return m;
}

void CoordinatorService::CheckpointFailed(uint64_t step, const std::string& error) {
  absl::MutexLock l(&mu_);
  CheckpointFailedLocked(step, error);
}

void CoordinatorService::CheckpointFailedLocked(uint64_t step, const std::string& error) {
  checkpoints_.Failed(step, error);
  const bool fail = config_.checkpoint().on_failure() == control::CHECKPOINT_FAILURE_FAIL;
  const std::optional<uint64_t> last = checkpoints_.last_written();
  std::fprintf(
      stderr, "coordinator: the checkpoint of step %llu failed: %s; %s\n",
      static_cast<unsigned long long>(step), error.c_str(),
      fail ? "the job fails (--checkpoint_failure=fail)"
           : absl::StrCat("the job goes on without it, not durable (",
                          last ? absl::StrCat("the last complete checkpoint is of step ", *last)
                               : std::string("no checkpoint is complete"),
                          ")")
                 .c_str());
  if (stop_.step() && *stop_.step() == step) {
    // Nothing to stop at: the job cannot be resumed from here.
    FailLocked(absl::StrCat("stopped by ", stop_.by(), ", but the checkpoint to stop at (step ",
                            step, ") could not be written: ", error));
  } else if (fail) {
    FailLocked(absl::StrCat("the checkpoint of step ", step, " could not be written: ", error,
                            " (--checkpoint_failure=fail)"));
  }
}

std::vector<uint64_t> CoordinatorService::TakeFailedCheckpoints() {
  absl::MutexLock l(&mu_);
  return checkpoints_.TakeFailed();
}

std::optional<CompleteCheckpoint> CoordinatorService::TakeHistoryToRecord() {
  absl::MutexLock l(&mu_);
  return history_.TakeToRecord();
}

std::vector<checkpoint::Manifest> CoordinatorService::TakeCompleteCheckpoints() {
  absl::MutexLock l(&mu_);
  return checkpoints_.TakeComplete(metrics_.taken());
}

void CoordinatorService::CheckpointWritten(CompleteCheckpoint checkpoint) {
  absl::MutexLock l(&mu_);
  const uint64_t step = checkpoint.manifest.step();
  history_.Written(std::move(checkpoint));
  checkpoints_.Written(step);
  if (stop_.step() && *stop_.step() == step) StoppedLocked();
}

void CoordinatorService::RequestStop(const std::string& who) {
  absl::MutexLock l(&mu_);
  RequestStopLocked(who);
}

void CoordinatorService::RequestStopLocked(const std::string& who) {
  if (stop_.stopping()) return;
  if (state_ != State::kRunning || config_.checkpoint().dir().empty()) {
    if (state_ == State::kRegistering || state_ == State::kRunning) {
      FailLocked(absl::StrCat("stopped by ", who));  // nowhere to save it
    }
    return;
  }
  // Long enough to write a checkpoint; within a usual grace period.
  stop_.Begin(who, absl::Now() + std::max(absl::Seconds(10), 3 * heartbeat_timeout_));
  std::fprintf(stderr, "coordinator: %s: stopping at the next step boundary, with a checkpoint\n",
               who.c_str());
  MaybeDecideStopLocked();
}

void CoordinatorService::MaybeDecideStopLocked() {
  if (state_ != State::kRunning || !stop_.Decide(members_.workers())) return;
  // Nothing to save before the first step, nor twice.
  const uint64_t step = *stop_.step();
  const std::optional<uint64_t> last = checkpoints_.last_written();
  if (step == 0 || (last && *last == step)) StoppedLocked();
}

void CoordinatorService::StoppedLocked() {
  if (state_ != State::kRunning) return;
  state_ = State::kStopped;
  ended_ = absl::Now();
  reason_ = stop_.StoppedReason();
  std::fprintf(stderr, "coordinator: stopped: %s\n", reason_.c_str());
}

double CoordinatorService::WallSeconds() const {
  absl::MutexLock l(&mu_);
  if (!started_) return 0;
  return absl::ToDoubleSeconds(ended_.value_or(absl::Now()) - *started_);
}

run::Summary CoordinatorService::MakeSummary() const {
  std::vector<MetricsRow> rows = MetricsRows();
  const double wall_s = WallSeconds();
  absl::MutexLock l(&mu_);
  run::Summary s;
  s.set_optimizer(EnumText(config_.optimizer().algorithm()));
  s.set_workers(config_.cluster().workers());
  s.set_servers(config_.cluster().servers());
  s.set_params(config_.model().dim());
  s.set_steps(config_.model().steps() > 0 ? config_.model().steps() : end_step_.value_or(0));
  s.set_wall_s(wall_s);
  if (const std::optional<CompleteCheckpoint>& resume = history_.resume()) {
    s.set_resumed_from_step(resume->manifest.step());
    // The training time before the checkpoint (the workers carry it on).
    if (!metrics_.prior_rows().empty()) {
      s.set_wall_s(s.wall_s() + metrics_.prior_rows().back().wall_s);
    }
  }
  for (const MetricsRow& r : rows) {
    s.set_bytes_up(s.bytes_up() + r.bytes_up);
    s.set_bytes_down(s.bytes_down() + r.bytes_down);
    if (r.phase == "compress") {
      s.set_bytes_up_compress(s.bytes_up_compress() + r.bytes_up);
      s.set_bytes_down_compress(s.bytes_down_compress() + r.bytes_down);
      s.set_compress_steps(s.compress_steps() + 1);
      if (!s.has_freeze_step()) s.set_freeze_step(r.step);
    } else {
      s.set_bytes_up_warmup(s.bytes_up_warmup() + r.bytes_up);
      s.set_bytes_down_warmup(s.bytes_down_warmup() + r.bytes_down);
    }
    if (r.bytes_up > 0) s.set_rounds(s.rounds() + 1);
  }
  const absl::StatusOr<OptimizerKind> kind =
      ParseOptimizerKind(EnumText(config_.optimizer().algorithm()));
  s.set_lr(config_.optimizer().lr());
  s.set_freeze(FreezeText(config_));
  for (const auto& [after, change] : freeze_.history()) {
    google::protobuf::ListValue* check = s.add_freeze_checks();
    check->add_values()->set_number_value(static_cast<double>(after));
    if (std::isfinite(change)) {
      check->add_values()->set_number_value(change);
    } else {
      check->add_values()->set_null_value(google::protobuf::NULL_VALUE);
    }
  }
  if (freeze_.options().automatic && !s.has_freeze_step() && kind.ok() &&
      HasCompressionPhase(*kind)) {
    // A job meant to compress that ran plain Adam throughout: say why.
    s.set_freeze_warning(freeze_.NeverFiredWarning());
  }
  s.set_error_feedback(EnumText(config_.compression().error_feedback()));
  s.set_server_reply(EnumText(config_.compression().server_reply()));
  s.set_v_floor(config_.optimizer().v_floor());
  s.set_v_floored(verdict_.floored);
  s.set_workers_agree(state_ == State::kFinished && verdict_.workers_agree);
  if (verdict_.max_replica_diff) s.set_max_replica_master_diff(*verdict_.max_replica_diff);
  // What a plain fp32 parameter server moves: d floats each way per worker-step.
  const uint64_t fp32 =
      config_.model().dim() * sizeof(float) * config_.cluster().workers() * rows.size();
  s.set_bytes_up_fp32(fp32);
  s.set_bytes_down_fp32(fp32);
  if (!rows.empty()) s.set_final_loss(rows.back().loss);
  s.set_diverged(metrics_.diverged());
  for (const MetricsRow& r : rows) {
    if (!r.test_accuracy) continue;
    s.set_test_accuracy(*r.test_accuracy);
    if (r.test_loss) {
      s.set_test_loss(*r.test_loss);
    } else {
      s.clear_test_loss();
    }
  }
  s.set_replicas_equal(state_ == State::kFinished && verdict_.replicas_equal);
  s.set_status(state_ == State::kFinished ? "ok" : absl::StrCat(StateName(state_), ": ", reason_));
  if (state_ == State::kStopped && stop_.step()) s.set_stopped_at_step(*stop_.step());
  s.set_restarts(history_.restarts());
  s.set_rolled_back_steps(history_.rolled_back_steps());
  s.set_rollbacks(history_.rollbacks());
  s.set_job_id(absl::StrFormat("%016x", job_id_));
  s.set_worker_codec(EnumText(config_.compression().worker_codec()));
  s.set_server_codec(EnumText(config_.compression().server_codec()));
  for (const Process& w : members_.workers()) s.add_worker_devices(w.info.device());
  s.set_checkpoints(checkpoints_.written());
  if (checkpoints_.last_written()) s.set_last_checkpoint_step(*checkpoints_.last_written());
  s.set_checkpoint_errors(checkpoints_.errors());
  if (!checkpoints_.last_error().empty()) s.set_last_checkpoint_error(checkpoints_.last_error());
  if (!config_.checkpoint().dir().empty()) s.set_durable(checkpoints_.errors() == 0);
  return s;
}

JobState CoordinatorService::Progress() const {
  absl::MutexLock l(&mu_);
  JobState s;
  s.workers_expected = config_.cluster().workers();
  s.servers_expected = config_.cluster().servers();
  auto alive = [](const Process& p) { return p.registered && !p.done && !p.lost; };
  for (const Process& w : members_.workers()) s.workers_alive += alive(w);
  for (const Process& k : members_.servers()) s.servers_alive += alive(k);
  s.restarts = history_.restarts();
  s.rollbacks = history_.rollbacks();
  s.rolled_back_steps = history_.rolled_back_steps();
  s.checkpoints = checkpoints_.written();
  s.checkpoint_errors = checkpoints_.errors();
  s.last_checkpoint_step = checkpoints_.last_written();
  if (!freeze_.history().empty()) s.freeze_change = freeze_.history().back().second;
  s.finished = state_ == State::kFinished || state_ == State::kFailed || state_ == State::kStopped;
  s.fp32_bytes_per_step = config_.model().dim() * sizeof(float) * config_.cluster().workers();
  s.refused_unauthenticated = refused_[kUnauthenticated].load(std::memory_order_relaxed);
  s.refused_malformed = refused_[kMalformed].load(std::memory_order_relaxed);
  s.refused_registration = refused_[kRegistration].load(std::memory_order_relaxed);
  s.failed_handshakes = FailedTlsHandshakes();
  return s;
}

}  // namespace onebit
