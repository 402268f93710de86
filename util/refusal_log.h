// Logging of refused requests with a rate limit: the first refusal is said
// at once, later ones are counted and summed up every few seconds, so a
// peer sending garbage cannot flood the log (or the disk under it).
#ifndef ONEBIT_UTIL_REFUSAL_LOG_H_
#define ONEBIT_UTIL_REFUSAL_LOG_H_

#include <cstdint>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace onebit {

// Thread-safe.
class RefusalLog {
 public:
  // Lines begin with "<who>: " (e.g. "server 1").
  explicit RefusalLog(std::string who, absl::Duration period = absl::Seconds(5));
  ~RefusalLog();  // says what is still counted

  // A refused request, e.g. "a request from 'w1-…': wrong block size 64".
  void Refused(const std::string& what);
  // Says what is counted if the period has passed; call now and then.
  void Flush();

  uint64_t total() const;

 private:
  void SayLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string who_;
  const absl::Duration period_;
  mutable absl::Mutex mu_;
  uint64_t total_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unsaid_ ABSL_GUARDED_BY(mu_) = 0;
  std::string last_ ABSL_GUARDED_BY(mu_);
  absl::Time said_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace onebit

#endif  // ONEBIT_UTIL_REFUSAL_LOG_H_
