// The job settings: one table row per setting is the only place one is
// defined. A row is a command-line flag of onebit-coordinator, onebit-launch
// and onebit-reference, a key of their --config file, and the TrainingConfig
// field of the same name (a duration's field is <name>_ms), read and written
// through protobuf reflection. No absl flags here: the worker library, which
// users link into their programs, links this.
#ifndef ONEBIT_JOB_SETTINGS_H_
#define ONEBIT_JOB_SETTINGS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "proto/control.pb.h"

namespace onebit {

// kStringMap: a map<string, string> field, as text "k=v,k=v" (keys sorted
// when written; a key's dashes read as underscores; no ',' in values).
enum class SettingType { kBool, kUint32, kUint64, kFloat, kString, kDuration, kStringMap };

struct JobSetting {
  const char* name;           // underscore spelling, and the TrainingConfig field
  SettingType type;           // kDuration: a uint32 field <name>_ms
  const char* default_value;  // as typed on the command line
  const char* group;          // --help heading
  const char* help;
};

// Every setting, in --help order.
absl::Span<const JobSetting> JobSettings();

// The setting called `name` (dashes or underscores), or nullptr.
const JobSetting* FindJobSetting(absl::string_view name);

// Parses `text` into the setting's field of *config. Errors carry only the
// reason ("not an unsigned integer"); callers name the flag or key.
absl::Status SetJobSetting(const JobSetting& setting, absl::string_view text,
                           control::TrainingConfig* config);

// The setting's value in *config as text that SetJobSetting reads back to
// the same value.
std::string JobSettingText(const JobSetting& setting, const control::TrainingConfig& config);

// Every setting at its default (before ResolveConfig fills in the rest).
control::TrainingConfig DefaultJobConfig();

}  // namespace onebit

#endif  // ONEBIT_JOB_SETTINGS_H_
