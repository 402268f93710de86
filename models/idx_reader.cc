#include "models/idx_reader.h"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace onebit {
namespace {

// The header may claim anything; refuse sizes no dataset here needs before
// allocating them.
constexpr uint64_t kMaxBytes = uint64_t{1} << 32;

struct GzCloser {
  void operator()(gzFile f) const { gzclose(f); }
};
using GzFile = std::unique_ptr<gzFile_s, GzCloser>;

absl::Status Error(const std::string& path, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("IDX file ", path, ": ", what));
}

absl::StatusOr<GzFile> Open(const std::string& path) {
  errno = 0;
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int e = errno;
    if (e == ENOENT) return absl::NotFoundError(absl::StrCat("IDX file ", path, ": no such file"));
    return absl::UnavailableError(absl::StrCat(
        "IDX file ", path, ": cannot open: ", e != 0 ? std::strerror(e) : "out of memory"));
  }
  gzbuffer(f, 1 << 17);
  return GzFile(f);
}

// The most a read grows its buffer by before the data is there.
constexpr uint64_t kGrowBytes = uint64_t{16} << 20;

// Reads exactly n bytes into *out (resized to n); `what` says which part of
// the file for the error message (a short read is truncation, a zlib error
// is corruption). *out grows as the data arrives: the header may claim up
// to 4 GiB, and a file that holds less must not cost that much memory.
absl::Status ReadExactly(gzFile f, const std::string& path, std::vector<uint8_t>* out, uint64_t n,
                         absl::string_view what) {
  out->clear();
  uint64_t done = 0;
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<uint64_t>(n - done, kGrowBytes));
    out->resize(done + chunk);
    const int got = gzread(f, out->data() + done, chunk);
    int errnum = Z_OK;
    const char* msg = gzerror(f, &errnum);
    if (got < 0 || (errnum != Z_OK && errnum != Z_BUF_ERROR)) {
      return Error(path, absl::StrCat("read error in the ", what, ": ", msg));
    }
    if (got == 0 || errnum == Z_BUF_ERROR) {
      done += static_cast<uint64_t>(got);
      if (done >= n) break;
      return Error(path, absl::StrCat("truncated ", what, ": expected ", n, " bytes, got ", done,
                                      errnum == Z_BUF_ERROR ? " (gzip stream ends early)" : ""));
    }
    done += static_cast<uint64_t>(got);
  }
  return absl::OkStatus();
}

uint32_t BigEndian32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// Opens the file, checks that it is gzip and has the expected magic, and reads
// the ndims dimensions.
absl::StatusOr<GzFile> OpenIdx(const std::string& path, uint32_t magic, uint32_t* dims, int ndims) {
  absl::StatusOr<GzFile> f = Open(path);
  if (!f.ok()) return f.status();
  std::array<uint8_t, 4> head;
  const int got = gzread(f->get(), head.data(), 4);
  int errnum = Z_OK;
  const char* msg = gzerror(f->get(), &errnum);
  if (got < 0 || (errnum != Z_OK && errnum != Z_BUF_ERROR)) {
    return Error(path, absl::StrCat("read error: ", msg));
  }
  // gzread passes plain files through unchanged; the dataset is always gzip,
  // and a plain file here means a wrong path or an unpacked copy.
  if (got > 0 && gzdirect(f->get())) return Error(path, "not gzip-compressed");
  if (got < 4) return Error(path, absl::StrCat("truncated header: ", got, " of 4 magic bytes"));
  const uint32_t m = BigEndian32(head.data());
  if (m != magic) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "wrong magic number 0x%08x (expected 0x%08x)", m, magic);
    return Error(path, buf);
  }
  std::vector<uint8_t> raw;
  absl::Status s = ReadExactly(f->get(), path, &raw, 4u * ndims, "header");
  if (!s.ok()) return s;
  for (int i = 0; i < ndims; ++i) dims[i] = BigEndian32(raw.data() + 4 * i);
  return f;
}

// With the whole file read, the stream must end here (which also makes zlib
// check the gzip CRC).
absl::Status ExpectEnd(gzFile f, const std::string& path, uint64_t declared) {
  uint8_t extra[256];
  const int got = gzread(f, extra, sizeof(extra));
  int errnum = Z_OK;
  const char* msg = gzerror(f, &errnum);
  if (got < 0 || (errnum != Z_OK && errnum != Z_BUF_ERROR)) {
    return Error(path, absl::StrCat("read error at the end: ", msg));
  }
  if (errnum == Z_BUF_ERROR) return Error(path, "truncated gzip stream after the data");
  if (got > 0) {
    return Error(path, absl::StrCat("dimension mismatch: bytes follow the ", declared,
                                    " data bytes the header declares"));
  }
  return absl::OkStatus();
}

}  // namespace

float PixelToFloat(uint8_t x) { return static_cast<float>(x) / 255.0f; }

void IdxImages::ToFloat(size_t i, float* out) const {
  const uint8_t* p = image(i);
  const size_t n = image_size();
  for (size_t k = 0; k < n; ++k) out[k] = static_cast<float>(p[k]) / 255.0f;
}

absl::StatusOr<IdxImages> ReadIdxImages(const std::string& path, uint32_t max_count) {
  uint32_t dims[3];
  absl::StatusOr<GzFile> f = OpenIdx(path, kIdxImagesMagic, dims, 3);
  if (!f.ok()) return f.status();
  IdxImages im;
  im.count = max_count > 0 ? std::min(max_count, dims[0]) : dims[0];
  im.rows = dims[1];
  im.cols = dims[2];
  if (im.rows == 0 || im.cols == 0) {
    return Error(path, absl::StrCat("dimension mismatch: empty images ", im.rows, "x", im.cols));
  }
  // Three uint32 factors can overflow 64 bits (and wrap to a small size);
  // two cannot.
  const uint64_t image = uint64_t{im.rows} * im.cols;
  if (image > kMaxBytes || dims[0] > kMaxBytes / image) {
    return Error(path, absl::StrCat("dimension mismatch: ", dims[0], " images of ", im.rows, "x",
                                    im.cols, " exceed 4 GiB"));
  }
  absl::Status s = ReadExactly(f->get(), path, &im.pixels, im.count * image, "image data");
  if (!s.ok()) return s;
  if (im.count == dims[0]) {
    s = ExpectEnd(f->get(), path, dims[0] * image);
    if (!s.ok()) return s;
  }
  return im;
}

absl::StatusOr<std::vector<uint8_t>> ReadIdxLabels(const std::string& path, uint32_t num_classes,
                                                   uint32_t max_count) {
  if (num_classes == 0 || num_classes > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("ReadIdxLabels(", path, "): num_classes ", num_classes, " not in [1, 256]"));
  }
  uint32_t dims[1];
  absl::StatusOr<GzFile> f = OpenIdx(path, kIdxLabelsMagic, dims, 1);
  if (!f.ok()) return f.status();
  const uint32_t count = max_count > 0 ? std::min(max_count, dims[0]) : dims[0];
  std::vector<uint8_t> labels;
  absl::Status s = ReadExactly(f->get(), path, &labels, count, "label data");
  if (!s.ok()) return s;
  if (count == dims[0]) {
    s = ExpectEnd(f->get(), path, dims[0]);
    if (!s.ok()) return s;
  }
  for (uint32_t i = 0; i < count; ++i) {
    if (labels[i] >= num_classes) {
      return Error(path, absl::StrCat("label ", int{labels[i]}, " at index ", i, " is not in [0, ",
                                      num_classes, ")"));
    }
  }
  return labels;
}

}  // namespace onebit
