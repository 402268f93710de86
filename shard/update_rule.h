// Per-shard optimizer state and the update rules a server applies to it
// (DESIGN.md §1.1): SGD and Adam in fp32. Compiled with -ffp-contract=off so
// the server, the workers and the single-process reference round identically.
//
// ShardState is a plain struct (vectors and counters, no pointers into other
// objects) so it can be saved and restored as is. An UpdateRule is immutable
// and thread-safe; it keeps no state of its own.
#ifndef ONEBIT_SHARD_UPDATE_RULE_H_
#define ONEBIT_SHARD_UPDATE_RULE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace onebit {

enum class UpdateKind : uint8_t { kSgd = 1, kAdam = 2 };

struct UpdateOptions {
  UpdateKind kind = UpdateKind::kSgd;
  float lr = 0.01f;  // constant learning rate
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;  // decoupled (Adam only): Δ += -lr * wd * x
};

// The master copy of one shard: x[0, size) holds global elements
// [begin, begin + size). `step` counts completed steps.
struct ShardState {
  uint32_t shard = 0;
  uint64_t begin = 0;
  uint64_t step = 0;
  std::vector<float> x;
  std::vector<float> m;  // Adam first moment (empty for SGD)
  std::vector<float> v;  // Adam second moment (empty for SGD)
};

class UpdateRule {
 public:
  virtual ~UpdateRule() = default;
  virtual absl::string_view name() const = 0;

  // Sizes the rule's moments to x.size(), zero-filled.
  virtual void InitState(ShardState* state) const = 0;

  // For shard-local elements [offset, offset + n), given the averaged gradient
  // g[0, n): computes delta[0, n) and applies x += delta. Elementwise, so a
  // shard may be updated chunk by chunk in any order. Requires
  // offset + n <= state->x.size() and InitState() called.
  virtual void Apply(const float* g, uint64_t offset, size_t n, ShardState* state,
                     float* delta) const = 0;
};

// "sgd" or "adam".
absl::StatusOr<UpdateKind> ParseUpdateKind(absl::string_view name);
absl::StatusOr<std::unique_ptr<const UpdateRule>> NewUpdateRule(const UpdateOptions& options);

}  // namespace onebit

#endif  // ONEBIT_SHARD_UPDATE_RULE_H_
