// A crashing process says where: on SIGSEGV, SIGABRT (a failed glibc heap
// check, an assertion), SIGBUS, SIGILL or SIGFPE it prints the crashed
// thread's symbolized stack to stderr, then dies of the signal as before.
// For a crash at a user's site, or one seen once in a loaded test run, the
// log then holds the stack a core would have.
#ifndef ONEBIT_UTIL_CRASH_REPORT_H_
#define ONEBIT_UTIL_CRASH_REPORT_H_

namespace onebit {

// Call first in main, once, before any thread starts. Leaves SIGTERM and
// SIGINT alone (CatchStopSignals). `argv0`: main's argv[0],
// for the symbolizer. Not for a library loaded into another program (the
// Python front): the host owns its signals.
void ReportCrashes(const char* argv0);

}  // namespace onebit

#endif  // ONEBIT_UTIL_CRASH_REPORT_H_
