// SIGTERM (what Kubernetes sends on preemption, and onebit-launch when it
// stops a job) and SIGINT, caught so that a process can stop its job after a
// checkpoint instead of dying in the middle of a step.
//
// Process-wide. Thread-safe; the handler only stores the signal's number.
#ifndef ONEBIT_UTIL_STOP_SIGNAL_H_
#define ONEBIT_UTIL_STOP_SIGNAL_H_

#include <atomic>
#include <string>

namespace onebit {

// Catches SIGTERM and SIGINT where their disposition is still the default
// (a program's own handlers stay): the first is recorded, a second one of
// the same kind ends the process as it would have. Safe to call more than
// once.
void CatchStopSignals();

// The number of the first stop signal caught; 0 while none was.
int StopSignalCaught();
// What the handler writes (for CoordinatorOptions::stop_signal).
const std::atomic<int>* StopSignalFlag();

// "SIGTERM", "SIGINT" or "signal N".
std::string SignalName(int sig);

}  // namespace onebit

#endif  // ONEBIT_UTIL_STOP_SIGNAL_H_
