#include "util/refusal_log.h"

#include <cstdio>

namespace onebit {

RefusalLog::RefusalLog(std::string who, absl::Duration period)
    : who_(std::move(who)), period_(period) {}

RefusalLog::~RefusalLog() {
  absl::MutexLock l(&mu_);
  if (unsaid_ > 0) SayLocked(absl::Now());
}

void RefusalLog::Refused(const std::string& what) {
  absl::MutexLock l(&mu_);
  ++total_;
  const absl::Time now = absl::Now();
  if (now - said_at_ >= period_ && unsaid_ == 0) {
    std::fprintf(stderr, "%s: refused %s\n", who_.c_str(), what.c_str());
    said_at_ = now;
    return;
  }
  ++unsaid_;
  last_ = what;
  if (now - said_at_ >= period_) SayLocked(now);
}

void RefusalLog::Flush() {
  absl::MutexLock l(&mu_);
  const absl::Time now = absl::Now();
  if (unsaid_ > 0 && now - said_at_ >= period_) SayLocked(now);
}

void RefusalLog::SayLocked(absl::Time now) {
  std::fprintf(stderr, "%s: refused %llu more request(s) in the last %s; the last: %s\n",
               who_.c_str(), static_cast<unsigned long long>(unsaid_),
               absl::FormatDuration(absl::Trunc(now - said_at_, absl::Seconds(1))).c_str(),
               last_.c_str());
  unsaid_ = 0;
  said_at_ = now;
}

uint64_t RefusalLog::total() const {
  absl::MutexLock l(&mu_);
  return total_;
}

}  // namespace onebit
