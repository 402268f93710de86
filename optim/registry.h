// The optimizers onebit-ps knows, one row each (as models/registry.h does for
// models): what each one is, as traits the rest of the system asks instead of
// naming algorithms, and how to make it.
//
// Adding an optimizer takes:
//  1. a value at the end of OptimizerKind (optim/options.h), and of the
//     --optimizer setting's enum Optimizer (proto/control.proto: NAME in
//     upper case, '-' as '_', after OPTIMIZER_; job_test holds them equal);
//  2. one file, optim/NAME.cc, holding its server rule and its worker rule
//     (a subclass of Algorithm, optim/algorithm.h; or of MomentumFamily,
//     optim/momentum_family.h, when it is a warm-up followed by compressed
//     momenta), the check of its own settings and its row;
//  3. its row's function in optim/algorithms.h and in the table of
//     optim/registry.cc, and the file in optim/CMakeLists.txt;
//  4. flags for settings of its own, if it has any (job/settings.cc),
//     and its documentation (docs/design.md §1, README.md).
// Nothing else names an algorithm: servers, workers, checkpoints and the
// reference ask the traits.
//
// Thread-safe: the table is built once and never changes.
#ifndef ONEBIT_OPTIM_REGISTRY_H_
#define ONEBIT_OPTIM_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "optim/options.h"

namespace onebit {

class Algorithm;

struct AlgorithmTraits {
  OptimizerKind kind = OptimizerKind::kSgd;
  absl::string_view name;  // the --optimizer value
  // Steps before the freeze run in full precision; without a warm-up the
  // job compresses from step 0.
  bool warmup = true;
  // Leaves the warm-up: codecs other than fp32 apply, and every worker
  // keeps m̄ and its error e_w.
  bool compression = false;
  // The workers push a momentum of their own (m̄) rather than gradients.
  bool worker_momentum = false;
  // After the freeze den = sqrt(v) + eps of the frozen v, which the server
  // keeps: checkpoints leave den out and make it again from v, and the
  // workers receive v at the hand-over.
  bool den_of_frozen_v = false;
  // Steps a whole shard at once (ServerOptimizer::StepShard), with a shard
  // map aligned to the model's layers.
  bool layerwise = false;
  // Accepts --warmup_codec fp16.
  bool fp16_warmup = false;
  // The warm-up ends where its own schedule says (zero-one-adam's
  // --var_freeze_step), not at --freeze.
  bool schedule_freeze = false;
  // Needs the job's length (--steps): its last step must synchronise.
  bool needs_job_length = false;
  // After the freeze each worker trains a model of its own between
  // synchronisations (x apart from x_sync, its own m̄): no other process
  // holds them, so every worker's checkpoint file keeps its x and m̄.
  bool local_model = false;
  // Until the freeze (adam: always) the whole optimizer state is Adam's m
  // and v on the servers, bias-corrected when asked, and the workers hold
  // none: an Adam state taken elsewhere (torch's m, v and step) can seed a
  // job before its first step (data::STATE_PUSH).
  bool adam_state_on_servers = false;
  ReplyMode default_reply = ReplyMode::kMomentum;
  uint32_t default_block_size = 0;                    // 0: CodecOptions' default
  absl::string_view default_error_feedback = "both";  // --error_feedback when not given
  // The d-length fp32 arrays the state holds besides a worker's x and g, and
  // besides a server's x and chunk accumulators (for the memory check).
  std::vector<const char*> worker_arrays;
  std::vector<const char*> server_arrays;
};

struct AlgorithmRow {
  AlgorithmTraits traits;
  // Checks the settings only this algorithm reads and the combinations it
  // refuses, after the shared ones passed; errors start with "--<flag>: ".
  // nullptr: nothing of its own.
  absl::Status (*validate)(const OptimizerOptions& o) = nullptr;
  // What a diverged job of this algorithm should try; nullptr: the general
  // advice.
  std::string (*remedy)(const OptimizerOptions& o) = nullptr;
  // The algorithm, with these traits, for options that passed
  // ValidateOptimizerOptions (MakeAlgorithm<Its class>, optim/algorithm.h).
  std::unique_ptr<Algorithm> (*make)(const AlgorithmTraits& traits,
                                     const OptimizerOptions& o) = nullptr;
};

// Every row, in OptimizerKind's order.
const std::vector<const AlgorithmRow*>& AlgorithmRows();
const AlgorithmRow& RowOf(OptimizerKind kind);
inline const AlgorithmTraits& TraitsOf(OptimizerKind kind) { return RowOf(kind).traits; }

// The row named `name`; an error listing the names otherwise.
absl::StatusOr<OptimizerKind> ParseOptimizerKind(absl::string_view name);
absl::string_view OptimizerKindName(OptimizerKind kind);

// Shorthands for the traits.
inline bool HasCompressionPhase(OptimizerKind kind) { return TraitsOf(kind).compression; }
inline bool HasWarmup(OptimizerKind kind) { return TraitsOf(kind).warmup; }
inline bool IsLayerwise(OptimizerKind kind) { return TraitsOf(kind).layerwise; }
// The codec an optimizer uses when the user names none.
absl::string_view DefaultCodec(OptimizerKind kind);
// The codec block size (--block_size) an optimizer uses when the user
// names none: 256 for zero-one-adam, whose 1-bit codec carries raw
// gradients (docs/design.md §1.6); CodecOptions' 2048 for the rest.
uint32_t DefaultBlockSize(OptimizerKind kind);
// The error feedback (--error_feedback) an optimizer uses when the user
// names none: none for diloco (docs/design.md §1.8), both for the rest.
inline absl::string_view DefaultErrorFeedback(OptimizerKind kind) {
  return TraitsOf(kind).default_error_feedback;
}
// The reply mode an optimizer uses when the user names none.
inline ReplyMode DefaultReplyMode(OptimizerKind kind) { return TraitsOf(kind).default_reply; }

// Checks values and combinations, the shared settings first, then the
// algorithm's own; errors start with "--<flag>: ".
absl::Status ValidateOptimizerOptions(const OptimizerOptions& options);

// What a diverged job should try, for its error or warning: a lower --lr
// or a warm-up first, or for zero-one-adam a smaller block first.
std::string DivergenceRemedy(const OptimizerOptions& o);

// The fp32 arrays of n elements that a process holds for the whole job,
// for the memory check before allocating them (util/memory.h): at least
// this much, since buffers, snapshots and the model's own come on top.
struct StateSize {
  uint64_t bytes = 0;
  std::string arrays;  // which, e.g. "x, g, mbar, e_w"
};
// A worker's replica of d parameters: x, the gradient g, and the
// algorithm's worker arrays.
StateSize WorkerStateSize(const OptimizerOptions& options, uint64_t d);
// A server's shard of n parameters: x, the chunks' accumulators, the
// algorithm's server arrays, and the workers' replica under
// --server_reply delta.
StateSize ServerShardSize(const OptimizerOptions& options, uint64_t n);

}  // namespace onebit

#endif  // ONEBIT_OPTIM_REGISTRY_H_
