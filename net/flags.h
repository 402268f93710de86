// Command-line parsing shared by every binary: absl flags, plus the project's
// rules on top (DESIGN.md, issue 3): an unknown flag or an invalid value exits
// with status 2 naming the flag; flag names may be spelled with dashes
// (--step-timeout) or underscores (--step_timeout).
#ifndef ONEBIT_NET_FLAGS_H_
#define ONEBIT_NET_FLAGS_H_

#include <set>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace onebit {

// Parses argv into the absl flags; exits 2 on an unknown flag or bad value,
// and handles --help. Returns the names (underscore form) of the flags given
// on the command line. Positional arguments are an error (exit 2).
std::set<std::string> ParseFlagsOrExit(int argc, char** argv, absl::string_view usage);

// Prints "<program>: --<flag>: <message>" and exits 2.
[[noreturn]] void ExitFlagError(absl::string_view flag, absl::string_view message);

// Prints "<program>: <message>" and exits with `code`.
[[noreturn]] void ExitError(int code, absl::string_view message);

// The program name used in messages (basename of argv[0]).
const std::string& ProgramName();

}  // namespace onebit

#endif  // ONEBIT_NET_FLAGS_H_
