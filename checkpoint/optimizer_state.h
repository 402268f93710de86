// The optimizers' state (optim/optimizer.h) in state files: a server's shard
// by global range, so that a checkpoint of S servers restores onto any
// other number of shards, and a worker's own state.
//
// A server file holds every per-element array of its shard (x, m, v, den,
// e, v_check, replica; an empty one is absent), a layer-wise optimizer's
// per-layer values (lamb_coeff, lamb_factor, and as `layers` each layer's
// global range, so that they restore onto other shard boundaries) and, as
// values, step, frozen and floored. A worker file holds mbar, e, den, v,
// x_sync and the value lrs where its optimizer keeps them, and x where no
// other file holds it (WorkerFileOmits).
//
// Format: these sections and values came with zero-one-adam's and
// onebit-lamb's checkpoints, under the same kCheckpointFormat: a file is
// read by name, every file written before them holds the arrays its
// optimizer needs, and whether a restored state has all it needs is
// checked where the optimizer is known (CheckWorkerStateFits, and the
// server's shard against a fresh one). Functions only; thread-compatible.
#ifndef ONEBIT_CHECKPOINT_OPTIMIZER_STATE_H_
#define ONEBIT_CHECKPOINT_OPTIMIZER_STATE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "checkpoint/state_file.h"
#include "optim/optimizer.h"

namespace onebit {

// A snapshot of the shard (copied; the server may go on at once). Without
// `with_den`, den is left out: after onebit-adam's freeze it is a function
// of the frozen v (RestoreDenominators makes it again, bit for bit).
// `buffers` (may be null): where the copies come from and go back to.
// `step`: the step the file is of where not s.step, an earlier one whose
// state is the same (a local step the shard has skipped).
StateWriter SaveServerShard(const ServerShardState& s, bool with_den = true,
                            std::shared_ptr<SnapshotBuffers> buffers = nullptr,
                            std::optional<uint64_t> step = std::nullopt);
// den = FrozenDenominator(v, eps) where a frozen shard has v and lacks den
// (loaded from a file saved without it); an error names a negative v.
absl::Status RestoreDenominators(float eps, ServerShardState* s);

// Rebuilds the shard [begin, end) from the servers' files of one checkpoint
// (any number, in any order): together they must cover [begin, end) and
// agree on step and phase. *s keeps its shard number; its begin, step, phase
// and arrays come from the files. `floored` (a statistic) goes to the shard
// holding the first element of each file's range. Errors name the file.
absl::Status LoadServerShard(const std::vector<const StateReader*>& files, uint64_t begin,
                             uint64_t end, ServerShardState* s);
// The same for the arrays named in `only` (e.g. {"den"}; empty: all), the
// others left empty.
absl::Status LoadServerArrays(const std::vector<const StateReader*>& files, uint64_t begin,
                              uint64_t end, const std::vector<std::string>& only,
                              ServerShardState* s);

// What a worker's file leaves out because the checkpoint holds it
// elsewhere, bit for bit: under a momentum reply every worker's mbar is the
// servers' decoded reply, the same on all (worker 0's file holds it); the
// frozen denominators of onebit-adam are the servers' (their files hold
// them); x is the servers' (the master, or the replica they keep), except
// where a worker trains a local model between synchronisations
// (AlgorithmTraits::local_model: zero-one-adam), whose x and mbar are its
// own.
struct WorkerFileOmits {
  bool mbar = false;
  bool den = false;
  bool x = true;
};
WorkerFileOmits WorkerOmits(const OptimizerOptions& o, uint32_t rank);

// Fills in what a worker's file left out (WorkerOmits): mbar from
// `worker0` (worker 0's file) and den from `servers` (every server file of
// the checkpoint: their den, or their frozen v and `eps`), where *s needs
// them and lacks them. Errors name the file.
absl::Status CompleteWorkerState(const StateReader& worker0,
                                 const std::vector<const StateReader*>& servers, uint64_t d,
                                 float eps, WorkerState* s);

// A worker's state except x, which the servers hold (the master, or under
// --server-reply delta the replica they keep): mbar, e, den, v, x_sync (and
// with it lrs), frozen, each where non-empty; and `step`, its completed
// steps.
StateWriter SaveWorkerState(const WorkerState& s, uint32_t rank, uint64_t step);
// The same, taking the arrays, x too where non-empty (`d` is the model's
// size).
StateWriter SaveWorkerState(WorkerState&& s, uint32_t rank, uint64_t step, uint64_t d);

// Restores the arrays the file holds (mbar, e, den, v, x_sync, x), lrs and
// frozen into *s, whose x the caller fills where the file has none; the
// sizes must be d. Whether they are all the optimizer needs is
// CheckWorkerStateFits's to say. Errors name the file.
absl::Status LoadWorkerState(const StateReader& file, uint64_t d, WorkerState* s);

// The same for a job resumed with another number of workers than wrote
// the checkpoint: `paths` are every old worker's file, by rank. New rank
// `rank` takes the momentum, den and phase of old rank rank mod N, and every
// new worker starts with the mean of the old workers' errors: the error
// feedback still owed to the workers' average is kept, spread evenly.
// Files are read one at a time. Errors name the file.
absl::Status LoadWorkerStateResized(const std::vector<std::string>& paths, uint32_t rank,
                                    uint64_t d, WorkerState* s);

}  // namespace onebit

#endif  // ONEBIT_CHECKPOINT_OPTIMIZER_STATE_H_
