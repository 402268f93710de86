// What the workers declare when they register, reconciled: the parameter
// count d (--model external), the weight-decay and lr-scale ranges, the
// tensors, the job settings their program sets, and the tensors outside the
// optimizer. The first worker's declarations stand; every other worker must
// declare the same, or is refused naming both.
//
// Not thread-safe: CoordinatorService calls it under its mutex.
#ifndef ONEBIT_COORDINATOR_DECLARED_SETTINGS_H_
#define ONEBIT_COORDINATOR_DECLARED_SETTINGS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "optim/optimizer.h"
#include "proto/control.pb.h"

namespace onebit {

class DeclaredSettings {
 public:
  // Worker `rank`'s declarations against the job's `config` and the first
  // worker's, in this order: d, the weight-decay ranges, the tensors, the
  // settings, the local state. The first worker to declare d sets
  // config->model().dim() (--model external); its settings are tried against
  // `config` with `given` (the settings the job set itself), so that a
  // contradiction shows at once. `formed`: the job has formed already (the
  // first worker too must then declare what it did).
  absl::Status Check(uint32_t rank, const control::RegisterRequest& req, bool formed,
                     const std::set<std::string>& given, control::TrainingConfig* config);

  // The first worker's, once one has registered.
  const std::vector<DecayRange>& decay() const { return decay_; }
  const std::vector<LrScaleRange>& lr_scale() const { return lr_scale_; }
  const std::vector<uint64_t>& layers() const { return layers_; }  // their ends
  const std::map<std::string, std::string>& settings() const { return settings_; }
  // settings() as flags ("--lr=0.01 --steps=10"), or "none".
  std::string SettingsText() const;

 private:
  absl::Status CheckParams(uint32_t rank, uint64_t d, control::TrainingConfig* config);
  // Both kinds of range: the weight decay's and the lr scale's.
  absl::Status CheckRanges(uint32_t rank, const control::RegisterRequest& req);
  absl::Status CheckLayers(uint32_t rank, const control::RegisterRequest& req);
  absl::Status CheckSettings(uint32_t rank, const control::RegisterRequest& req, bool formed,
                             const std::set<std::string>& given,
                             const control::TrainingConfig& config);
  // Tensors outside x (RegisterRequest.local_state): equal to the first
  // worker's, by name and CRC-32.
  absl::Status CheckLocalState(uint32_t rank, const control::RegisterRequest& req);

  std::optional<uint32_t> params_by_;  // first worker to declare d
  std::optional<uint32_t> decay_by_;   // first worker to register
  std::vector<DecayRange> decay_;      // its ranges
  std::vector<LrScaleRange> lr_scale_;
  std::map<std::string, std::string> settings_;  // and its settings
  std::optional<uint32_t> layers_by_;            // first to declare tensors
  std::vector<uint64_t> layers_;                 // their ends
  std::optional<uint32_t> local_state_by_;       // first to declare local state
  std::vector<control::LocalTensor> local_state_;
};

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_DECLARED_SETTINGS_H_
