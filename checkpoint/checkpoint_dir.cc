#include "checkpoint/checkpoint_dir.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <system_error>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "checkpoint/state_file.h"

namespace onebit {
namespace {

constexpr char kManifestMagic[] = "OBMANIF1";
constexpr size_t kMagicSize = 8;

absl::StatusOr<std::string> ReadWhole(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, " is missing"));
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The step folders under root, newest first.
std::vector<std::pair<uint64_t, std::string>> StepDirs(const std::string& root) {
  std::vector<std::pair<uint64_t, std::string>> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    uint64_t step = 0;
    if (!e.is_directory() || name.rfind("step-", 0) != 0 ||
        !absl::SimpleAtoi(name.substr(5), &step)) {
      continue;
    }
    out.emplace_back(step, e.path().string());
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

}  // namespace

std::string StepDir(const std::string& root, uint64_t step) {
  return absl::StrFormat("%s/step-%012d", root, step);
}

absl::StatusOr<std::string> MakeStepDir(const std::string& root, uint64_t step) {
  const std::string dir = StepDir(root, step);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  return dir;
}

absl::Status WriteManifest(const std::string& step_dir, const checkpoint::Manifest& manifest) {
  const std::string body = manifest.SerializeAsString();
  const std::string crc = LittleEndianU32(Crc32(body));
  const absl::string_view parts[] = {absl::string_view(kManifestMagic, kMagicSize), crc, body};
  return WriteFileAtomically(step_dir, kManifestName, parts).status();
}

namespace {

// `checksums`: read every file for its crc32; else sizes only.
absl::StatusOr<checkpoint::Manifest> Check(const std::string& step_dir, bool checksums) {
  const std::string path = absl::StrCat(step_dir, "/", kManifestName);
  auto text = ReadWhole(path);
  if (!text.ok()) {
    return absl::NotFoundError(absl::StrCat(path, " is missing: the checkpoint is incomplete"));
  }
  if (text->size() < kMagicSize + 4 || text->compare(0, kMagicSize, kManifestMagic) != 0) {
    return absl::DataLossError(absl::StrCat(path, ": not a onebit-ps manifest"));
  }
  const absl::string_view body = absl::string_view(*text).substr(kMagicSize + 4);
  checkpoint::Manifest m;
  if (ReadLittleEndianU32(text->data() + kMagicSize) != Crc32(body) ||
      !m.ParseFromArray(body.data(), static_cast<int>(body.size()))) {
    return absl::DataLossError(absl::StrCat(path, ": does not match its checksum"));
  }
  if (m.format() != kCheckpointFormat) {
    // Not damaged: another build's. Refused rather than skipped, so that a
    // job never starts afresh over (and prunes) checkpoints it cannot read.
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": checkpoint format ", m.format(),
                     " of another onebit-ps build; this build reads ", kCheckpointFormat,
                     ": resume it with the build that wrote it, or give another "
                     "--checkpoint_dir"));
  }
  for (const checkpoint::ManifestFile& f : m.files()) {
    const std::string file = absl::StrCat(step_dir, "/", f.name());
    std::error_code ec;
    const uint64_t size = std::filesystem::file_size(file, ec);
    if (ec) return absl::NotFoundError(absl::StrCat(file, " is missing"));
    if (size != f.size()) {
      return absl::DataLossError(
          absl::StrCat(file, ": ", size, " bytes, the manifest says ", f.size(), " (truncated?)"));
    }
    if (!checksums) continue;
    auto bytes = ReadWhole(file);
    if (!bytes.ok()) return bytes.status();
    if (Crc32(*bytes) != f.crc32()) {
      return absl::DataLossError(absl::StrCat(file, ": does not match its checksum"));
    }
  }
  return m;
}

}  // namespace

absl::StatusOr<checkpoint::Manifest> VerifyCheckpoint(const std::string& step_dir) {
  return Check(step_dir, /*checksums=*/true);
}

absl::StatusOr<CompleteCheckpoint> LatestCheckpoint(const std::string& root,
                                                    std::vector<std::string>* refused) {
  for (const auto& [step, dir] : StepDirs(root)) {
    auto m = VerifyCheckpoint(dir);
    if (m.ok()) return CompleteCheckpoint{dir, *std::move(m)};
    if (absl::IsFailedPrecondition(m.status())) return m.status();
    if (refused != nullptr) refused->push_back(absl::StrCat(dir, ": ", m.status().message()));
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", root));
}

bool HasCompleteCheckpoint(const std::string& root) {
  for (const auto& [step, dir] : StepDirs(root)) {
    if (Check(dir, /*checksums=*/false).ok()) return true;
  }
  return false;
}

absl::Status PruneCheckpoints(const std::string& root, int keep, bool nothing_in_making) {
  if (keep < 1) return absl::InvalidArgumentError("PruneCheckpoints: keep must be >= 1");
  int complete = 0;
  for (const auto& [step, dir] : StepDirs(root)) {
    const bool ok = Check(dir, /*checksums=*/false).ok();  // reading them all would be slow
    // Newer than every complete one: maybe being written now.
    if (complete == 0 && !ok && !nothing_in_making) continue;
    if (ok && complete < keep) {
      ++complete;
      continue;
    }
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    if (ec) return absl::InternalError(absl::StrCat("cannot remove ", dir, ": ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status RemoveIncompleteCheckpoint(const std::string& root, uint64_t step) {
  const std::string dir = StepDir(root, step);
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return absl::OkStatus();
  // Never a complete one: the step's parts may have been reported twice.
  if (Check(dir, /*checksums=*/false).ok()) return absl::OkStatus();
  std::filesystem::remove_all(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot remove ", dir, ": ", ec.message()));
  return absl::OkStatus();
}

}  // namespace onebit
