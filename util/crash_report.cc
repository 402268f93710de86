#include "util/crash_report.h"

#include <execinfo.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <cstdint>

#include "absl/debugging/symbolize.h"

namespace onebit {
namespace {

constexpr int kCrashSignals[] = {SIGSEGV, SIGABRT, SIGBUS, SIGILL, SIGFPE};
constexpr int kMaxFrames = 64;

// Only async-signal-safe calls from here on: write(2), no allocation.
void Say(const char* s) {
  for (size_t n = strlen(s); n > 0;) {
    const ssize_t w = write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void SayHex(uintptr_t v) {
  char buf[2 + 16 + 1] = "0x";
  for (int i = 0; i < 16; ++i) buf[2 + i] = "0123456789abcdef"[(v >> (60 - 4 * i)) & 0xf];
  buf[18] = '\0';
  Say(buf);
}

void OnCrash(int sig) {
  // A second crash while reporting (or in another thread) dies at once.
  for (int s : kCrashSignals) signal(s, SIG_DFL);
  Say("*** ");
  Say(sigdescr_np(sig));  // a static string: no locale, no allocation
  Say(" (crash); the stack of the thread that crashed:\n");
  // glibc's unwinder reads the binaries' unwind tables, so it walks through
  // libc's own frames (abort, free), where frame pointers are absent.
  void* frames[kMaxFrames];
  const int n = backtrace(frames, kMaxFrames);
  for (int i = 0; i < n; ++i) {
    const uintptr_t pc = reinterpret_cast<uintptr_t>(frames[i]);
    char name[512];
    Say("    @ ");
    SayHex(pc);
    Say("  ");
    // A return address points past the call: look up the call itself.
    Say(absl::Symbolize(reinterpret_cast<void*>(pc - 1), name, sizeof name) ? name : "(unknown)");
    Say("\n");
  }
  raise(sig);  // dies of it as it would have (the handler is reset)
}

}  // namespace

void ReportCrashes(const char* argv0) {
  absl::InitializeSymbolizer(argv0);
  // backtrace() loads libgcc's unwinder on its first call, which allocates:
  // done here, not in a crashed process.
  void* warm[1];
  backtrace(warm, 1);
  struct sigaction sa = {};
  sa.sa_handler = OnCrash;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_ONSTACK;
  for (int s : kCrashSignals) sigaction(s, &sa, nullptr);
}

}  // namespace onebit
