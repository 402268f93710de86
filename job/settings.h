// The job settings: one table row per setting is the only place one is
// defined, with its default. A row is a command-line flag of
// onebit-coordinator, onebit-launch and onebit-reference, a key of their
// --config file (both the flat name), and one field of the nested
// TrainingConfig ("optimizer.lr"), read and written through protobuf
// reflection. No absl flags here: the worker library, which users link
// into their programs, links this.
#ifndef ONEBIT_JOB_SETTINGS_H_
#define ONEBIT_JOB_SETTINGS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/generated_enum_reflection.h"
#include "proto/control.pb.h"

namespace onebit {

// kStringMap: a map<string, string> field, as text "k=v,k=v" (keys sorted
// when written; a key's dashes read as underscores; no ',' in values).
// kEnum: a proto enum field, as its value's name without the enum's prefix,
// in lower case with dashes (OPTIMIZER_ONEBIT_ADAM: "onebit-adam"); "" is
// the UNSPECIFIED value (see EnumText).
// kDuration: a uint32 field of milliseconds, as text "30s" or "500ms".
enum class SettingType { kBool, kUint32, kUint64, kFloat, kString, kDuration, kStringMap, kEnum };

struct JobSetting {
  const char* name;   // underscore spelling: the flag and the file's key
  const char* field;  // the TrainingConfig field, "group.field"
  SettingType type;
  const char* default_value;  // as typed on the command line
  const char* group;          // --help heading
  const char* help;
  // The --optimizer that alone reads it (nullptr: every one). Given for
  // another optimizer it would change nothing, so ResolveConfig refuses it.
  const char* only_for = nullptr;
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

// A proto enum value as its setting spells it: the value's name without
// the enum's prefix, lower case, '_' as '-' (control::CODEC_FP16: "fp16";
// any *_UNSPECIFIED: ""). For messages and for the code that takes names
// (codec factories, the optimizer registry).
std::string EnumText(const google::protobuf::EnumValueDescriptor* value);
template <typename E>
std::string EnumText(E value) {
  return EnumText(google::protobuf::GetEnumDescriptor<E>()->FindValueByNumber(value));
}

// The value of enum E whose EnumText is `text` into *value; false when none is.
template <typename E>
bool EnumFromText(absl::string_view text, E* value) {
  const google::protobuf::EnumDescriptor* d = google::protobuf::GetEnumDescriptor<E>();
  for (int i = 0; i < d->value_count(); ++i) {
    if (EnumText(d->value(i)) == text) {
      *value = static_cast<E>(d->value(i)->number());
      return true;
    }
  }
  return false;
}

// The flat settings of `config` as a JSON object, name -> value (numbers
// and booleans as JSON's, the rest as their text): what a worker's program
// sees of the job (the PyTorch front's opt.job).
std::string JobSettingsJson(const control::TrainingConfig& config);

}  // namespace onebit

#endif  // ONEBIT_JOB_SETTINGS_H_
