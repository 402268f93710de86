#include "util/memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace onebit {
namespace {

// The number in a cgroup file, or 0 where there is none ("max", no file, or
// cgroup v1's "no limit", a value near 2^63).
uint64_t CgroupLimit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!std::getline(in, text)) return 0;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(text), &v) || v >= (uint64_t{1} << 62)) {
    return 0;
  }
  return v;
}

}  // namespace

MemoryLimit ProcessMemoryLimit() {
  MemoryLimit limit;
  auto consider = [&limit](uint64_t bytes, const char* what) {
    if (bytes > 0 && (limit.bytes == 0 || bytes < limit.bytes)) limit = {bytes, what};
  };
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page > 0) {
    consider(static_cast<uint64_t>(pages) * static_cast<uint64_t>(page),
             "this machine's physical memory");
  }
  // The container's own cgroup (v2, then v1), as mounted in its namespace.
  consider(CgroupLimit("/sys/fs/cgroup/memory.max"), "this container's memory limit (cgroup)");
  consider(CgroupLimit("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
           "this container's memory limit (cgroup)");
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    consider(static_cast<uint64_t>(as.rlim_cur), "this process's address-space limit (ulimit -v)");
  }
  return limit;
}

std::string BytesText(uint64_t bytes) {
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = static_cast<double>(bytes);
  int unit = -1;
  while (v >= 1024 && unit < 4) {
    v /= 1024;
    ++unit;
  }
  if (unit < 0) return absl::StrCat(bytes, " bytes");
  return absl::StrFormat("%llu bytes (%.3g %s)", static_cast<unsigned long long>(bytes), v,
                         kUnits[unit]);
}

absl::Status CheckMemory(absl::string_view what, uint64_t bytes) {
  const MemoryLimit limit = ProcessMemoryLimit();
  if (limit.bytes == 0 || bytes <= limit.bytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(what, " needs at least ", BytesText(bytes),
                                                   " of memory; ", limit.what, " is ",
                                                   BytesText(limit.bytes)));
}

}  // namespace onebit
