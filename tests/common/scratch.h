// Scratch folders for tests: $TEST_TMPDIR (else /tmp)/<prefix>-<pid>-<name>,
// made empty when asked for, so that the suite does not fill the disk run
// after run (its jobs write checkpoints, logs and dumps).
//
// Thread-safe. Call from the test's own thread (a test body, fixture or
// helper): the folder belongs to the test running then.
#ifndef ONEBIT_TESTS_COMMON_SCRATCH_H_
#define ONEBIT_TESTS_COMMON_SCRATCH_H_

#include <string>

namespace onebit {

// A folder of the running test, removed when that test ends if it passed.
// A failed test's folders are kept and named on stderr, to be read. Outside
// any test (a static, a global set-up) it lives as ScratchDirForProcess's.
std::string ScratchDir(const std::string& prefix, const std::string& name);

// A folder that several tests share (a cached secret file): removed when the
// test binary exits normally.
std::string ScratchDirForProcess(const std::string& prefix, const std::string& name);

}  // namespace onebit

#endif  // ONEBIT_TESTS_COMMON_SCRATCH_H_
