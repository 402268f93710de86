#include "models/registry.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

// The built-in models, in --help order: one line each, naming the entry its
// own file defines.
#define ONEBIT_BUILTIN_MODELS(X) \
  X(kSyntheticModel)             \
  X(kMlpModel)                   \
  X(kSoftmaxModel)

namespace onebit {

#define ONEBIT_DECLARE_MODEL(entry) extern const ModelEntry entry;
ONEBIT_BUILTIN_MODELS(ONEBIT_DECLARE_MODEL)
#undef ONEBIT_DECLARE_MODEL

namespace {

#define ONEBIT_MODEL_ADDRESS(entry) &entry,
const ModelEntry* const kModels[] = {ONEBIT_BUILTIN_MODELS(ONEBIT_MODEL_ADDRESS)};
#undef ONEBIT_MODEL_ADDRESS

const ModelOption* FindOption(const ModelEntry& m, absl::string_view name) {
  for (const ModelOption& o : m.options) {
    if (name == o.name) return &o;
  }
  return nullptr;
}

std::string OptionNames(const ModelEntry& m) {
  std::vector<std::string> names;
  for (const ModelOption& o : m.options) names.push_back(o.name);
  return names.empty() ? "none" : absl::StrJoin(names, ", ");
}

// Refuses the first option (in name order: the map has none) that `model`
// (nullptr: external) does not declare.
absl::Status CheckDeclared(const control::TrainingConfig& c, const ModelEntry* model) {
  std::vector<std::string> given;
  for (const auto& [name, value] : c.model().options()) given.push_back(name);
  std::sort(given.begin(), given.end());
  for (const std::string& name : given) {
    if (model != nullptr && FindOption(*model, name) != nullptr) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("--model_options: model ", c.model().name(), " has no option '", name,
                     "' (its options: ", model == nullptr ? "none" : OptionNames(*model), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Span<const ModelEntry* const> RegisteredModels() { return kModels; }

absl::StatusOr<std::vector<uint64_t>> ModelLayerEnds(const control::TrainingConfig& c) {
  const ModelEntry* m = FindModel(c.model().name());
  if (m == nullptr) return std::vector<uint64_t>{};
  if (m->layer_ends != nullptr) return m->layer_ends(c);
  absl::StatusOr<uint64_t> d = m->num_params(c);
  if (!d.ok()) return d.status();
  return std::vector<uint64_t>{*d};
}

const ModelEntry* FindModel(absl::string_view name) {
  for (const ModelEntry* m : kModels) {
    if (name == m->name) return m;
  }
  return nullptr;
}

absl::Status UnknownModelError(absl::string_view name) {
  std::vector<std::string> names;
  for (const ModelEntry* m : kModels) names.push_back(m->name);
  return absl::InvalidArgumentError(absl::StrCat("--model: unknown model '", name, "' (want ",
                                                 absl::StrJoin(names, ", "), " or ", kExternalModel,
                                                 ")"));
}

absl::Status ResolveModelOptions(control::TrainingConfig* config) {
  const ModelEntry* m = FindModel(config->model().name());
  if (m == nullptr) return absl::OkStatus();
  if (absl::Status st = CheckDeclared(*config, m); !st.ok()) return st;
  auto& options = *config->mutable_model()->mutable_options();
  for (const ModelOption& o : m->options) options.insert({o.name, o.default_value});
  return absl::OkStatus();
}

absl::Status ValidateModelConfig(const control::TrainingConfig& c) {
  if (c.model().name() == kExternalModel) return CheckDeclared(c, nullptr);
  const ModelEntry* m = FindModel(c.model().name());
  if (m == nullptr) return UnknownModelError(c.model().name());
  if (absl::Status st = CheckDeclared(c, m); !st.ok()) return st;
  return m->validate != nullptr ? m->validate(c) : absl::OkStatus();
}

std::string ModelOptionValue(const control::TrainingConfig& c, absl::string_view name) {
  if (auto it = c.model().options().find(std::string(name)); it != c.model().options().end()) {
    return it->second;
  }
  const ModelEntry* m = FindModel(c.model().name());
  const ModelOption* o = m == nullptr ? nullptr : FindOption(*m, name);
  return o == nullptr ? "" : o->default_value;
}

absl::StatusOr<uint32_t> ModelOptionUint32(const control::TrainingConfig& c, absl::string_view name,
                                           uint32_t min, uint32_t max) {
  const std::string text = ModelOptionValue(c, name);
  uint32_t v = 0;
  if (!absl::SimpleAtoi(text, &v) || v < min || v > max) {
    return ModelOptionError(
        c, name, absl::StrCat("'", text, "' is not an integer in [", min, ", ", max, "]"));
  }
  return v;
}

absl::Status ModelOptionError(const control::TrainingConfig& c, absl::string_view option,
                              absl::string_view why) {
  return absl::InvalidArgumentError(
      absl::StrCat("--model_options: ", c.model().name(), ": ", option, ": ", why));
}

}  // namespace onebit
