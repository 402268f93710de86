#include "net/control.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "net/liveness.h"
#include "security/tls.h"
#include "util/stop_signal.h"

namespace onebit {

namespace {

// How long one heartbeat (or error report) may take to be answered, at
// least; a longer heartbeat timeout gives it as long.
constexpr absl::Duration kHeartbeatDeadline = absl::Seconds(2);

grpc::ChannelArguments ChannelArgs() {
  grpc::ChannelArguments args;
  // Fail fast and retry ourselves; gRPC's reconnect back-off would otherwise
  // stretch to seconds while the coordinator is still starting.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 50);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
  return args;
}

}  // namespace

std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target, const Security& security) {
  return ControlChannel(target, security, ChannelArgs());
}

std::shared_ptr<grpc::Channel> MakeHealthChannel(const std::string& target) {
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), ChannelArgs());
}

absl::Status RpcError(absl::string_view what, const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

std::string Hostname() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof(buf) - 1) != 0) return "localhost";
  return buf;
}

absl::Status CheckTimeout(absl::Duration timeout) {
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("must be > 0");
  if (timeout == absl::InfiniteDuration()) return absl::InvalidArgumentError("must be finite");
  return absl::OkStatus();
}

absl::StatusOr<control::RegisterReply> RegisterWithCoordinator(
    control::Coordinator::Stub* stub, const std::string& target,
    const control::RegisterRequest& request, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  grpc::Status last;
  while (absl::Now() < deadline) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(true);  // the coordinator may not be listening yet
    control::RegisterReply reply;
    last = stub->Register(&ctx, request, &reply);
    if (last.ok()) return reply;
    if (last.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  // The coordinator answered: its reason, not a timeout.
  if (last.error_code() != grpc::StatusCode::UNAVAILABLE &&
      last.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED && !last.ok()) {
    return RpcError(absl::StrCat("the coordinator at ", target, " refused the registration"), last);
  }
  return absl::DeadlineExceededError(absl::StrCat("registering with the coordinator at ", target,
                                                  " failed within ", absl::FormatDuration(timeout),
                                                  ": ", last.error_message()));
}

std::vector<DecayRange> DecayRangesOf(
    const google::protobuf::RepeatedPtrField<control::WeightDecayRange>& ranges) {
  std::vector<DecayRange> out;
  for (const auto& r : ranges) {
    out.push_back(DecayRange{r.begin(), r.end(), r.weight_decay()});
  }
  return out;
}

std::vector<LrScaleRange> LrScaleRangesOf(
    const google::protobuf::RepeatedPtrField<control::LrScaleRange>& ranges) {
  std::vector<LrScaleRange> out;
  for (const auto& r : ranges) out.push_back(LrScaleRange{r.begin(), r.end(), r.lr_scale()});
  return out;
}

absl::Duration RejoinWait(const control::TrainingConfig& cfg) {
  if (cfg.checkpoint().dir().empty()) return absl::ZeroDuration();
  return absl::Milliseconds(cfg.timeouts().rejoin_ms());
}

absl::Duration HeartbeatInterval(const control::TrainingConfig& config) {
  const absl::Duration timeout = absl::Milliseconds(config.timeouts().heartbeat_ms());
  const absl::Duration base = std::clamp(timeout / 10, absl::Milliseconds(20), absl::Seconds(1));
  // The coordinator answers every process: at most kMaxHeartbeatsPerSecond
  // in all, so that its work does not grow with N; still three beats per
  // timeout.
  const double processes =
      static_cast<double>(config.cluster().servers()) + config.cluster().workers();
  const absl::Duration spread = absl::Seconds(processes / kMaxHeartbeatsPerSecond);
  return std::min(std::max(base, spread), std::max(base, timeout / 3));
}

std::unique_ptr<Heartbeater> MakeHeartbeater(control::Coordinator::Stub* stub,
                                             const std::string& target, control::Role role,
                                             const control::RegisterReply& reg) {
  const absl::Duration timeout = absl::Milliseconds(reg.config().timeouts().heartbeat_ms());
  auto hb = std::make_unique<Heartbeater>(stub, target, role, reg.rank(), reg.job_id(),
                                          HeartbeatInterval(reg.config()), timeout);
  hb->SetIncarnation(reg.incarnation());
  hb->SetCredential(reg.credential());
  hb->WaitForLostCoordinator(RejoinWait(reg.config()));
  return hb;
}

Heartbeater::Heartbeater(control::Coordinator::Stub* stub, std::string target, control::Role role,
                         uint32_t rank, uint64_t job_id, absl::Duration interval,
                         absl::Duration coordinator_timeout)
    : stub_(stub),
      target_(std::move(target)),
      role_(role),
      rank_(rank),
      job_id_(job_id),
      interval_(interval),
      coordinator_timeout_(coordinator_timeout),
      call_deadline_(std::max(kHeartbeatDeadline, coordinator_timeout)),
      coordinator_wait_(coordinator_timeout) {}

void Heartbeater::SetIncarnation(uint64_t incarnation) { incarnation_ = incarnation; }

void Heartbeater::SetCredential(std::string credential) { credential_ = std::move(credential); }

void Heartbeater::SetPeersHeard(std::shared_ptr<PeersHeard> peers) {
  peers_heard_ = std::move(peers);
}

void Heartbeater::WaitForLostCoordinator(absl::Duration wait) {
  coordinator_wait_ = std::max(wait, coordinator_timeout_);
}

Heartbeater::~Heartbeater() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
    // A call in flight gets what it got before its deadline grew with the
    // timeout, then is cancelled: a slow coordinator does not hold up exit.
    auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_flight_; };
    mu_.AwaitWithTimeout(absl::Condition(&answered), kHeartbeatDeadline);
    if (in_flight_ && call_ != nullptr) call_->TryCancel();
  }
  if (thread_.joinable()) thread_.join();
}

void Heartbeater::Start() {
  {
    absl::MutexLock l(&mu_);
    last_ok_ = absl::Now();
  }
  thread_ = std::thread([this] { Loop(); });
}

void Heartbeater::SetStep(uint64_t s) {
  absl::MutexLock l(&mu_);
  step_ = s;
}

void Heartbeater::AddMetrics(const control::StepMetrics& m) {
  absl::MutexLock l(&mu_);
  pending_.push_back(m);
}

void Heartbeater::TakeMetricsLocked(google::protobuf::RepeatedPtrField<control::StepMetrics>* out) {
  const size_t n = std::min<size_t>(pending_.size(), kMaxMetricsPerHeartbeat);
  for (size_t i = 0; i < n; ++i) *out->Add() = std::move(pending_[i]);
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<ptrdiff_t>(n));
  if (!pending_.empty()) kick_ = true;  // the rest with the next heartbeat, now
}

control::Command Heartbeater::command() const {
  absl::MutexLock l(&mu_);
  return command_;
}

std::string Heartbeater::reason() const {
  absl::MutexLock l(&mu_);
  return reason_;
}

control::Command Heartbeater::WaitForCommand(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  auto changed = [this]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return command_ != control::CONTINUE; };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
  return command_;
}

void Heartbeater::Loop() {
  absl::Time last_send = absl::InfinitePast();
  while (true) {
    {
      absl::MutexLock l(&mu_);
      // A signal handler cannot kick us: look at its flag often (but while
      // the coordinator does not answer, not more than every 50 ms).
      auto signalled = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_signal_ != nullptr && stop_signal_->load() != 0 && !stop_sent_ &&
               absl::Now() - last_send >= absl::Milliseconds(50);
      };
      auto wake = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || kick_; };
      const absl::Time until = absl::Now() + interval_;
      while (!wake() && !signalled() && absl::Now() < until) {
        mu_.AwaitWithTimeout(
            absl::Condition(&wake),
            stop_signal_ != nullptr ? std::min(interval_, absl::Milliseconds(50)) : interval_);
      }
      if (stop_) return;
      kick_ = false;
    }
    last_send = absl::Now();
    SendOnce();
  }
}

void Heartbeater::WatchStopSignal(const std::atomic<int>* flag) { stop_signal_ = flag; }

std::optional<uint64_t> Heartbeater::stop_step() const {
  absl::MutexLock l(&mu_);
  return stop_step_;
}

Heartbeater::StepGate Heartbeater::BeginStep(uint64_t step, absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  if (!stopping_) {
    begun_ = std::max(begun_, step + 1);
    return StepGate::kGo;
  }
  auto decided = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_step_.has_value() || command_ != control::CONTINUE;
  };
  mu_.AwaitWithTimeout(absl::Condition(&decided), timeout);
  if (!stop_step_ || command_ != control::CONTINUE) return StepGate::kUndecided;
  if (step >= *stop_step_) return StepGate::kStopHere;
  begun_ = std::max(begun_, step + 1);
  return StepGate::kGo;
}

void Heartbeater::SendOnce() {
  control::HeartbeatRequest req;
  req.set_role(role_);
  req.set_rank(rank_);
  req.set_job_id(job_id_);
  req.set_incarnation(incarnation_);
  req.set_credential(credential_);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + call_deadline_));
  {
    absl::MutexLock l(&mu_);
    req.set_step(step_);
    TakeMetricsLocked(req.mutable_metrics());
    for (auto& c : checks_) *req.add_freeze_checks() = c;
    checks_.clear();
    for (auto& c : parts_) *req.add_checkpoint_parts() = c;
    parts_.clear();
    if (stop_signal_ != nullptr && stop_signal_->load() != 0) {
      req.set_stop_requested(SignalName(stop_signal_->load()));
    }
    if (stop_ack_) req.set_stop_ack(*stop_ack_);
    if (peers_heard_ != nullptr) {
      for (uint32_t r : peers_heard_->Take()) req.add_heard(r);
    }
    in_flight_ = true;
    call_ = &ctx;
  }
  control::HeartbeatReply reply;
  grpc::Status s = stub_->Heartbeat(&ctx, req, &reply);
  // A call that ran out of time went out on an open connection: a slow
  // coordinator. A dropped connection is one too if its port still takes
  // connections (net/liveness.h; probed only then: each probe is a refused
  // handshake in the coordinator's log); refused, it is gone.
  const bool slow = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
                    (s.error_code() == grpc::StatusCode::UNAVAILABLE &&
                     ProbeListening({target_}, absl::Seconds(1))[0] == Liveness::kListening);
  absl::MutexLock l(&mu_);
  in_flight_ = false;
  call_ = nullptr;
  if (!s.ok()) {
    // Keep the metrics and checks for the next try.
    for (int i = req.metrics_size() - 1; i >= 0; --i) {
      pending_.insert(pending_.begin(), req.metrics(i));
    }
    for (int i = req.freeze_checks_size() - 1; i >= 0; --i) {
      checks_.insert(checks_.begin(), req.freeze_checks(i));
    }
    for (int i = req.checkpoint_parts_size() - 1; i >= 0; --i) {
      parts_.insert(parts_.begin(), req.checkpoint_parts(i));
    }
    for (uint32_t r : req.heard()) peers_heard_->Heard(r);
    const absl::Duration silent = absl::Now() - last_ok_;
    // A coordinator that is there but slow (a crowded host) gets
    // kSlowCoordinatorFactor times the timeout; a lost one (refused, reset,
    // or no answer even to a connect) is waited for as long as before.
    const absl::Duration wait =
        slow ? std::max(coordinator_wait_, kSlowCoordinatorFactor * coordinator_timeout_)
             : coordinator_wait_;
    if (command_ == control::CONTINUE && silent > wait) {
      command_ = control::ABORT;
      reason_ = absl::StrCat("the coordinator at ", target_, " is unreachable (no heartbeat for ",
                             absl::FormatDuration(wait), "): ", s.error_message());
    } else if (command_ == control::CONTINUE && silent > coordinator_timeout_ && !lost_said_) {
      lost_said_ = true;
      std::fprintf(stderr,
                   "%s %u: %s the coordinator at %s (no heartbeat for %s: %s); waiting up to "
                   "%s for it to %s\n",
                   role_ == control::SERVER ? "server" : "worker", rank_,
                   slow ? "no answer in time from" : "lost", target_.c_str(),
                   absl::FormatDuration(coordinator_timeout_).c_str(), s.error_message().c_str(),
                   absl::FormatDuration(wait).c_str(), slow ? "answer" : "come back");
    }
    return;
  }
  last_ok_ = absl::Now();
  if (lost_said_) {
    lost_said_ = false;
    std::fprintf(stderr, "%s %u: the coordinator at %s answers again\n",
                 role_ == control::SERVER ? "server" : "worker", rank_, target_.c_str());
  }
  if (!req.stop_requested().empty()) stop_sent_ = true;
  if (reply.stopping() && !stopping_) {
    stopping_ = true;
    if (role_ == control::WORKER) {
      stop_ack_ = begun_;
      kick_ = true;  // tell the coordinator at once
    }
  }
  if (reply.has_stop_step()) stop_step_ = reply.stop_step();
  freeze_decided_ = std::max(freeze_decided_, reply.freeze_decided());
  if (reply.freeze_step() != 0) freeze_step_ = reply.freeze_step();
  if (reply.has_end_step()) end_step_ = reply.end_step();
  if (command_ == control::CONTINUE && reply.command() != control::CONTINUE) {
    command_ = reply.command();
    reason_ = reply.reason();
  }
}

void Heartbeater::Kick() {
  absl::MutexLock l(&mu_);
  kick_ = true;
}

void Heartbeater::ReportCheckpointPart(const control::CheckpointPart& part) {
  {
    absl::MutexLock l(&mu_);
    parts_.push_back(part);
  }
  Kick();
}

void Heartbeater::ReportFreezeCheck(uint64_t completed, double change) {
  {
    absl::MutexLock l(&mu_);
    control::FreezeCheck c;
    c.set_completed(completed);
    c.set_change(change);
    checks_.push_back(c);
  }
  Kick();
}

std::optional<uint64_t> Heartbeater::FreezeDecision(uint64_t completed, uint64_t window) {
  {
    absl::MutexLock l(&mu_);
    if (freeze_step_ != 0) {
      return freeze_step_ == completed + window ? freeze_step_ : kNever;
    }
    if (freeze_decided_ >= completed) return kNever;
  }
  Kick();
  return std::nullopt;
}

void Heartbeater::ReportError(const std::string& error) {
  control::HeartbeatRequest req;
  req.set_role(role_);
  req.set_rank(rank_);
  req.set_job_id(job_id_);
  req.set_incarnation(incarnation_);
  req.set_credential(credential_);
  req.set_error(error);
  {
    absl::MutexLock l(&mu_);
    // A failed heartbeat puts back what it carried (see Done).
    auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_flight_; };
    mu_.AwaitWithTimeout(absl::Condition(&answered), call_deadline_);
    req.set_step(step_);  // the coordinator takes no row of a step not done
    TakeMetricsLocked(req.mutable_metrics());
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + call_deadline_));
  control::HeartbeatReply reply;
  // Best effort: the caller exits non-zero whether or not this got through.
  (void)stub_->Heartbeat(&ctx, req, &reply);
}

std::optional<uint64_t> Heartbeater::end_step() const {
  absl::MutexLock l(&mu_);
  return end_step_;
}

absl::Status Heartbeater::Done(const std::vector<control::ShardChecksum>& checksums,
                               uint64_t steps) {
  control::DoneRequest req;
  req.set_role(role_);
  req.set_rank(rank_);
  req.set_job_id(job_id_);
  req.set_incarnation(incarnation_);
  req.set_credential(credential_);
  req.set_steps(steps);
  for (const auto& c : checksums) *req.add_checksums() = c;
  {
    absl::MutexLock l(&mu_);
    // A failed heartbeat puts back what it carried; an answered one has
    // been counted.
    auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !in_flight_; };
    mu_.AwaitWithTimeout(absl::Condition(&answered), call_deadline_ + absl::Seconds(1));
    // More rows than one call carries (after a long loss of the
    // coordinator): the heartbeats take them first.
    auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !in_flight_ && pending_.size() <= kMaxMetricsPerHeartbeat;
    };
    if (!drained()) {
      kick_ = true;
      mu_.AwaitWithTimeout(absl::Condition(&drained), absl::Seconds(10));
    }
    TakeMetricsLocked(req.mutable_metrics());
    for (auto& c : parts_) *req.add_checkpoint_parts() = c;
    parts_.clear();
  }
  // A lost coordinator is waited for as the heartbeat waits for it.
  absl::Time since;
  {
    absl::MutexLock l(&mu_);
    since = last_ok_;
  }
  while (true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     absl::ToChronoMilliseconds(coordinator_timeout_));
    control::DoneReply reply;
    grpc::Status s = stub_->Done(&ctx, req, &reply);
    if (s.ok()) return absl::OkStatus();
    // A coordinator too busy to answer in time (a loaded host at the end of
    // a large job) is asked again, as a lost one is (Done may be repeated),
    // and given the time a heartbeat gives a slow one.
    const bool slow = s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE && !slow) {
      return RpcError(absl::StrCat("Done to the coordinator at ", target_), s);
    }
    const absl::Duration wait =
        slow ? std::max(coordinator_wait_, kSlowCoordinatorFactor * coordinator_timeout_)
             : coordinator_wait_;
    if (absl::Now() - since > wait) {
      return RpcError(
          absl::StrCat("Done: the coordinator at ", target_, " is unreachable (no heartbeat for ",
                       absl::FormatDuration(wait), ")"),
          s);
    }
    absl::SleepFor(absl::Milliseconds(100));
    absl::MutexLock l(&mu_);
    if (command_ != control::CONTINUE) {
      return absl::AbortedError(absl::StrCat("Done: ", reason_));  // e.g. told to REJOIN
    }
  }
}

}  // namespace onebit
