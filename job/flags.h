// Command-line parsing shared by every binary: absl flags for each binary's
// own process flags, plus the project's rules on top (docs/design.md §4): an
// unknown flag or an invalid value (for a duration flag also a negative or
// an infinite one) exits with status 2 naming the flag; flag names may be
// spelled with dashes (--step-timeout) or underscores
// (--step_timeout). The job settings (job/settings.h) are not absl flags:
// the binaries that take them pass them in as ExtraFlags, and the others
// refuse them naming the binaries that take them.
#ifndef ONEBIT_JOB_FLAGS_H_
#define ONEBIT_JOB_FLAGS_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace onebit {

// Flags parsed besides the binary's absl flags. Names are in underscore form.
class ExtraFlags {
 public:
  virtual ~ExtraFlags() = default;
  // Whether `name` is one of them; *is_bool when it takes no value
  // (--name, --noname, --name=false).
  virtual bool Has(const std::string& name, bool* is_bool) const = 0;
  // Sets one; an error's message is what follows "--name: ".
  virtual absl::Status Set(const std::string& name, const std::string& value) = 0;
  // Their part of --help.
  virtual std::string Help() const = 0;
};

// Parses argv into the binary's absl flags and `extra` (may be null); exits 2
// on an unknown flag, a bad value or a positional argument, and prints help
// and exits 0 on --help. Without `extra`, a job setting exits 2 naming the
// binaries that take it. Returns the names (underscore form) of the flags
// given on the command line.
std::set<std::string> ParseFlagsOrExit(int argc, char** argv, absl::string_view usage,
                                       ExtraFlags* extra = nullptr);

// ParseFlagsOrExit's rules for arguments that are all `extra`'s (no program
// name), with errors returned ("--name: ...") rather than exiting.
absl::Status ParseExtraFlags(const std::vector<std::string>& args, ExtraFlags* extra);

// One flag's --help entry in absl's layout, "    --name (help); default:
// value;\n", wrapped at 80 columns with continuation lines indented by 6
// (tools/k8s-flags.js reads this).
std::string FlagHelpEntry(absl::string_view name, absl::string_view help,
                          absl::string_view default_shown);

// Prints "<program>: --<flag>: <message>" and exits 2.
[[noreturn]] void ExitFlagError(absl::string_view flag, absl::string_view message);

// Prints "<program>: <message>" and exits with `code`.
[[noreturn]] void ExitError(int code, absl::string_view message);

// The program name used in messages (basename of argv[0]).
const std::string& ProgramName();

}  // namespace onebit

#endif  // ONEBIT_JOB_FLAGS_H_
