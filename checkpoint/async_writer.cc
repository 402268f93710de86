#include "checkpoint/async_writer.h"

#include <optional>
#include <utility>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace onebit {

AsyncStateWriter::AsyncStateWriter(Done done)
    : done_(std::move(done)), thread_([this] { Loop(); }) {}

AsyncStateWriter::~AsyncStateWriter() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void AsyncStateWriter::Submit(uint64_t step, StateWriter state, std::string dir, std::string name) {
  absl::MutexLock l(&mu_);
  auto room = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return queue_.size() + (writing_ ? 1 : 0) < 2;
  };
  mu_.Await(absl::Condition(&room));
  queue_.push_back(Job{step, std::move(state), std::move(dir), std::move(name)});
}

void AsyncStateWriter::Flush() {
  absl::MutexLock l(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && !writing_; };
  mu_.Await(absl::Condition(&idle));
}

void AsyncStateWriter::Loop() {
  while (true) {
    std::optional<Job> job;
    {
      absl::MutexLock l(&mu_);
      auto work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&work));
      if (queue_.empty()) return;  // stopping, and everything is written
      job.emplace(std::move(queue_.front()));
      queue_.pop_front();
      writing_ = true;
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<WrittenFile> written = job->state.WriteTo(job->dir, job->name);
    if (written.ok()) written->seconds = absl::ToDoubleSeconds(absl::Now() - start);
    done_(job->step, written);
    absl::MutexLock l(&mu_);
    writing_ = false;
  }
}

control::CheckpointPart PartOf(uint64_t step, const absl::StatusOr<WrittenFile>& written) {
  control::CheckpointPart p;
  p.set_step(step);
  if (!written.ok()) {
    p.set_error(std::string(written.status().message()));
    return p;
  }
  p.set_name(written->name);
  p.set_size(written->size);
  p.set_crc32(written->crc32);
  return p;
}

}  // namespace onebit
