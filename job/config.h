// The one training config of a job (proto TrainingConfig): its settings are
// the rows of job/settings.h, given as flags and/or a JSON file (--config,
// which also reads DeepSpeed configs). Defined here because the coordinator
// owns it and onebit-launch forwards it.
//
// Two libraries: onebit_net has everything flag-free (validation, the
// optimizer and freeze options a worker needs); onebit_cli, linked only
// by the binaries that take the job settings, has the command line and the
// file (the functions marked so below).
#ifndef ONEBIT_JOB_CONFIG_H_
#define ONEBIT_JOB_CONFIG_H_

#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "job/settings.h"
#include "models/registry.h"
#include "optim/optimizer.h"
#include "proto/control.pb.h"
#include "shard/shard_map.h"

namespace onebit {

// onebit_cli: builds the config from job-setting arguments ("--lr=0.1",
// "--lr", "0.1", "--bias-correction", "--nobias_correction", "--config=FILE").
// Values in the --config file apply unless an argument gives the same
// setting (the command line wins). DeepSpeed keys of the file that have no
// meaning here go to *ignored (may be null) as dotted paths. Errors name the
// flag or key, e.g. "--dim: must be >= 1".
absl::StatusOr<control::TrainingConfig> ConfigFromFlags(
    const std::vector<std::string>& args, std::vector<std::string>* ignored = nullptr);

// onebit_cli: what the binaries that take the job settings start with:
// parses the command line (job/flags.h: the binary's own flags and the job
// settings) and builds the config; prints the ignored DeepSpeed keys once;
// exits 2 naming the problem when either fails. *given (may be null): the
// settings the command line or its --config file set.
control::TrainingConfig ConfigFromCommandLineOrExit(int argc, char** argv, absl::string_view usage,
                                                    std::set<std::string>* given = nullptr);

// onebit_cli: "--name=value" for each setting the command line (or its
// --config file) gave to ConfigFromCommandLineOrExit, with its resolved
// value, for forwarding to another binary: it resolves the rest the same
// way, and still knows which settings the job left at their defaults.
std::vector<std::string> ConfigFlagArgs();

// "--name=value" for every setting of `config` but those another optimizer
// alone reads (JobSetting::only_for: refused for this one, so a resolved
// config holds their defaults); ConfigFromFlags of them gives `config` back
// when it is resolved.
std::vector<std::string> ConfigFlagArgs(const control::TrainingConfig& config);

// Fills in what the settings imply, so every process sees one resolved
// config: through the model's registry entry (models/registry.h) its
// options' defaults, its d, and for a model with a data set the steps of
// --epochs and the evaluation period; an external model's d; the
// optimizer's codecs, reply and freeze. `given`: the settings set
// explicitly (command line or file).
absl::Status ResolveConfig(const std::set<std::string>& given, control::TrainingConfig* config);

// Settings that the workers' own program declares for the job (e.g. the
// PyTorch front's constructor arguments), name -> value as the flags take
// them, applied to a resolved `config` whose explicitly set settings are
// `given`. Where the job set a setting itself, the workers must declare the
// same value; the rest are theirs, and the config is resolved again so that
// what a setting implies follows (another optimizer's codecs and freeze).
// Only the optimizer and compression settings may be declared. On success
// *config and *given are updated; on error (an unknown or foreign setting, a
// bad value, a contradiction: "--beta2: the job sets 0.999 and the workers
// declare 0.99; give it in one place") neither changes.
absl::Status ApplyDeclaredSettings(const std::map<std::string, std::string>& declared,
                                   std::set<std::string>* given, control::TrainingConfig* config);

// The settings whose values differ between two configs, as
// "--name: A (here) vs B (there)", in --help order; empty when none. A
// checkpoint resumes only into the config that wrote it, save the
// settings in `ignore` (e.g. steps, a longer run).
std::vector<std::string> ConfigDifferences(const control::TrainingConfig& here,
                                           const control::TrainingConfig& there,
                                           const std::set<std::string>& ignore = {});

// Checks ranges and combinations; errors start with "--<flag>: ".
absl::Status ValidateConfig(const control::TrainingConfig& config);

// kExternalModel (--model external) is in models/registry.h.
// The largest d a job may have.
inline constexpr uint64_t kMaxParams = uint64_t{1} << 34;

// The job's shard map (shard/shard_map.h): S shards of blocks, or for a
// layer-wise optimizer (onebit-lamb) shards of whole layers, from
// layer_ends (ModelLayerEnds, or what an external model's workers
// declared); an error names a model without layers.
absl::StatusOr<ShardMap> ShardMapForConfig(const control::TrainingConfig& config,
                                           const std::vector<uint64_t>& layer_ends);

// The optimizer and freeze settings of a (validated) config.
absl::StatusOr<OptimizerOptions> OptimizerOptionsFromConfig(const control::TrainingConfig& config);
absl::StatusOr<FreezeOptions> FreezeOptionsFromConfig(const control::TrainingConfig& config);

// Whether a secured job's data plane is sealed (--data_cipher aes-gcm,
// security/data_seal.h) rather than CURVE's. Meaningless under --insecure.
inline bool DataPlaneSealed(const control::TrainingConfig& config) {
  return config.compression().data_cipher() == control::DATA_CIPHER_AES_GCM;
}

// How the config ends its warm-up, for summary.json's "freeze": "none" for
// an optimizer that never compresses, "var_freeze_step:N" for
// zero-one-adam, else "step:N" or the --freeze rule as given.
std::string FreezeText(const control::TrainingConfig& config);

}  // namespace onebit

#endif  // ONEBIT_JOB_CONFIG_H_
