#include "util/process_exit.h"

#include <unistd.h>

#include <cstdio>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace onebit {

void ExitWithoutTeardown(int code) {
  std::fflush(nullptr);
#if defined(__SANITIZE_ADDRESS__)
  // The leak check an AddressSanitizer build runs at exit, which _exit skips.
  __lsan_do_leak_check();
#endif
  _exit(code);
}

}  // namespace onebit
