#include "util/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace onebit {

absl::StatusOr<Subprocess> Subprocess::Spawn(const std::vector<std::string>& argv, int stdout_fd,
                                             int stderr_fd, const std::vector<std::string>& env,
                                             int nice) {
  if (argv.empty()) return absl::InvalidArgumentError("empty argv");
  std::vector<char*> cargv;
  for (const std::string& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  // Built before fork: the child may only exec.
  std::vector<char*> cenv;
  for (char** e = environ; *e != nullptr; ++e) {
    const char* eq = std::strchr(*e, '=');
    const size_t name = eq == nullptr ? std::strlen(*e) : static_cast<size_t>(eq - *e) + 1;
    bool replaced = false;
    for (const std::string& x : env) replaced |= x.compare(0, name, *e, name) == 0;
    if (!replaced) cenv.push_back(*e);
  }
  for (const std::string& x : env) cenv.push_back(const_cast<char*>(x.c_str()));
  cenv.push_back(nullptr);
  // The niceness as text for /proc/self/autogroup, written before fork.
  const std::string nice_text = absl::StrCat(std::min(nice, 19));
  sigset_t unblocked;
  sigemptyset(&unblocked);
  const pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);  // the parent died already
    setsid();
    sigprocmask(SIG_SETMASK, &unblocked, nullptr);
    // Raising one's own niceness cannot fail for want of privilege.
    if (nice > 0) {
      setpriority(PRIO_PROCESS, 0, nice);
      // Where the kernel groups tasks by session (autogroup, on by default
      // on desktop and many server kernels), setsid() above gave the child a
      // group of its own: niceness then ranks threads only within it, and
      // each group gets an equal share. 256 such children left the
      // coordinator 1/257 of the CPU whatever their niceness. The group's own
      // niceness ranks it among the others (no file: no autogroups).
      const int fd = open("/proc/self/autogroup", O_WRONLY | O_CLOEXEC);
      if (fd >= 0) {
        ssize_t ignored = write(fd, nice_text.data(), nice_text.size());
        (void)ignored;
        close(fd);
      }
    }
    if (stdout_fd >= 0) dup2(stdout_fd, 1);
    if (stderr_fd >= 0) dup2(stderr_fd, 2);
    execve(cargv[0], cargv.data(), cenv.data());
    const char msg[] = "exec failed\n";
    ssize_t ignored = write(2, msg, sizeof(msg) - 1);
    (void)ignored;
    _exit(127);
  }
  return Subprocess(pid);
}

std::optional<int> Subprocess::Poll() {
  if (exit_code_) return exit_code_;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    if (WIFEXITED(status)) {
      exit_code_ = WEXITSTATUS(status);
    } else if (WIFSIGNALED(status)) {
      exit_code_ = 128 + WTERMSIG(status);
    }
  } else if (r < 0 && errno == ECHILD) {
    exit_code_ = 255;  // reaped elsewhere; should not happen
  }
  return exit_code_;
}

std::optional<int> Subprocess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    if (auto c = Poll()) return c;
    if (absl::Now() >= deadline) return std::nullopt;
    absl::SleepFor(absl::Milliseconds(5));
  }
}

void Subprocess::Signal(int sig) {
  if (!Poll()) kill(pid_, sig);
}

int Subprocess::Stop(absl::Duration grace) {
  Signal(SIGTERM);
  if (auto c = Wait(grace)) return *c;
  Signal(SIGKILL);
  while (true) {
    if (auto c = Wait(absl::Seconds(1))) return *c;
  }
}

std::string DescribeExit(int code) {
  if (code > 128 && code < 128 + 65) {
    return absl::StrCat("signal ", code - 128, " (", strsignal(code - 128), ")");
  }
  return absl::StrCat("exit ", code);
}

}  // namespace onebit
