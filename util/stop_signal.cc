#include "util/stop_signal.h"

#include <csignal>
#include <mutex>

#include "absl/strings/str_cat.h"

namespace onebit {
namespace {

std::atomic<int> g_caught{0};

// The first signal asks for a clean stop; a second one kills as usual.
extern "C" void OnStopSignal(int sig) {
  int none = 0;
  if (g_caught.compare_exchange_strong(none, sig)) return;
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

void CatchStopSignals() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int sig : {SIGTERM, SIGINT}) {
      struct sigaction old = {};
      if (sigaction(sig, nullptr, &old) != 0 || old.sa_handler != SIG_DFL) continue;
      struct sigaction sa = {};
      sa.sa_handler = OnStopSignal;
      sigemptyset(&sa.sa_mask);
      sigaction(sig, &sa, nullptr);
    }
  });
}

int StopSignalCaught() { return g_caught.load(); }

const std::atomic<int>* StopSignalFlag() { return &g_caught; }

std::string SignalName(int sig) {
  switch (sig) {
    case SIGTERM:
      return "SIGTERM";
    case SIGINT:
      return "SIGINT";
    default:
      return absl::StrCat("signal ", sig);
  }
}

}  // namespace onebit
