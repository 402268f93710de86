// Whether a job's state can fit in this process's memory, checked before it
// is allocated: a worker (its replica and optimizer state), a server (its
// shard) and the reference (everything) refuse a job too large for the
// machine with an error naming the bytes, instead of being killed by the
// kernel's OOM killer or dying of std::bad_alloc halfway through.
#ifndef ONEBIT_UTIL_MEMORY_H_
#define ONEBIT_UTIL_MEMORY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace onebit {

// The most memory this process can have: the least of the machine's
// physical memory, its cgroup's limit (a container's, e.g. a Kubernetes
// pod's memory limit) and its address-space limit (ulimit -v). `bytes` 0:
// none known. `what` says which, e.g. "this machine's physical memory".
struct MemoryLimit {
  uint64_t bytes = 0;
  std::string what;
};
MemoryLimit ProcessMemoryLimit();

// "274877906944 bytes (256 GiB)".
std::string BytesText(uint64_t bytes);

// OK when `bytes` fit within ProcessMemoryLimit(), else ResourceExhausted:
// "<what> needs at least <bytes>; <limit> is <bytes>". Used and free memory
// are not counted: a job refused here could not run even alone.
absl::Status CheckMemory(absl::string_view what, uint64_t bytes);

}  // namespace onebit

#endif  // ONEBIT_UTIL_MEMORY_H_
