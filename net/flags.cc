#include "net/flags.h"

#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace onebit {
namespace {

std::string& ProgramNameStorage() {
  static std::string* name = new std::string("onebit");
  return *name;
}

// Flags absl handles itself (usage and flagfile machinery).
bool IsBuiltinFlag(absl::string_view name) {
  for (absl::string_view b :
       {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch", "version",
        "only_check_args", "flagfile", "fromenv", "tryfromenv", "undefok"}) {
    if (name == b) return true;
  }
  return false;
}

}  // namespace

const std::string& ProgramName() { return ProgramNameStorage(); }

void ExitFlagError(absl::string_view flag, absl::string_view message) {
  std::fprintf(stderr, "%s: --%s: %s\n", ProgramName().c_str(), std::string(flag).c_str(),
               std::string(message).c_str());
  std::exit(2);
}

void ExitError(int code, absl::string_view message) {
  std::fprintf(stderr, "%s: %s\n", ProgramName().c_str(), std::string(message).c_str());
  std::exit(code);
}

std::set<std::string> ParseFlagsOrExit(int argc, char** argv, absl::string_view usage) {
  if (argc > 0) {
    absl::string_view prog = argv[0];
    size_t slash = prog.rfind('/');
    ProgramNameStorage() = std::string(slash == prog.npos ? prog : prog.substr(slash + 1));
  }
  absl::SetProgramUsageMessage(usage);
  // --help lists every onebit flag (absl's default shows only flags defined
  // in a file named like the program), none of absl's own.
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return !absl::StrContains(file, "absl/");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  config.normalize_filename = [](absl::string_view file) { return std::string(file); };
  absl::SetFlagsUsageConfig(config);

  // Normalise dashes to underscores in flag names and check every flag and
  // value ourselves first, because absl exits 1 on these errors.
  std::vector<std::string> args;
  std::set<std::string> specified;
  args.push_back(argc > 0 ? argv[0] : "onebit");
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") break;
    if (arg.size() < 2 || arg[0] != '-') {
      ExitError(2, absl::StrCat("unexpected argument '", arg, "' (flags start with --)"));
    }
    size_t start = arg[1] == '-' ? 2 : 1;
    size_t eq = arg.find('=');
    std::string name = arg.substr(start, eq == std::string::npos ? std::string::npos : eq - start);
    name = absl::StrReplaceAll(name, {{"-", "_"}});
    bool has_value = eq != std::string::npos;
    std::string value = has_value ? arg.substr(eq + 1) : "";
    if (IsBuiltinFlag(name)) {
      args.push_back(arg);
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    bool negated = false;
    if (flag == nullptr && absl::StartsWith(name, "no")) {
      absl::CommandLineFlag* f = absl::FindCommandLineFlag(name.substr(2));
      if (f != nullptr && f->IsOfType<bool>() && !has_value) {
        flag = f;
        negated = true;
      }
    }
    if (flag == nullptr) ExitFlagError(name, "unknown flag (see --help)");
    std::string canonical(flag->Name());
    if (negated) {
      value = "false";
    } else if (!has_value) {
      if (flag->IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < argc) {
        value = argv[++i];
      } else {
        ExitFlagError(canonical, "missing value");
      }
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      ExitFlagError(canonical, absl::StrCat("invalid value '", value, "': ", error));
    }
    specified.insert(canonical);
    args.push_back(absl::StrCat("--", canonical, "=", value));
  }
  std::vector<char*> cargs;
  for (std::string& a : args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  std::vector<char*> rest = absl::ParseCommandLine(static_cast<int>(args.size()), cargs.data());
  if (rest.size() > 1) ExitError(2, absl::StrCat("unexpected argument '", rest[1], "'"));
  return specified;
}

}  // namespace onebit
