// How the binaries end: once main's work is done (every thread of ours
// joined, every file closed), the process flushes stdio and exits without
// running static destructors. gRPC destroys subchannels and shuts itself
// down on its own threads after the last channel is gone; static
// destructors run beside that crashed servers at exit (glibc's "double
// free or corruption", "free(): invalid pointer") after jobs that had
// rolled back, whose processes had made more channels.
#ifndef ONEBIT_UTIL_PROCESS_EXIT_H_
#define ONEBIT_UTIL_PROCESS_EXIT_H_

namespace onebit {

// Flushes stdout and stderr and ends the process with `code` (_exit): no
// atexit handlers, no static destructors. Call only from main, with the
// work done; not from a library loaded into another program.
[[noreturn]] void ExitWithoutTeardown(int code);

}  // namespace onebit

#endif  // ONEBIT_UTIL_PROCESS_EXIT_H_
