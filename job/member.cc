#include "job/member.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/checkpoint_dir.h"
#include "net/data_plane.h"

namespace onebit {
namespace {

const char* RoleName(control::Role role) { return role == control::SERVER ? "server" : "worker"; }

}  // namespace

JobMember::JobMember(JobMemberOptions options, const Security& security,
                     control::RegisterRequest request)
    : options_(std::move(options)),
      stub_(control::Coordinator::NewStub(MakeChannel(options_.coordinator, security))),
      request_(std::move(request)),
      buffers_(std::make_shared<SnapshotBuffers>(options_.snapshot_arrays)) {}

JobMember::~JobMember() { Stop(); }

void JobMember::Stop() {
  writer_.reset();  // finishes what was submitted
  heartbeat_.reset();
}

absl::Status JobMember::Join() {
  auto reg = RegisterWithCoordinator(stub_.get(), options_.coordinator, request_,
                                     options_.register_timeout);
  if (!reg.ok()) return reg.status();
  Start(*std::move(reg), 0);
  return absl::OkStatus();
}

absl::Status JobMember::Rejoin(uint64_t steps_done) {
  std::fprintf(stderr, "%s: %s: registering again\n", name().c_str(), heartbeat_->reason().c_str());
  // Whatever failed meanwhile came of the loss the job rolls back for:
  // the old incarnation's files are written, its heartbeat ends.
  Stop();
  control::RegisterRequest req = request_;
  req.set_requested_rank(static_cast<int>(reg_.rank()));
  req.set_rejoin_from(reg_.incarnation());
  // Exact, unlike the last heartbeat's step.
  if (req.role() == control::WORKER) req.set_rejoin_steps_done(steps_done);
  const absl::Duration wait = std::max(options_.register_timeout, RejoinWait(reg_.config()));
  auto reg = RegisterWithCoordinator(stub_.get(), options_.coordinator, req, wait);
  if (!reg.ok()) {
    return absl::Status(reg.status().code(),
                        absl::StrCat("registering again: ", reg.status().message()));
  }
  const control::RegisterReply before = std::exchange(reg_, {});
  Start(*std::move(reg), steps_done);
  if (reg_.job_id() != before.job_id() || reg_.rank() != before.rank() || !reg_.has_resume() ||
      reg_.shard_map() != before.shard_map()) {
    return absl::InternalError(absl::StrCat(
        "registered again, but not as before: job ", absl::StrFormat("%016x", reg_.job_id()),
        ", rank ", reg_.rank(), reg_.has_resume() ? "" : ", no checkpoint to continue from"));
  }
  return absl::OkStatus();
}

void JobMember::Start(control::RegisterReply reg, uint64_t steps_done) {
  reg_ = std::move(reg);
  // The checkpoint continued from is there already.
  checkpointed_ = reg_.has_resume() ? reg_.resume().step() : 0;
  heartbeat_ = MakeHeartbeater(stub_.get(), options_.coordinator, request_.role(), reg_);
  if (peers_heard_ == nullptr) {
    const control::ClusterConfig& cluster = reg_.config().cluster();
    peers_heard_ = std::make_shared<PeersHeard>(
        request_.role() == control::SERVER ? cluster.workers() : cluster.servers());
  }
  heartbeat_->SetPeersHeard(peers_heard_);
  heartbeat_->WatchStopSignal(options_.stop_signal);
  heartbeat_->SetStep(steps_done);
  heartbeat_->Start();
  writer_ = std::make_unique<AsyncStateWriter>(
      [hb = heartbeat_.get(), &on_written = options_.on_written](
          uint64_t step, const absl::StatusOr<WrittenFile>& written) {
        if (on_written) on_written(written);
        hb->ReportCheckpointPart(PartOf(step, written));
      });
}

uint64_t JobMember::data_plane_id() const { return DataPlaneId(reg_.job_id(), reg_.incarnation()); }

std::string JobMember::name() const {
  return absl::StrCat(RoleName(request_.role()), " ", reg_.rank());
}

bool JobMember::rolling_back() const {
  return heartbeat_ != nullptr && heartbeat_->command() == control::REJOIN;
}

absl::Status JobMember::Named(const absl::Status& st) const {
  return absl::Status(st.code(), absl::StrCat(name(), ": ", st.message()));
}

void JobMember::ReportFailure(const absl::Status& st) {
  if (heartbeat_ != nullptr) heartbeat_->ReportError(std::string(Named(st).message()));
}

absl::Status JobMember::LoadCheckpoint(Load load) {
  if (!reg_.has_resume()) return absl::OkStatus();
  return load(reg_.resume());
}

bool JobMember::CheckpointDue(uint64_t step) const {
  const uint64_t every = reg_.config().checkpoint().every();
  return every > 0 && step % every == 0;
}

absl::Status JobMember::Checkpoint(uint64_t step, Snapshot snapshot) {
  if (step == 0 || step == checkpointed_) return absl::OkStatus();
  checkpointed_ = step;
  auto dir = MakeStepDir(reg_.config().checkpoint().dir(), step);
  if (!dir.ok()) {
    if (options_.on_written) options_.on_written(dir.status());
    heartbeat_->ReportCheckpointPart(PartOf(step, dir.status()));
    return absl::OkStatus();
  }
  absl::StatusOr<StateWriter> file = snapshot(buffers_);
  if (!file.ok()) {
    return absl::Status(file.status().code(),
                        absl::StrCat("checkpoint of step ", step, ": ", file.status().message()));
  }
  file->ReturnBuffersTo(buffers_);
  writer_->Submit(step, *std::move(file), *dir,
                  absl::StrCat(RoleName(request_.role()), "-", reg_.rank(), ".state"));
  return absl::OkStatus();
}

void JobMember::FlushCheckpoints() { writer_->Flush(); }

}  // namespace onebit
