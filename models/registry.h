// The built-in models: one entry each in one table (models/registry.cc), so
// that resolving and checking the config, --help and NewModel need no code
// of their own per model. A model's settings are either job settings of
// their own (synthetic's and mlp's flags, which predate the registry) or
// options it declares here, given in TrainingConfig.model_options
// (--model_options name=value,...).
//
// Adding a built-in model: its file(s) in models/ defining
// `extern const ModelEntry kFooModel` (softmax_model.cc is a small example),
// and one line in registry.cc's table. The table is explicit because a
// static initialiser that registers itself is dropped by the linker from a
// static library when nothing else refers to its file.
#ifndef ONEBIT_MODELS_REGISTRY_H_
#define ONEBIT_MODELS_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "models/model.h"
#include "proto/control.pb.h"

namespace onebit {

// --model external: the workers' own program (the library's Worker), not a
// registered model: the workers declare d when they register, and steps 0
// means "until every worker finishes".
inline constexpr char kExternalModel[] = "external";

// One option of a model, in model_options.
struct ModelOption {
  const char* name;           // [a-z0-9_]+
  const char* default_value;  // filled in when the config is resolved
  const char* help;
};

struct ModelEntry {
  const char* name;  // the --model value
  const char* help;  // one line, for --help
  // The job settings of its own that it reads, for --help ("--dim --noise"),
  // "" when its options are all in model_options.
  const char* settings;
  absl::Span<const ModelOption> options;
  // Its parameter count d, known before any worker has built the model (the
  // shard map needs it). Errors as for validate.
  absl::StatusOr<uint64_t> (*num_params)(const control::TrainingConfig& config);
  // Checks its settings and options; errors start "--<setting>: " (or
  // ModelOptionError's prefix). nullptr: nothing to check.
  absl::Status (*validate)(const control::TrainingConfig& config);
  // Steps of one epoch over its training data (for --epochs and
  // --eval_every); nullptr where it has no data set.
  absl::StatusOr<uint64_t> (*epoch_steps)(const control::TrainingConfig& config);
  // Builds the model from a resolved, valid config.
  absl::StatusOr<std::unique_ptr<Model>> (*make)(const control::TrainingConfig& config);
  // The ends of its tensors in x, in order, the last one d (the layers of
  // layer-wise optimizers such as onebit-lamb). nullptr: one tensor, all of x.
  absl::StatusOr<std::vector<uint64_t>> (*layer_ends)(const control::TrainingConfig& config) =
      nullptr;
};

// Every built-in model, in --help order.
absl::Span<const ModelEntry* const> RegisteredModels();

// The entry called `name`, or nullptr (also for kExternalModel).
const ModelEntry* FindModel(absl::string_view name);

// "--model: unknown model 'x' (want synthetic, mlp, ... or external)".
absl::Status UnknownModelError(absl::string_view name);

// For a registered config.model().name(): refuses an option in model_options that
// the model does not declare, then fills in the defaults of the ones not
// given. Other models are left alone (ValidateModelConfig names them).
absl::Status ResolveModelOptions(control::TrainingConfig* config);

// The ends of the tensors of a registered config.model().name() (ModelEntry::
// layer_ends; one tensor where it declares none); empty for other models
// (an external model's workers declare theirs).
absl::StatusOr<std::vector<uint64_t>> ModelLayerEnds(const control::TrainingConfig& config);

// The model's part of ValidateConfig: a registered name (or external, which
// takes no options), only declared options, and the entry's own checks.
absl::Status ValidateModelConfig(const control::TrainingConfig& config);

// Option `name` of config.model().name() as given, else its declared default.
// Requires a registered model that declares `name`.
std::string ModelOptionValue(const control::TrainingConfig& config, absl::string_view name);

// The option as an unsigned integer in [min, max], or an error naming it.
absl::StatusOr<uint32_t> ModelOptionUint32(const control::TrainingConfig& config,
                                           absl::string_view name, uint32_t min, uint32_t max);

// InvalidArgument "--model_options: <model>: <option>: <why>".
absl::Status ModelOptionError(const control::TrainingConfig& config, absl::string_view option,
                              absl::string_view why);

}  // namespace onebit

#endif  // ONEBIT_MODELS_REGISTRY_H_
