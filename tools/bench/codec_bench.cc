// onebit-bench-codec: codec throughput on one core against this machine's own
// memory bandwidth, measured in the same run. Prints a table and, last,
//   codec_ef_encode_in_pieces_vs_inplace_add=<x>
//   codec_ef_encode_vs_inplace_add=<x>
// elements/s of the onebit error-feedback encode (in pieces, as the step
// runs it; and all or nothing, per wire chunk) over elements/s of the
// in-place add e[i] += y[i], which moves the same bytes (read y, read e,
// write e) and so is the physical limit for the encode.
//
// The encode runs as the data plane runs it: one call per wire chunk of
// --chunk elements. Each call validates all its input before it writes
// (a bad value leaves e and the payload untouched), so its second pass reads
// the chunk from cache; one call over all 64 M elements must read y and e
// from memory twice, and that figure is printed too, for context.
//
//   onebit-bench-codec [--elements N] [--chunk C] [--reps R] [--block B] [--scale l1|l2]
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "compress/codec.h"
#include "util/memory.h"

namespace {

using Clock = std::chrono::steady_clock;

// Median seconds of `reps` runs of fn, after one warm-up run.
double MedianSeconds(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto start = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// Medians of `reps` runs of a and of b, run in turns (a, b, a, b, ...) after
// one warm-up run of each, so that both see the same state of caches and
// memory (a run right after its own twin is faster than one after other work).
std::pair<double, double> PairedMedianSeconds(int reps, const std::function<void()>& a,
                                              const std::function<void()>& b) {
  a();
  b();
  std::vector<double> ta, tb;
  for (int r = 0; r < reps; ++r) {
    for (auto [fn, t] : {std::pair{&a, &ta}, std::pair{&b, &tb}}) {
      const auto start = Clock::now();
      (*fn)();
      t->push_back(std::chrono::duration<double>(Clock::now() - start).count());
    }
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[ta.size() / 2], tb[tb.size() / 2]};
}

// Plain loops, as the compiler writes them for the baseline ISA: the machine's
// bandwidth for each traffic pattern, not a tuned kernel.
__attribute__((noinline)) void InplaceAdd(const float* y, float* e, size_t n) {
  for (size_t i = 0; i < n; ++i) e[i] += y[i];
}
__attribute__((noinline)) void Copy(const float* a, float* b, size_t n) {
  for (size_t i = 0; i < n; ++i) b[i] = a[i];
}
__attribute__((noinline)) void Triad(const float* b, const float* c, float s, float* a, size_t n) {
  for (size_t i = 0; i < n; ++i) a[i] = b[i] + s * c[i];
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "onebit-bench-codec: %s\n", std::string(s.message()).c_str());
    std::exit(1);
  }
}

void Row(const char* what, size_t n, double bytes, double sec) {
  std::printf("%-34s %8.3f ms %9.3f Gelem/s %8.2f GB/s\n", what, sec * 1e3, n / sec / 1e9,
              bytes / sec / 1e9);
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{64} << 20;
  size_t chunk = size_t{256} << 10;  // 1 MB of fp32, the data plane's default chunk
  int reps = 5;
  onebit::CodecOptions options;
  constexpr char kUsage[] =
      "usage: onebit-bench-codec [--elements N] [--chunk C] [--reps R] [--block B] "
      "[--scale l1|l2] [--simd auto|scalar|avx2|avx512]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : "";
    bool ok = true;
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (arg == "--elements") {
      ok = absl::SimpleAtoi(value, &n) && n > 0 && n <= (size_t{1} << 40);
    } else if (arg == "--chunk") {
      ok = absl::SimpleAtoi(value, &chunk) && chunk > 0;
    } else if (arg == "--reps") {
      ok = absl::SimpleAtoi(value, &reps) && reps > 0;
    } else if (arg == "--simd") {
      const std::string v = value;
      ok = v == "auto" || v == "scalar" || v == "avx2" || v == "avx512";
      options.simd = v == "scalar"   ? onebit::SimdPath::kScalar
                     : v == "avx2"   ? onebit::SimdPath::kAvx2
                     : v == "avx512" ? onebit::SimdPath::kAvx512
                                     : onebit::SimdPath::kAuto;
    } else if (arg == "--block") {
      ok = absl::SimpleAtoi(value, &options.block_size);
    } else if (arg == "--scale") {
      auto rule = onebit::ParseScaleRule(value);
      ok = rule.ok();
      if (ok) options.scale = *rule;
    } else {
      std::fprintf(stderr, "%sunknown flag: %s\n", kUsage, arg.c_str());
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "onebit-bench-codec: bad value \"%s\" for %s\n", value, arg.c_str());
      return 2;
    }
    ++i;
  }

  // One core: the figures are per core, and a pinned thread does not migrate.
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu(), &one);
  sched_setaffinity(0, sizeof(one), &one);

  auto onebit = onebit::NewCodec("onebit", options);
  auto fp16 = onebit::NewCodec("fp16", options);
  Check(onebit.status());
  Check(fp16.status());

  // Five fp32 arrays and the two encodings: refused before allocating when
  // they cannot fit.
  Check(onebit::CheckMemory(absl::StrCat("--elements ", n),
                            5 * 4 * n + (*onebit)->EncodedSize(n) + (*fp16)->EncodedSize(n)));
  std::vector<float> y(n), e(n), c(n), acc(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    y[i] = normal(rng);
    e[i] = 0.01f * normal(rng);
    c[i] = normal(rng);
  }
  std::vector<uint8_t> bits((*onebit)->EncodedSize(n));
  std::vector<uint8_t> halves((*fp16)->EncodedSize(n));
  const double f = 4.0 * n;  // bytes of one fp32 array
  const double nb = static_cast<double>(bits.size());

  std::printf(
      "onebit-bench-codec: %zu elements, %s kernels, %s, one core, median of %d "
      "(the add and the chunked EF encode in turns)\n",
      n, std::string((*onebit)->simd_path()).c_str(), (*onebit)->name().c_str(), reps);
  // Chunks are block-aligned, so each encodes independently, as on the wire.
  chunk = (chunk + options.block_size - 1) / options.block_size * options.block_size;
  // The ratio's two sides, measured in turns. e stays bounded under repeated
  // feedback (and the add's e is a copy), so repetitions measure the same work.
  std::vector<float> e_add = e;
  const auto [t_add, t_ef] = PairedMedianSeconds(
      reps, [&] { InplaceAdd(y.data(), e_add.data(), n); },
      [&] {
        for (size_t begin = 0; begin < n; begin += chunk) {
          const size_t len = std::min(chunk, n - begin);
          Check((*onebit)->EncodeWithFeedback(y.data() + begin, e.data() + begin, len,
                                              bits.data() + (*onebit)->EncodedSize(begin)));
        }
      });
  // The step's form: one call over all of it, piece by piece from cache,
  // not all or nothing (Codec::EncodeInPieces).
  std::vector<float> e_pieces = e, e_add2 = e;
  const auto [t_add2, t_pieces] = PairedMedianSeconds(
      reps, [&] { InplaceAdd(y.data(), e_add2.data(), n); },
      [&] { Check((*onebit)->EncodeInPieces(y.data(), e_pieces.data(), n, bits.data(), {})); });
  std::printf("-- memory bandwidth of this machine --\n");
  Row("in-place add e+=y (rd y,e; wr e)", n, 3 * f, t_add);
  Row("copy b=a", n, 2 * f, MedianSeconds(reps, [&] { Copy(y.data(), c.data(), n); }));
  Row("triad a=b+s*c", n, 3 * f,
      MedianSeconds(reps, [&] { Triad(y.data(), e.data(), 0.5f, c.data(), n); }));

  std::printf("-- codecs (GB/s counts the arrays each one must touch) --\n");
  char label[64];
  std::snprintf(label, sizeof(label), "onebit EF encode, chunks of %zu", chunk);
  Row(label, n, 3 * f + nb, t_ef);
  Row("onebit EF encode, one call", n, 3 * f + nb, MedianSeconds(reps, [&] {
        Check((*onebit)->EncodeWithFeedback(y.data(), e.data(), n, bits.data()));
      }));
  Row("onebit EF encode in pieces", n, 3 * f + nb, t_pieces);
  Row("onebit encode (rd y; wr c)", n, f + nb,
      MedianSeconds(reps, [&] { Check((*onebit)->Encode(y.data(), n, bits.data())); }));
  Row("onebit decode (rd c; wr x)", n, f + nb,
      MedianSeconds(reps, [&] { Check((*onebit)->Decode(bits.data(), n, c.data())); }));
  std::fill(acc.begin(), acc.end(), 0.0f);
  Row("onebit decode_add (rd c,acc; wr acc)", n, 2 * f + nb,
      MedianSeconds(reps, [&] { Check((*onebit)->DecodeAdd(bits.data(), n, 0.25f, acc.data())); }));
  Row("fp16 encode (rd y; wr h)", n, 1.5 * f,
      MedianSeconds(reps, [&] { Check((*fp16)->Encode(y.data(), n, halves.data())); }));
  Row("fp16 decode (rd h; wr x)", n, 1.5 * f,
      MedianSeconds(reps, [&] { Check((*fp16)->Decode(halves.data(), n, c.data())); }));
  std::printf("codec_ef_encode_in_pieces_vs_inplace_add=%.3f\n", t_add2 / t_pieces);
  std::printf("codec_ef_encode_vs_inplace_add=%.3f\n", t_add / t_ef);
  return 0;
}
