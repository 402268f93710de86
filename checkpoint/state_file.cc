#include "checkpoint/state_file.h"

#include <fcntl.h>
#include <isa-l/crc.h>
#include <sys/mman.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <variant>

#include "absl/strings/str_cat.h"

namespace onebit {
namespace {

constexpr char kMagic[] = "OBSTATE1";  // 8 bytes, no terminator on disk
constexpr size_t kMagicSize = 8;

absl::Status Errno(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat("cannot ", what, " ", path, ": ", std::strerror(errno)));
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return Errno("open", dir);
  const bool ok = fsync(fd) == 0;
  close(fd);
  if (!ok) return Errno("fsync", dir);
  return absl::OkStatus();
}

}  // namespace

std::string LittleEndianU32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

uint32_t ReadLittleEndianU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<unsigned char>(p[i])} << (8 * i);
  return v;
}

uint32_t Crc32(absl::string_view bytes, uint32_t crc) {
  // zlib's crc32, continued from `crc`, bit for bit (tested against zlib).
  return crc32_gzip_refl(crc, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size());
}

namespace {

// O_DIRECT needs the memory, the file offset and the length aligned; 4 KiB
// covers the disks' 512-byte and 4 KiB blocks.
constexpr size_t kDirectAlign = 4096;
// What one direct write hands the disk.
constexpr size_t kDirectPiece = size_t{4} << 20;

// Cleans up a temporary file that could not be written.
absl::Status Abandon(int fd, const std::string& tmp, absl::Status st) {
  close(fd);
  unlink(tmp.c_str());
  return st;
}

// Writes all of `parts` to fd through an aligned buffer under O_DIRECT, the
// tail padded to the alignment (the caller cuts the file back to *size). The page cache would cost
// a copy of every byte into fresh pages and their write-back, on the cores
// that train; a direct write costs one copy into a buffer that stays hot.
// kUnsupported where the file system refuses direct writes (nothing written).
enum class Direct { kWritten, kUnsupported, kFailed };
Direct WriteDirect(int fd, absl::Span<const absl::string_view> parts, uint64_t* size) {
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> buf(
      static_cast<char*>(std::aligned_alloc(kDirectAlign, kDirectPiece)));
  if (buf == nullptr) return Direct::kUnsupported;
  uint64_t off = 0;  // of the buffer's first byte in the file
  size_t fill = 0;
  auto flush = [&](size_t n) {
    for (size_t done = 0; done < n;) {
      const ssize_t w = pwrite(fd, buf.get() + done, n - done, static_cast<off_t>(off + done));
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0 || static_cast<size_t>(w) % kDirectAlign != 0) {
        if (w < 0 && errno == EINVAL && off == 0 && done == 0) return Direct::kUnsupported;
        if (w >= 0) errno = EIO;  // a short direct write: the disk is full or failing
        return Direct::kFailed;
      }
      done += static_cast<size_t>(w);
    }
    off += n;
    fill = 0;
    return Direct::kWritten;
  };
  for (absl::string_view part : parts) {
    while (!part.empty()) {
      const size_t n = std::min(part.size(), kDirectPiece - fill);
      std::memcpy(buf.get() + fill, part.data(), n);
      fill += n;
      part.remove_prefix(n);
      if (fill == kDirectPiece) {
        if (Direct d = flush(kDirectPiece); d != Direct::kWritten) return d;
      }
    }
  }
  const uint64_t total = off + fill;
  if (fill > 0) {
    const size_t padded = (fill + kDirectAlign - 1) / kDirectAlign * kDirectAlign;
    std::memset(buf.get() + fill, 0, padded - fill);
    if (Direct d = flush(padded); d != Direct::kWritten) return d;
  }
  *size = total;
  return Direct::kWritten;
}

// Writes `parts` to fd through the page cache, each piece handed to the
// disk as soon as it is written, so that the disk works while the rest is
// still being copied in and the fsync has little left to wait for.
bool WriteBuffered(int fd, absl::Span<const absl::string_view> parts, uint64_t* size) {
  for (absl::string_view part : parts) {
    while (!part.empty()) {
      constexpr size_t kPiece = size_t{8} << 20;
      const ssize_t n = write(fd, part.data(), std::min(part.size(), kPiece));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      (void)sync_file_range(fd, static_cast<off_t>(*size), n, SYNC_FILE_RANGE_WRITE);  // a hint
      *size += static_cast<uint64_t>(n);
      part.remove_prefix(static_cast<size_t>(n));
    }
  }
  return true;
}

// WriteFileAtomically, with the crc32 of parts[i] given as crcs[i] where
// crcs is not empty (combined, not computed again).
absl::StatusOr<WrittenFile> WriteParts(const std::string& dir, const std::string& name,
                                       absl::Span<const absl::string_view> parts,
                                       absl::Span<const uint32_t> crcs) {
  const std::string path = dir + "/" + name;
  const std::string tmp = path + ".tmp";
  WrittenFile out;
  out.name = name;
  for (size_t i = 0; i < parts.size(); ++i) {
    out.crc32 = crcs.empty() ? Crc32(parts[i], out.crc32)
                             : static_cast<uint32_t>(crc32_combine(
                                   out.crc32, crcs[i], static_cast<z_off_t>(parts[i].size())));
  }
  int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0644);
  Direct direct = Direct::kUnsupported;
  if (fd >= 0) {
    direct = WriteDirect(fd, parts, &out.size);
    if (direct == Direct::kFailed) return Abandon(fd, tmp, Errno("write", tmp));
    if (direct == Direct::kUnsupported) close(fd);
    // The padding of the last block goes.
    if (direct == Direct::kWritten && ftruncate(fd, static_cast<off_t>(out.size)) != 0) {
      return Abandon(fd, tmp, Errno("truncate", tmp));
    }
  }
  if (direct == Direct::kUnsupported) {
    fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) return Errno("create", tmp);
    out.size = 0;
    if (!WriteBuffered(fd, parts, &out.size)) return Abandon(fd, tmp, Errno("write", tmp));
  }
  // The data reaches the disk before the name does.
  if (fsync(fd) != 0) return Abandon(fd, tmp, Errno("fsync", tmp));
  // A failed close may be the first to report the disk full (a network
  // file system's deferred write): the partial file goes too.
  if (close(fd) != 0) {
    absl::Status st = Errno("close", tmp);
    unlink(tmp.c_str());
    return st;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    absl::Status st = Errno("rename", tmp);
    unlink(tmp.c_str());
    return st;
  }
  if (absl::Status st = FsyncDir(dir); !st.ok()) return st;
  return out;
}

}  // namespace

absl::StatusOr<WrittenFile> WriteFileAtomically(const std::string& dir, const std::string& name,
                                                absl::Span<const absl::string_view> parts) {
  return WriteParts(dir, name, parts, {});
}

StateWriter::StateWriter(checkpoint::StateHeader header) : header_(std::move(header)) {
  header_.set_format(kCheckpointFormat);
  header_.clear_sections();
}

void StateWriter::AddSection(absl::string_view name, uint64_t size) {
  checkpoint::Section* s = header_.add_sections();
  s->set_name(std::string(name));
  s->set_offset(payload_bytes_);
  s->set_size(size);
  payload_bytes_ += size;
}

void StateWriter::AddBytes(absl::string_view name, absl::string_view bytes) {
  AddSection(name, bytes.size());
  sections_.emplace_back(std::string(bytes));
}

namespace {

// Capacity for n floats, not yet touched, advised into huge pages when
// large (the aligned interior of the block; the rest keeps 4 KB pages).
std::vector<float> Reserved(size_t n) {
  std::vector<float> v;
  v.reserve(n);
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t p = reinterpret_cast<uintptr_t>(v.data());
  const uintptr_t b = (p + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (p + n * sizeof(float)) & ~(kHuge - 1);
  if (e > b) (void)madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);  // advice only
  return v;
}

}  // namespace

std::vector<float> SnapshotFloats(absl::Span<const float> values) {
  std::vector<float> v = Reserved(values.size());
  v.assign(values.begin(), values.end());
  return v;
}

std::vector<float> SnapshotZeros(size_t n) {
  std::vector<float> v = Reserved(n);
  v.resize(n);
  return v;
}

std::optional<std::vector<float>> SnapshotBuffers::Fitting(size_t n) {
  absl::MutexLock l(&mu_);
  // The smallest that fits (the arrays of one process are mostly of one size).
  auto best = held_.end();
  for (auto it = held_.begin(); it != held_.end(); ++it) {
    if (it->capacity() >= n && (best == held_.end() || it->capacity() < best->capacity()))
      best = it;
  }
  if (best == held_.end()) return std::nullopt;
  std::vector<float> v = std::move(*best);
  held_.erase(best);
  return v;
}

std::vector<float> SnapshotBuffers::Copy(absl::Span<const float> values) {
  std::optional<std::vector<float>> v = Fitting(values.size());
  if (!v) return SnapshotFloats(values);
  v->assign(values.begin(), values.end());  // within its capacity: no new pages
  return *std::move(v);
}

std::vector<float> SnapshotBuffers::Take(size_t n) {
  std::optional<std::vector<float>> v = Fitting(n);
  if (!v) return SnapshotZeros(n);
  v->resize(n);
  return *std::move(v);
}

void SnapshotBuffers::Give(std::vector<float>&& v) {
  if (v.capacity() == 0) return;
  absl::MutexLock l(&mu_);
  if (held_.size() < max_held_) held_.push_back(std::move(v));
}

StateWriter::~StateWriter() {
  if (buffers_ == nullptr) return;
  for (auto& s : sections_) {
    if (auto* floats = std::get_if<std::vector<float>>(&s)) buffers_->Give(std::move(*floats));
  }
}

void StateWriter::AddFloats(absl::string_view name, absl::Span<const float> values) {
  AddFloats(name, SnapshotFloats(values));
}

void StateWriter::AddFloats(absl::string_view name, std::vector<float>&& values) {
  AddSection(name, values.size() * sizeof(float));
  sections_.emplace_back(std::move(values));
}

void StateWriter::SetValue(absl::string_view key, absl::string_view value) {
  (*header_.mutable_values())[std::string(key)] = std::string(value);
}

absl::StatusOr<WrittenFile> StateWriter::WriteTo(const std::string& dir,
                                                 const std::string& name) const {
  std::vector<absl::string_view> sections;
  std::vector<uint32_t> section_crcs;
  checkpoint::StateHeader header = header_;
  for (size_t i = 0; i < sections_.size(); ++i) {
    const auto* floats = std::get_if<std::vector<float>>(&sections_[i]);
    const absl::string_view bytes =
        floats != nullptr ? absl::string_view(reinterpret_cast<const char*>(floats->data()),
                                              floats->size() * sizeof(float))
                          : absl::string_view(std::get<std::string>(sections_[i]));
    section_crcs.push_back(Crc32(bytes));
    header.mutable_sections(static_cast<int>(i))->set_crc32(section_crcs.back());
    sections.push_back(bytes);
  }
  const std::string head = header.SerializeAsString();
  const std::string size = LittleEndianU32(static_cast<uint32_t>(head.size()));
  const std::string crc = LittleEndianU32(Crc32(head));
  std::vector<absl::string_view> parts = {absl::string_view(kMagic, kMagicSize), size, head, crc};
  parts.insert(parts.end(), sections.begin(), sections.end());
  // The file's crc32 for the manifest from the sections' (one pass, not two).
  std::vector<uint32_t> crcs;
  for (size_t i = 0; i < 4; ++i) crcs.push_back(Crc32(parts[i]));
  crcs.insert(crcs.end(), section_crcs.begin(), section_crcs.end());
  return WriteParts(dir, name, parts, crcs);
}

absl::StatusOr<StateReader> StateReader::Open(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("checkpoint file ", path, " is missing"));
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto bad = [&path](absl::string_view why) {
    return absl::DataLossError(absl::StrCat("checkpoint file ", path, ": ", why));
  };
  if (all.size() < kMagicSize + 8 || all.compare(0, kMagicSize, kMagic, kMagicSize) != 0) {
    return bad("not a onebit-ps state file (no OBSTATE1 magic)");
  }
  const uint32_t h = ReadLittleEndianU32(all.data() + kMagicSize);
  if (all.size() < kMagicSize + 8 + uint64_t{h}) return bad("truncated inside its header");
  const absl::string_view head(all.data() + kMagicSize + 4, h);
  if (ReadLittleEndianU32(head.data() + h) != Crc32(head))
    return bad("the header's checksum does not match");
  checkpoint::StateHeader header;
  if (!header.ParseFromArray(head.data(), static_cast<int>(head.size()))) {
    return bad("the header does not parse");
  }
  if (header.format() != kCheckpointFormat) {
    return bad(absl::StrCat("format ", header.format(), ", this build reads ", kCheckpointFormat));
  }
  all.erase(0, kMagicSize + 8 + uint64_t{h});  // the payload, without a second copy
  std::string payload = std::move(all);
  uint64_t end = 0;
  for (const checkpoint::Section& s : header.sections()) {
    if (s.offset() > payload.size() || s.size() > payload.size() - s.offset()) {
      return bad(absl::StrCat("truncated: section '", s.name(), "' needs bytes [", s.offset(), ", ",
                              s.offset() + s.size(), ") of ", payload.size()));
    }
    if (Crc32(absl::string_view(payload).substr(s.offset(), s.size())) != s.crc32()) {
      return bad(absl::StrCat("section '", s.name(), "' does not match its checksum"));
    }
    end = std::max(end, s.offset() + s.size());
  }
  if (end != payload.size()) {
    return bad(absl::StrCat(payload.size() - end, " bytes after the last section"));
  }
  return StateReader(path, std::move(header), std::move(payload));
}

absl::StatusOr<absl::string_view> StateReader::Section(absl::string_view name) const {
  for (const checkpoint::Section& s : header_.sections()) {
    if (s.name() == name) return absl::string_view(payload_).substr(s.offset(), s.size());
  }
  return absl::NotFoundError(
      absl::StrCat("checkpoint file ", path_, " has no section '", name, "'"));
}

absl::StatusOr<std::string> StateReader::Value(absl::string_view key) const {
  auto it = header_.values().find(std::string(key));
  if (it == header_.values().end()) {
    return absl::NotFoundError(
        absl::StrCat("checkpoint file ", path_, " has no value '", key, "'"));
  }
  return it->second;
}

absl::StatusOr<std::string> StateReader::Bytes(absl::string_view name) const {
  auto s = Section(name);
  if (!s.ok()) return s.status();
  return std::string(*s);
}

absl::StatusOr<std::vector<float>> StateReader::Floats(absl::string_view name,
                                                       uint64_t count) const {
  auto s = Section(name);
  if (!s.ok()) return s.status();
  const std::string want =
      count == UINT64_MAX ? std::string("whole floats") : absl::StrCat(count, " floats");
  if (s->size() % sizeof(float) != 0 ||
      (count != UINT64_MAX && s->size() != count * sizeof(float))) {
    return absl::DataLossError(absl::StrCat("checkpoint file ", path_, ": section '", name,
                                            "' holds ", s->size(), " bytes, not ", want));
  }
  std::vector<float> out(s->size() / sizeof(float));
  std::memcpy(out.data(), s->data(), s->size());
  return out;
}

}  // namespace onebit
