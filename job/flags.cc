#include "job/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "job/settings.h"
#include "optim/options.h"
#include "util/process_exit.h"

namespace onebit {
namespace {

std::string& ProgramNameStorage() {
  static std::string* name = new std::string("onebit");
  return *name;
}

// absl's help flags: we print help ourselves, from the binary's own flags.
bool IsHelpFlag(absl::string_view name) {
  for (absl::string_view h :
       {"help", "helpfull", "helpshort", "helppackage", "helpon", "helpmatch"}) {
    if (name == h) return true;
  }
  return false;
}

// absl's other built-in flags, left to absl::ParseCommandLine.
bool IsAbslBuiltin(absl::string_view name) {
  for (absl::string_view b :
       {"version", "only_check_args", "flagfile", "fromenv", "tryfromenv", "undefok"}) {
    if (name == b) return true;
  }
  return false;
}

bool IsAbslOwn(const absl::CommandLineFlag& flag) {
  return absl::StrContains(flag.Filename(), "absl/");
}

// The binary's own absl flag called `name`, or nullptr.
absl::CommandLineFlag* ProcessFlag(const std::string& name) {
  absl::CommandLineFlag* f = absl::FindCommandLineFlag(name);
  if (f == nullptr || f->IsRetired() || IsAbslOwn(*f)) return nullptr;
  return f;
}

std::string Normalize(absl::string_view name) { return absl::StrReplaceAll(name, {{"-", "_"}}); }

// The normalised flag name of "--name[=value]" (or "-name..."), "" if none.
std::string NameOf(absl::string_view arg) {
  if (arg.size() < 2 || arg[0] != '-') return "";
  arg.remove_prefix(arg[1] == '-' ? 2 : 1);
  return Normalize(arg.substr(0, arg.find('=')));
}

// The job setting `name` names (also as --noname for a bool), or "".
std::string JobSettingNamed(const std::string& name) {
  if (name == "config" || FindJobSetting(name) != nullptr) return name;
  if (absl::StartsWith(name, "no")) {
    const JobSetting* s = FindJobSetting(name.substr(2));
    if (s != nullptr && s->type == SettingType::kBool) return s->name;
  }
  return "";
}

// Parses `args` (no program name); with `use_absl`, into the binary's absl
// flags too, whose arguments it appends to *absl_args in canonical form.
absl::Status ParseArgs(const std::vector<std::string>& args, bool use_absl, ExtraFlags* extra,
                       std::vector<std::string>* absl_args, std::set<std::string>* specified) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg == "--") {
      if (i + 1 < args.size()) {
        return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", args[i + 1], "'"));
      }
      break;
    }
    std::string name = NameOf(arg);
    if (name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (flags start with --)"));
    }
    const size_t eq = arg.find('=');
    const bool has_value = eq != std::string::npos;
    std::string value = has_value ? arg.substr(eq + 1) : "";
    if (use_absl && IsAbslBuiltin(name)) {
      absl_args->push_back(arg);
      continue;
    }
    // The binary's own flags first, then the extra ones.
    absl::CommandLineFlag* flag = use_absl ? ProcessFlag(name) : nullptr;
    bool is_bool = false;
    bool in_extra = flag == nullptr && extra != nullptr && extra->Has(name, &is_bool);
    bool negated = false;
    if (flag == nullptr && !in_extra && !has_value && absl::StartsWith(name, "no")) {
      const std::string base = name.substr(2);
      absl::CommandLineFlag* f = use_absl ? ProcessFlag(base) : nullptr;
      bool b = false;
      if (f != nullptr && f->IsOfType<bool>()) {
        flag = f;
        negated = true;
      } else if (extra != nullptr && extra->Has(base, &b) && b) {
        in_extra = is_bool = negated = true;
      }
      if (negated) name = base;
    }
    if (flag == nullptr && !in_extra) {
      const std::string job = JobSettingNamed(name);
      if (!job.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", job, " is a job setting: give it to onebit-coordinator or onebit-launch"));
      }
      return SettingError(name, "unknown flag (see --help)");
    }
    if (negated) {
      value = "false";
    } else if (!has_value) {
      if (flag != nullptr ? flag->IsOfType<bool>() : is_bool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return SettingError(name, "missing value");
      }
    }
    if (flag != nullptr) {
      std::string error;
      if (!flag->ParseFrom(value, &error)) {
        return SettingError(name, absl::StrCat("invalid value '", value, "': ", error));
      }
      // No duration flag of ours has a meaning for a negative or an endless
      // time ("-5s", "inf"): refused here, for every binary at once.
      if (auto d = flag->TryGet<absl::Duration>()) {
        if (*d < absl::ZeroDuration()) {
          return SettingError(name,
                              absl::StrCat("invalid value '", value, "': must not be negative"));
        }
        if (*d == absl::InfiniteDuration()) {
          return SettingError(name, absl::StrCat("invalid value '", value, "': must be finite"));
        }
      }
      absl_args->push_back(absl::StrCat("--", name, "=", value));
    } else if (absl::Status st = extra->Set(name, value); !st.ok()) {
      return SettingError(name, st.message());
    }
    specified->insert(name);
  }
  return absl::OkStatus();
}

[[noreturn]] void PrintHelpAndExit(absl::string_view usage, const ExtraFlags* extra) {
  std::vector<absl::CommandLineFlag*> own;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && !IsAbslOwn(*flag)) own.push_back(flag);
  }
  std::sort(own.begin(), own.end(),
            [](const absl::CommandLineFlag* a, const absl::CommandLineFlag* b) {
              return a->Name() < b->Name();
            });
  std::string out = absl::StrCat(usage, "\n\nFlags of ", ProgramName(), ":\n");
  for (const absl::CommandLineFlag* f : own) {
    const std::string dflt = f->IsOfType<std::string>()
                                 ? absl::StrCat("\"", f->DefaultValue(), "\"")
                                 : f->DefaultValue();
    absl::StrAppend(&out, FlagHelpEntry(f->Name(), f->Help(), dflt));
  }
  if (extra != nullptr) absl::StrAppend(&out, extra->Help());
  std::fputs(out.c_str(), stdout);
  std::fflush(stdout);
  std::exit(0);
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
  ExitWithoutTeardown(code);  // may come after gRPC has run (util/process_exit.h)
}

std::string FlagHelpEntry(absl::string_view name, absl::string_view help,
                          absl::string_view default_shown) {
  constexpr size_t kWidth = 80;
  std::string out = absl::StrCat("    --", name);
  size_t col = out.size();
  bool first = true;
  for (absl::string_view w : absl::StrSplit(
           absl::StrCat("(", help, "); default: ", default_shown, ";"), ' ', absl::SkipEmpty())) {
    if (!first && col + 1 + w.size() > kWidth) {
      absl::StrAppend(&out, "\n      ", w);
      col = 6 + w.size();
    } else {
      absl::StrAppend(&out, " ", w);
      col += 1 + w.size();
    }
    first = false;
  }
  out += "\n";
  return out;
}

absl::Status ParseExtraFlags(const std::vector<std::string>& args, ExtraFlags* extra) {
  std::set<std::string> specified;
  return ParseArgs(args, /*use_absl=*/false, extra, nullptr, &specified);
}

std::set<std::string> ParseFlagsOrExit(int argc, char** argv, absl::string_view usage,
                                       ExtraFlags* extra) {
  if (argc > 0) {
    absl::string_view prog = argv[0];
    size_t slash = prog.rfind('/');
    ProgramNameStorage() = std::string(slash == prog.npos ? prog : prog.substr(slash + 1));
  }
  absl::SetProgramUsageMessage(usage);
  const std::vector<std::string> args(argv + std::min(argc, 1), argv + argc);
  for (const std::string& a : args) {
    if (a == "--") break;
    if (IsHelpFlag(NameOf(a))) PrintHelpAndExit(usage, extra);
  }
  // Every flag and value is checked here first, because absl exits 1 on
  // these errors and knows neither dashes nor the job settings.
  std::vector<std::string> absl_args = {argc > 0 ? argv[0] : "onebit"};
  std::set<std::string> specified;
  absl::Status st = ParseArgs(args, /*use_absl=*/true, extra, &absl_args, &specified);
  if (!st.ok()) ExitError(2, st.message());
  std::vector<char*> cargs;
  for (std::string& a : absl_args) cargs.push_back(a.data());
  cargs.push_back(nullptr);
  std::vector<char*> rest =
      absl::ParseCommandLine(static_cast<int>(absl_args.size()), cargs.data());
  if (rest.size() > 1) ExitError(2, absl::StrCat("unexpected argument '", rest[1], "'"));
  return specified;
}

}  // namespace onebit
