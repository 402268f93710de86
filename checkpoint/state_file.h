// One process's part of a checkpoint: a state file of named arrays (a
// server's x, m, v and error over its range; a worker's error and momentum)
// and a few scalars, each array checksummed, written atomically.
//
// Layout (little-endian): "OBSTATE1", u32 H, H bytes of a serialized
// checkpoint.StateHeader, u32 zlib crc32 of those H bytes, then the
// sections' bytes at the offsets the header gives. The whole file's crc32
// and size go into the checkpoint's manifest (checkpoint/checkpoint_dir.h).
//
// Not thread-safe; a StateWriter may be filled on one thread and written on
// another (what the asynchronous checkpoint does) once filling is over.
#ifndef ONEBIT_CHECKPOINT_STATE_FILE_H_
#define ONEBIT_CHECKPOINT_STATE_FILE_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "proto/checkpoint.pb.h"

namespace onebit {

// 2: the manifest's TrainingConfig nested by concern (proto/control.proto);
// a format 1 checkpoint holds the flat config of older builds.
inline constexpr uint32_t kCheckpointFormat = 2;

// A written file as the manifest lists it.
struct WrittenFile {
  std::string name;  // base name
  uint64_t size = 0;
  uint32_t crc32 = 0;
  double seconds = 0;  // how long writing it took (AsyncStateWriter sets it)
};

// Arrays for a snapshot: a copy of `values`, or n zeros, whose pages the
// kernel may back with transparent huge pages (a fresh multi-MB copy
// otherwise faults in 4 KB pages one at a time). Thread-safe.
std::vector<float> SnapshotFloats(absl::Span<const float> values);
std::vector<float> SnapshotZeros(size_t n);

// The buffers of a process's last snapshot, kept for its next one: a
// snapshot copied into memory already mapped runs at 5 GB/s here, into
// fresh memory at 1-3 GB/s, on the step loop's time. Holds at most
// `max_held` arrays between checkpoints (one snapshot's: the state's size
// again, resident). Thread-safe.
class SnapshotBuffers {
 public:
  explicit SnapshotBuffers(size_t max_held) : max_held_(max_held) {}
  // A copy of `values`, in a kept buffer when one is large enough.
  std::vector<float> Copy(absl::Span<const float> values);
  // n floats of unspecified value, for the caller to overwrite.
  std::vector<float> Take(size_t n);
  // Keeps `v` for a later Copy or Take (or frees it when max_held are kept).
  void Give(std::vector<float>&& v);

 private:
  std::optional<std::vector<float>> Fitting(size_t n);
  const size_t max_held_;
  absl::Mutex mu_;
  std::vector<std::vector<float>> held_ ABSL_GUARDED_BY(mu_);
};

// Collects a snapshot: Add* copy the data (or take it), so the caller may
// go on changing its own arrays at once. The checksums are computed by
// WriteTo, on whichever thread writes: the step loop pays for one copy.
class StateWriter {
 public:
  // header: step, role, rank, range and values; sections are filled here.
  explicit StateWriter(checkpoint::StateHeader header);
  // Gives the taken arrays to `buffers` (when set) for the next snapshot.
  ~StateWriter();
  StateWriter(StateWriter&&) = default;
  StateWriter& operator=(StateWriter&&) = default;

  // Where the taken arrays go when this is destroyed (after its write).
  void ReturnBuffersTo(std::shared_ptr<SnapshotBuffers> buffers) { buffers_ = std::move(buffers); }

  void AddFloats(absl::string_view name, absl::Span<const float> values);
  // Takes the values without copying them.
  void AddFloats(absl::string_view name, std::vector<float>&& values);
  void AddBytes(absl::string_view name, absl::string_view bytes);
  void SetValue(absl::string_view key, absl::string_view value);

  // Writes dir/name through a temporary file, fsync, rename and an fsync of
  // dir. Errors name the path.
  absl::StatusOr<WrittenFile> WriteTo(const std::string& dir, const std::string& name) const;

  uint64_t payload_bytes() const { return payload_bytes_; }

 private:
  void AddSection(absl::string_view name, uint64_t size);

  checkpoint::StateHeader header_;  // the sections' crc32s are filled in by WriteTo
  // Each section's bytes, in order: copied bytes or taken floats.
  std::vector<std::variant<std::string, std::vector<float>>> sections_;
  uint64_t payload_bytes_ = 0;
  std::shared_ptr<SnapshotBuffers> buffers_;
};

// A state file read back and checked: the magic, the header's checksum and
// every section's. Errors name the path and, for a section, its name.
class StateReader {
 public:
  static absl::StatusOr<StateReader> Open(const std::string& path);

  const checkpoint::StateHeader& header() const { return header_; }
  // The value of `key`; an error naming the file when missing.
  absl::StatusOr<std::string> Value(absl::string_view key) const;
  // The section `name` as floats; `count` (when not UINT64_MAX) must match.
  absl::StatusOr<std::vector<float>> Floats(absl::string_view name,
                                            uint64_t count = UINT64_MAX) const;
  absl::StatusOr<std::string> Bytes(absl::string_view name) const;

 private:
  StateReader(std::string path, checkpoint::StateHeader header, std::string payload)
      : path_(std::move(path)), header_(std::move(header)), payload_(std::move(payload)) {}
  absl::StatusOr<absl::string_view> Section(absl::string_view name) const;

  std::string path_;
  checkpoint::StateHeader header_;
  std::string payload_;
};

// The 4 bytes of v, least significant first, as the files store counts
// and checksums; and back.
std::string LittleEndianU32(uint32_t v);
uint32_t ReadLittleEndianU32(const char* p);

// zlib crc32 of bytes, continuing from `crc` (0 to start).
uint32_t Crc32(absl::string_view bytes, uint32_t crc = 0);

// Writes `bytes` to dir/name atomically (temporary name, fsync, rename,
// fsync of dir); returns its size and crc32. Bypasses the page cache
// (O_DIRECT) where the file system allows it. Thread-safe for distinct
// names.
absl::StatusOr<WrittenFile> WriteFileAtomically(const std::string& dir, const std::string& name,
                                                absl::Span<const absl::string_view> parts);

}  // namespace onebit

#endif  // ONEBIT_CHECKPOINT_STATE_FILE_H_
