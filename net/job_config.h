// The one training config of a job (proto TrainingConfig), built from flags
// and/or a JSON file (--config, keys are flag names). Defined here because the
// coordinator owns it and onebit-launch forwards it.
#ifndef ONEBIT_NET_JOB_CONFIG_H_
#define ONEBIT_NET_JOB_CONFIG_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/control.pb.h"
#include "shard/optimizer.h"

namespace onebit {

// Builds the config from the config flags. Values in the --config JSON file
// apply unless the same flag was given on the command line (`specified`).
// Errors name the flag or JSON key, e.g. "--dim: must be >= 1".
absl::StatusOr<control::TrainingConfig> ConfigFromFlags(const std::set<std::string>& specified);

// What the binaries that take the training flags start with: parses the
// command line (net/flags.h) and builds the config; exits 2 naming the
// problem when either fails.
control::TrainingConfig ConfigFromCommandLineOrExit(int argc, char** argv, absl::string_view usage);

// Checks ranges and combinations; errors start with "--<flag>: ".
absl::Status ValidateConfig(const control::TrainingConfig& config);

// Fashion-MNIST's training images: the mlp's epoch, before --max_train.
inline constexpr uint64_t kFashionMnistTrain = 60000;

// Parameters of an mlp with these layer widths ("784-256-128-10"): each
// layer's weights and biases. Errors name --layers.
absl::StatusOr<uint64_t> MlpParamCount(absl::string_view layers);

// The optimizer and freeze settings of a (validated) config.
absl::StatusOr<OptimizerOptions> OptimizerOptionsFromConfig(const control::TrainingConfig& config);
absl::StatusOr<FreezeOptions> FreezeOptionsFromConfig(const control::TrainingConfig& config);

// "--name=value" for every config flag (and --config), for forwarding.
std::vector<std::string> ConfigFlagArgs();

// Extracts the flag name from a ValidateConfig/ConfigFromFlags error, for
// ExitFlagError; "config" when none.
std::string FlagOfError(const absl::Status& status);

}  // namespace onebit

#endif  // ONEBIT_NET_JOB_CONFIG_H_
