// Child processes for onebit-launch and the integration tests. A child dies
// with its parent (PR_SET_PDEATHSIG), so a killed launcher leaves no orphans.
// It starts in a session, and so a process group, of its own (its pid is the
// group's id): a terminal's Ctrl-C, which signals the foreground process
// group, reaches the parent only, which decides what its children get. It
// starts with no signal blocked, whatever the parent blocks.
// A Subprocess is not thread-safe; use it from the thread that spawned it
// (the death signal follows that thread).
#ifndef ONEBIT_UTIL_SUBPROCESS_H_
#define ONEBIT_UTIL_SUBPROCESS_H_

#include <sys/types.h>

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace onebit {

class Subprocess {
 public:
  // argv[0] is the program path. stdout_fd / stderr_fd: -1 inherits ours.
  // `env`: "NAME=value" entries added to (or replacing those of) our
  // environment. The child runs in a session of its own. `nice` > 0: it
  // runs at that niceness from before its program starts, and so does its
  // session's scheduling group where the kernel has them (autogroup).
  static absl::StatusOr<Subprocess> Spawn(const std::vector<std::string>& argv, int stdout_fd = -1,
                                          int stderr_fd = -1,
                                          const std::vector<std::string>& env = {}, int nice = 0);

  pid_t pid() const { return pid_; }

  // Non-blocking: the exit code once the child has exited (128 + signal
  // number when killed by a signal), else nullopt.
  std::optional<int> Poll();
  // Waits up to `timeout`; nullopt if still running.
  std::optional<int> Wait(absl::Duration timeout);
  // Sends `sig` if still running.
  void Signal(int sig);
  // SIGTERM, then SIGKILL after `grace`; returns the exit code.
  int Stop(absl::Duration grace);

 private:
  explicit Subprocess(pid_t pid) : pid_(pid) {}
  pid_t pid_;
  std::optional<int> exit_code_;
};

// "exit 1", "signal 9 (Killed)" from a Poll/Wait code.
std::string DescribeExit(int code);

}  // namespace onebit

#endif  // ONEBIT_UTIL_SUBPROCESS_H_
