// A job's checkpoints under one root folder:
//   ROOT/step-000000000120/server-0.state, ..., worker-3.state, MANIFEST
// Each process writes its state file into the step's folder
// (checkpoint/state_file.h); the coordinator writes MANIFEST last, listing
// every file with its size and crc32. Only a folder whose manifest parses
// and whose files all match it is a complete checkpoint.
//
// Functions only (no state); safe to call from any thread, but two writers
// of one root must not prune at the same time.
#ifndef ONEBIT_CHECKPOINT_CHECKPOINT_DIR_H_
#define ONEBIT_CHECKPOINT_CHECKPOINT_DIR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/checkpoint.pb.h"

namespace onebit {

inline constexpr char kManifestName[] = "MANIFEST";

// ROOT/step-<12 digits>; created (with parents) by MakeStepDir.
std::string StepDir(const std::string& root, uint64_t step);
absl::StatusOr<std::string> MakeStepDir(const std::string& root, uint64_t step);

// Writes the manifest (binary protobuf after the magic "OBMANIF1" and its
// crc32) atomically into `step_dir`.
absl::Status WriteManifest(const std::string& step_dir, const checkpoint::Manifest& manifest);

// Reads and checks the manifest and every file it lists (size, crc32).
// Errors name the file and what is wrong with it; FailedPrecondition for a
// checkpoint of another format (another build's, not damaged).
absl::StatusOr<checkpoint::Manifest> VerifyCheckpoint(const std::string& step_dir);

struct CompleteCheckpoint {
  std::string dir;
  checkpoint::Manifest manifest;
};

// The newest complete checkpoint under root; NotFound when there is none;
// FailedPrecondition (naming it) when one of another format comes first.
// Every newer folder that was refused goes to *refused (may be null) as
// "<dir>: <why>".
absl::StatusOr<CompleteCheckpoint> LatestCheckpoint(const std::string& root,
                                                    std::vector<std::string>* refused);

// Whether root holds a complete checkpoint by the cheap test (the manifest
// and every file's size, not the checksums): something to roll back to.
bool HasCompleteCheckpoint(const std::string& root);

// Keeps the newest `keep` complete checkpoints (keep >= 1; complete here:
// the manifest and every file's size, not the checksums) and, unless
// `nothing_in_making` (no process writes any more: the job has ended),
// any folder newer than the newest complete one (it may be in the making);
// removes the rest, incomplete folders included.
absl::Status PruneCheckpoints(const std::string& root, int keep, bool nothing_in_making = false);

// Removes ROOT/step-<step> and what is in it (the files of a checkpoint
// that failed), unless it is complete; OK when it is not there. Errors
// name the folder.
absl::Status RemoveIncompleteCheckpoint(const std::string& root, uint64_t step);

}  // namespace onebit

#endif  // ONEBIT_CHECKPOINT_CHECKPOINT_DIR_H_
