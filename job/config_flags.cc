// The job settings on the command line (onebit_cli): the functions of
// job/config.h that only onebit-coordinator, onebit-launch and
// onebit-reference link.
#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "job/config.h"
#include "job/config_file.h"
#include "job/flags.h"
#include "job/settings.h"
#include "models/registry.h"

namespace onebit {
namespace {

// The settings' --help, grouped, in absl's layout
// ("    --name (help); default: value;").
std::string JobSettingsHelp() {
  std::string out;
  std::vector<std::string> groups;
  for (const JobSetting& s : JobSettings()) {
    if (std::find(groups.begin(), groups.end(), s.group) == groups.end()) {
      groups.push_back(s.group);
    }
  }
  for (const std::string& g : groups) {
    absl::StrAppend(&out, "\n  ", g, ":\n");
    for (const JobSetting& s : JobSettings()) {
      if (g != s.group) continue;
      const bool quoted = s.type == SettingType::kString || s.type == SettingType::kStringMap;
      const std::string dflt =
          quoted ? absl::StrCat("\"", s.default_value, "\"") : std::string(s.default_value);
      absl::StrAppend(&out, FlagHelpEntry(s.name, s.help, dflt));
    }
  }
  return out;
}

// `text` from column `indent`, wrapped at 80 columns with continuation lines
// at `indent` + 4. Never "    --" at a line's start: tools/k8s-flags.js reads
// such lines as flags.
std::string Wrapped(size_t indent, absl::string_view text) {
  std::string out(indent, ' ');
  size_t col = indent;
  bool first = true;
  for (absl::string_view w : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!first && col + 1 + w.size() > 80) {
      absl::StrAppend(&out, "\n", std::string(indent + 4, ' '), w);
      col = indent + 4 + w.size();
    } else {
      absl::StrAppend(&out, first ? "" : " ", w);
      col += (first ? 0 : 1) + w.size();
    }
    first = false;
  }
  return out + "\n";
}

// The registered models (models/registry.h) with their settings and options.
std::string ModelsHelp() {
  std::string out =
      "\nModels (--model NAME; a model's options go in --model_options name=value,...):\n";
  for (const ModelEntry* m : RegisteredModels()) {
    std::string settings = m->settings;
    if (m->epoch_steps != nullptr) {
      absl::StrAppend(&settings, settings.empty() ? "" : " ", "--epochs --eval_every");
    }
    std::string line = absl::StrCat(m->name, ": ", m->help);
    if (!settings.empty()) absl::StrAppend(&line, "; settings ", settings);
    absl::StrAppend(&line, m->options.empty() ? "; no options" : "; options:");
    absl::StrAppend(&out, Wrapped(4, line));
    for (const ModelOption& o : m->options) {
      absl::StrAppend(&out, Wrapped(6, absl::StrCat(o.name, " (", o.help, "); default: \"",
                                                    o.default_value, "\"")));
    }
  }
  absl::StrAppend(&out, Wrapped(4, absl::StrCat(kExternalModel,
                                                ": the workers' own program (--worker_cmd), "
                                                "which declares d; no options")));
  return out;
}

// The job settings and --config as ExtraFlags: values are checked as they
// are parsed, so an error names the flag as it was given, and kept in order
// until the file has been read (the command line wins).
class JobFlags : public ExtraFlags {
 public:
  bool Has(const std::string& name, bool* is_bool) const override {
    const JobSetting* s = FindJobSetting(name);
    *is_bool = s != nullptr && s->type == SettingType::kBool;
    return s != nullptr || name == "config";
  }

  absl::Status Set(const std::string& name, const std::string& value) override {
    if (name == "config") {
      config_path_ = value;
      return absl::OkStatus();
    }
    const JobSetting* s = FindJobSetting(name);
    control::TrainingConfig scratch;
    if (absl::Status st = SetJobSetting(*s, value, &scratch); !st.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("invalid value '", value, "': ", st.message()));
    }
    values_.emplace_back(s, value);
    return absl::OkStatus();
  }

  std::string Help() const override {
    return absl::StrCat(
        "\nJob settings (one config for the whole job: onebit-launch forwards it to\n"
        "onebit-coordinator, which hands it to every server and worker):\n",
        FlagHelpEntry("config",
                      "JSON file of job settings, keys as the flags' names; or a DeepSpeed "
                      "config, whose optimizer section sets ours, with an \"onebit\" section "
                      "of job settings; the command line wins",
                      "\"\""),
        JobSettingsHelp(), ModelsHelp());
  }

  absl::StatusOr<control::TrainingConfig> Build(std::vector<std::string>* ignored,
                                                std::set<std::string>* given_out = nullptr) const {
    control::TrainingConfig c = DefaultJobConfig();
    std::set<std::string> given;
    std::vector<std::string> dropped;
    if (!config_path_.empty()) {
      if (absl::Status st = LoadConfigFile(config_path_, &c, &given, &dropped); !st.ok()) {
        return st;
      }
    }
    for (const auto& [s, value] : values_) {
      SetJobSetting(*s, value, &c).IgnoreError();  // checked by Set
      given.insert(s->name);
    }
    if (absl::Status st = ResolveConfig(given, &c); !st.ok()) return st;
    if (absl::Status st = ValidateConfig(c); !st.ok()) return st;
    if (ignored != nullptr) *ignored = std::move(dropped);
    if (given_out != nullptr) *given_out = std::move(given);
    return c;
  }

  const std::string& config_path() const { return config_path_; }

 private:
  std::string config_path_;
  std::vector<std::pair<const JobSetting*, std::string>> values_;
};

// What ConfigFromCommandLineOrExit built, for ConfigFlagArgs().
struct CommandLine {
  control::TrainingConfig config = DefaultJobConfig();
  std::set<std::string> given;
};

CommandLine& TheCommandLine() {
  static CommandLine* line = new CommandLine;
  return *line;
}

}  // namespace

absl::StatusOr<control::TrainingConfig> ConfigFromFlags(const std::vector<std::string>& args,
                                                        std::vector<std::string>* ignored) {
  JobFlags flags;
  if (absl::Status st = ParseExtraFlags(args, &flags); !st.ok()) return st;
  return flags.Build(ignored);
}

control::TrainingConfig ConfigFromCommandLineOrExit(int argc, char** argv, absl::string_view usage,
                                                    std::set<std::string>* given) {
  JobFlags flags;
  ParseFlagsOrExit(argc, argv, usage, &flags);
  std::vector<std::string> ignored;
  CommandLine& line = TheCommandLine();
  auto cfg = flags.Build(&ignored, &line.given);
  if (!cfg.ok()) ExitError(2, std::string(cfg.status().message()));
  if (!ignored.empty()) {
    std::fprintf(stderr, "%s: --config %s: ignored DeepSpeed keys: %s\n", ProgramName().c_str(),
                 flags.config_path().c_str(), absl::StrJoin(ignored, ", ").c_str());
  }
  line.config = *cfg;
  if (given != nullptr) *given = line.given;
  return *std::move(cfg);
}

std::vector<std::string> ConfigFlagArgs() {
  const CommandLine& line = TheCommandLine();
  std::vector<std::string> out;
  for (const JobSetting& s : JobSettings()) {
    if (line.given.count(s.name)) {
      out.push_back(absl::StrCat("--", s.name, "=", JobSettingText(s, line.config)));
    }
  }
  return out;
}

}  // namespace onebit
