#include "models/idx_reader.h"

#include <sys/resource.h>
#include <unistd.h>
#include <zlib.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

// The raw IDX bytes: big-endian magic and dimensions, then the data.
std::string IdxBytes(uint32_t magic, const std::vector<uint32_t>& dims,
                     const std::vector<uint8_t>& data) {
  std::string s;
  auto put = [&](uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) s.push_back(static_cast<char>(v >> shift));
  };
  put(magic);
  for (uint32_t d : dims) put(d);
  s.append(data.begin(), data.end());
  return s;
}

class IdxReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/onebit_idx_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string WriteGz(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    gzFile f = gzopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    if (!bytes.empty()) {
      EXPECT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
                static_cast<int>(bytes.size()));
    }
    EXPECT_EQ(gzclose(f), Z_OK);
    return path;
  }
  std::string WritePlain(const std::string& name, const std::string& bytes) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path, std::ios::binary) << bytes;
    return path;
  }
  static std::string ReadRaw(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  std::string dir_;
};

std::vector<uint8_t> Ramp(size_t n) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 37 + 11);
  v[0] = 0;
  v[n - 1] = 255;
  return v;
}

TEST_F(IdxReaderTest, ReadsImages) {
  const std::vector<uint8_t> px = Ramp(3 * 2 * 5);
  const std::string path = WriteGz("im.gz", IdxBytes(kIdxImagesMagic, {3, 2, 5}, px));
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_EQ(im->count, 3u);
  EXPECT_EQ(im->rows, 2u);
  EXPECT_EQ(im->cols, 5u);
  EXPECT_EQ(im->pixels, px);
  std::vector<float> f(10);
  im->ToFloat(2, f.data());
  for (int k = 0; k < 10; ++k) EXPECT_EQ(f[k], static_cast<float>(px[20 + k]) / 255.0f);
  EXPECT_EQ(f[9], 1.0f);
  im->ToFloat(0, f.data());
  EXPECT_EQ(f[0], 0.0f);
  EXPECT_EQ(PixelToFloat(51), 0.2f);
}

TEST_F(IdxReaderTest, ReadsZeroImages) {
  absl::StatusOr<IdxImages> im =
      ReadIdxImages(WriteGz("im.gz", IdxBytes(kIdxImagesMagic, {0, 28, 28}, {})));
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_EQ(im->count, 0u);
  EXPECT_TRUE(im->pixels.empty());
}

TEST_F(IdxReaderTest, ReadsLabels) {
  const std::vector<uint8_t> labels = {0, 9, 3, 3, 1, 7, 0};
  absl::StatusOr<std::vector<uint8_t>> got =
      ReadIdxLabels(WriteGz("l.gz", IdxBytes(kIdxLabelsMagic, {7}, labels)));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, labels);
}

TEST_F(IdxReaderTest, MaxCountReadsAPrefix) {
  const std::vector<uint8_t> px = Ramp(5 * 4);
  const std::string path = WriteGz("im.gz", IdxBytes(kIdxImagesMagic, {5, 2, 2}, px));
  absl::StatusOr<IdxImages> im = ReadIdxImages(path, 2);
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_EQ(im->count, 2u);
  EXPECT_EQ(im->pixels, std::vector<uint8_t>(px.begin(), px.begin() + 8));
  im = ReadIdxImages(path, 99);  // more than there are: all of them
  ASSERT_TRUE(im.ok()) << im.status();
  EXPECT_EQ(im->count, 5u);
  const std::string lpath = WriteGz("l.gz", IdxBytes(kIdxLabelsMagic, {4}, {1, 2, 3, 4}));
  absl::StatusOr<std::vector<uint8_t>> l = ReadIdxLabels(lpath, 10, 3);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(*l, (std::vector<uint8_t>{1, 2, 3}));
}

TEST_F(IdxReaderTest, MissingFileIsNotFoundAndNamed) {
  const std::string path = dir_ + "/nope-images-idx3-ubyte.gz";
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  ASSERT_FALSE(im.ok());
  EXPECT_EQ(im.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(im.status().message(), HasSubstr(path));
  EXPECT_THAT(im.status().message(), HasSubstr("no such file"));
  EXPECT_FALSE(ReadIdxLabels(path).ok());
}

TEST_F(IdxReaderTest, PlainFileIsNotGzip) {
  const std::string path = WritePlain("plain", IdxBytes(kIdxImagesMagic, {1, 2, 2}, {1, 2, 3, 4}));
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr(path));
  EXPECT_THAT(im.status().message(), HasSubstr("not gzip"));
}

TEST_F(IdxReaderTest, WrongMagicIsNamed) {
  // A labels file where images are expected, and the other way round.
  const std::string labels = WriteGz("l.gz", IdxBytes(kIdxLabelsMagic, {2}, {1, 2}));
  absl::StatusOr<IdxImages> im = ReadIdxImages(labels);
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr(labels));
  EXPECT_THAT(im.status().message(), HasSubstr("wrong magic number 0x00000801"));
  const std::string images = WriteGz("i.gz", IdxBytes(kIdxImagesMagic, {1, 1, 1}, {1}));
  absl::StatusOr<std::vector<uint8_t>> l = ReadIdxLabels(images);
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(), HasSubstr("wrong magic number 0x00000803"));
  // Signed-int16 data (type 0x0B) is not ubyte.
  l = ReadIdxLabels(WriteGz("s.gz", IdxBytes(0x00000B01, {1}, {0, 1})));
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(), HasSubstr("wrong magic"));
}

TEST_F(IdxReaderTest, TruncatedDataIsNamed) {
  // The header promises 3 images of 2x2; only 2.5 follow.
  const std::string path = WriteGz("im.gz", IdxBytes(kIdxImagesMagic, {3, 2, 2}, Ramp(10)));
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr(path));
  EXPECT_THAT(im.status().message(), HasSubstr("truncated image data: expected 12 bytes, got 10"));
  const std::string lpath = WriteGz("l.gz", IdxBytes(kIdxLabelsMagic, {5}, {1, 2}));
  absl::StatusOr<std::vector<uint8_t>> l = ReadIdxLabels(lpath);
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(), HasSubstr("truncated label data"));
}

TEST_F(IdxReaderTest, TruncatedHeaderIsNamed) {
  const std::string bytes = IdxBytes(kIdxImagesMagic, {3, 2, 2}, {});
  absl::StatusOr<IdxImages> im = ReadIdxImages(WriteGz("a.gz", bytes.substr(0, 9)));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("truncated header"));
  im = ReadIdxImages(WriteGz("b.gz", bytes.substr(0, 2)));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("truncated header"));
  im = ReadIdxImages(WriteGz("empty.gz", ""));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("truncated header"));
  im = ReadIdxImages(WritePlain("empty", ""));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr(dir_ + "/empty"));
}

TEST_F(IdxReaderTest, CutGzipStreamIsAnError) {
  // A real gzip file cut short on disk (an interrupted download).
  const std::string full =
      WriteGz("full.gz", IdxBytes(kIdxImagesMagic, {50, 28, 28}, Ramp(50 * 784)));
  const std::string raw = ReadRaw(full);
  for (size_t keep : {raw.size() - 4, raw.size() / 2, size_t{12}}) {
    const std::string path = WritePlain("cut.gz", raw.substr(0, keep));
    absl::StatusOr<IdxImages> im = ReadIdxImages(path);
    ASSERT_FALSE(im.ok()) << "kept " << keep << " of " << raw.size();
    EXPECT_THAT(im.status().message(), HasSubstr(path));
    EXPECT_THAT(im.status().message(), HasSubstr("truncated")) << im.status();
  }
}

TEST_F(IdxReaderTest, CorruptGzipIsAnError) {
  const std::string full =
      WriteGz("full.gz", IdxBytes(kIdxImagesMagic, {50, 28, 28}, Ramp(50 * 784)));
  std::string raw = ReadRaw(full);
  raw[raw.size() - 6] ^= 0x5a;  // inside the CRC32 trailer
  const std::string path = WritePlain("bad.gz", raw);
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr(path));
  EXPECT_THAT(im.status().message(), HasSubstr("read error")) << im.status();
}

TEST_F(IdxReaderTest, ExtraBytesAreADimensionMismatch) {
  const std::string path = WriteGz("im.gz", IdxBytes(kIdxImagesMagic, {2, 2, 2}, Ramp(9)));
  absl::StatusOr<IdxImages> im = ReadIdxImages(path);
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("dimension mismatch"));
  im = ReadIdxImages(WriteGz("z.gz", IdxBytes(kIdxImagesMagic, {2, 0, 2}, {})));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("dimension mismatch"));
  // A header claiming terabytes is refused before anything is allocated.
  im = ReadIdxImages(WriteGz("huge.gz", IdxBytes(kIdxImagesMagic, {1u << 30, 1000, 1000}, {})));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("exceed"));
  // So is one whose size overflows 64 bits, here to exactly 0 (found by
  // fuzz/idx_fuzzer: it was read as 14155776 empty images of 469762048 x
  // 14155776, and image(0) pointed past the end).
  im = ReadIdxImages(
      WriteGz("wrap.gz", IdxBytes(kIdxImagesMagic, {0x00d80000, 0x1c000000, 0x00d80000}, {})));
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("exceed 4 GiB"));
  im = ReadIdxImages(
      WriteGz("wrap1.gz", IdxBytes(kIdxImagesMagic, {0x00d80000, 0x1c000000, 0x00d80000}, {})), 1);
  ASSERT_FALSE(im.ok());
  EXPECT_THAT(im.status().message(), HasSubstr("exceed 4 GiB"));
}

// Reads both files with 1 GiB of address space more than the process has:
// an allocation of what their headers claim throws. 0 when both are refused
// as truncated.
int ReadWithLittleMemory(const std::string& images, const std::string& labels) {
  long pages = 0;
  std::ifstream("/proc/self/statm") >> pages;
  const rlim_t limit = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + (rlim_t{1} << 30);
  const rlimit r = {limit, limit};
  if (setrlimit(RLIMIT_AS, &r) != 0) return 2;
  absl::StatusOr<IdxImages> im = ReadIdxImages(images);
  absl::StatusOr<std::vector<uint8_t>> l = ReadIdxLabels(labels);
  if (im.ok() || im.status().message().find("truncated image data") == std::string::npos) return 1;
  if (l.ok() || l.status().message().find("truncated label data") == std::string::npos) return 1;
  return 0;
}

// Found by fuzz/idx_fuzzer: a header that claims 4 GiB (within the limit)
// over a file of a few bytes made the reader allocate all of it first.
TEST_F(IdxReaderTest, AShortFileCostsNoMoreMemoryThanItHolds) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "ASan reserves more address space than the limit allows";
#else
  const std::string images =
      WriteGz("im.gz", IdxBytes(kIdxImagesMagic, {65536, 256, 256}, Ramp(100)));
  const std::string labels = WriteGz("l.gz", IdxBytes(kIdxLabelsMagic, {0xffffffff}, {1, 2, 3}));
  EXPECT_EXIT(std::exit(ReadWithLittleMemory(images, labels)), ::testing::ExitedWithCode(0), "");
#endif
}

TEST_F(IdxReaderTest, LabelOutOfRangeIsNamed) {
  const std::string path = WriteGz("l.gz", IdxBytes(kIdxLabelsMagic, {4}, {0, 9, 10, 1}));
  absl::StatusOr<std::vector<uint8_t>> l = ReadIdxLabels(path);
  ASSERT_FALSE(l.ok());
  EXPECT_THAT(l.status().message(), HasSubstr(path));
  EXPECT_THAT(l.status().message(), HasSubstr("label 10 at index 2 is not in [0, 10)"));
  l = ReadIdxLabels(path, 11);
  EXPECT_TRUE(l.ok()) << l.status();
  EXPECT_FALSE(ReadIdxLabels(path, 0).ok());
}

}  // namespace
}  // namespace onebit
