// The --config file of the job settings: JSON whose keys
// are setting names (dashes or underscores), with an "onebit" section that
// holds settings too, so a DeepSpeed config gains one section rather than
// being rewritten. DeepSpeed's own keys are mapped where they mean something
// here (the optimizer section), ignored where they do not (batch sizes,
// logging, fp16 switched off), and refused where they contradict this job
// (ZeRO, fp16/bf16 on, gradient clipping or accumulation).
#ifndef ONEBIT_JOB_CONFIG_FILE_H_
#define ONEBIT_JOB_CONFIG_FILE_H_

#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/control.pb.h"

namespace onebit {

// Sets the file's settings in *config and adds their names to *given; the
// DeepSpeed keys it ignored go to *ignored as dotted paths
// ("optimizer.params.cuda_aware"). Settings of our own win over what a
// DeepSpeed key maps to. Errors start with "--config: " or "--<setting>: ".
absl::Status LoadConfigFile(const std::string& path, control::TrainingConfig* config,
                            std::set<std::string>* given, std::vector<std::string>* ignored);
// The same for JSON text; `where` names it in errors.
absl::Status LoadConfigJson(const std::string& json, const std::string& where,
                            control::TrainingConfig* config, std::set<std::string>* given,
                            std::vector<std::string>* ignored);

}  // namespace onebit

#endif  // ONEBIT_JOB_CONFIG_FILE_H_
