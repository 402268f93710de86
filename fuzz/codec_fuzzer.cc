// Codec::CheckPayload, Decode and DecodeAdd of every codec on received bytes
// (compress/codec.h): a payload CheckPayload accepts decodes, without
// reading past EncodedSize(n) bytes, to finite values; one it refuses is
// refused by Decode and DecodeAdd with the same error and leaves their
// outputs untouched; the scalar and AVX2 kernels agree bit for bit;
// DecodeAdd adds w times what Decode gives; fp32 and fp16 payloads encode
// back to themselves.
//
// Input: a byte picking the codec (kCodecs), a byte of flags (bit 0: the
// payload at an odd address; bit 1: n = 0 passes a null payload), a uint32
// n (taken modulo the most elements the rest can hold), then the payload:
// the first EncodedSize(n) bytes of the rest.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "compress/codec.h"
#include "fuzz/fuzz_input.h"
#include "fuzz/fuzz_target.h"

namespace onebit {
namespace {

struct CodecSpec {
  const char* kind;
  uint32_t block_size;
  ScaleRule scale;
};
constexpr CodecSpec kCodecs[] = {
    {"fp32", 2048, ScaleRule::kL1}, {"fp16", 2048, ScaleRule::kL1},
    {"onebit", 32, ScaleRule::kL1}, {"onebit", 64, ScaleRule::kL2},
    {"onebit", 96, ScaleRule::kL1}, {"onebit", 2048, ScaleRule::kL1},
};
constexpr size_t kNumCodecs = sizeof(kCodecs) / sizeof(kCodecs[0]);

// Each codec once per instruction set this CPU runs (scalar first).
struct Codecs {
  std::vector<std::unique_ptr<const Codec>> paths[kNumCodecs];
};

const Codecs& AllCodecs() {
  static const Codecs* codecs = [] {
    auto* c = new Codecs;
    for (size_t i = 0; i < kNumCodecs; ++i) {
      std::vector<SimdPath> simd = {SimdPath::kScalar};
      if (CpuHasAvx2()) simd.push_back(SimdPath::kAvx2);
      if (CpuHasAvx512()) simd.push_back(SimdPath::kAvx512);
      for (SimdPath p : simd) {
        auto codec = NewCodec(kCodecs[i].kind, {kCodecs[i].block_size, kCodecs[i].scale, p});
        FUZZ_CHECK(codec.ok());
        c->paths[i].push_back(*std::move(codec));
      }
    }
    return c;
  }();
  return *codecs;
}

// The most elements whose encoding fits in `bytes` (EncodedSize grows with n).
size_t MaxElements(const Codec& codec, size_t bytes) {
  size_t lo = 0, hi = 8 * bytes + 1;  // no codec takes under 1 bit per element
  while (lo + 1 < hi) {
    const size_t mid = lo + (hi - lo) / 2;
    (codec.EncodedSize(mid) <= bytes ? lo : hi) = mid;
  }
  return lo;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), 4 * a.size()) == 0);
}

// A NaN no decoder writes, to see which outputs were written.
float Untouched() {
  const uint32_t bits = 0x7fc0dead;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct Decoded {
  absl::Status check, decode, decode_add;
  std::vector<float> out, acc;
};

Decoded DecodeWith(const Codec& codec, const uint8_t* in, size_t n, float w,
                   const std::vector<float>& acc0) {
  Decoded d;
  d.check = codec.CheckPayload(in, n);
  d.out.assign(n, Untouched());
  d.decode = codec.Decode(in, n, d.out.data());
  d.acc = acc0;
  d.decode_add = codec.DecodeAdd(in, n, w, d.acc.data());
  return d;
}

}  // namespace

std::vector<fuzz::Seed> Seeds() {
  std::vector<fuzz::Seed> seeds;
  // Real encodings of a few vectors, and the same bytes broken: the first
  // value (or scale) made an Inf, and for onebit a scale of -0.
  const std::vector<float> x = {0.5f,  -1.25f, 3.0f, 0.0f,  -0.0f, 1e-3f,  -7.5f, 65000.0f, 2.0f,
                                -2.0f, 1e-7f,  4.0f, -4.0f, 0.25f, -0.25f, 9.0f,  1.0f,     -1.0f};
  auto add = [&](const std::string& name, size_t codec, uint8_t flags, size_t n,
                 const std::string& payload) {
    fuzz::Output o;
    o.Byte(static_cast<uint8_t>(codec)).Byte(flags).U32(static_cast<uint32_t>(n)).Rest(payload);
    seeds.push_back({name, o.data()});
  };
  for (size_t i = 0; i < kNumCodecs; ++i) {
    const Codec& codec = *AllCodecs().paths[i][0];
    // n = 0 with null buffers, as an empty vector gives them.
    add(codec.name() + "-n0-null", i, 2, 0, "");
    for (size_t n : {size_t{7}, x.size()}) {
      std::string payload(codec.EncodedSize(n), '\0');
      FUZZ_CHECK(codec.Encode(x.data(), n, reinterpret_cast<uint8_t*>(&payload[0])).ok());
      const std::string name = codec.name() + "-n" + std::to_string(n);
      add(name, i, n % 2, n, payload);
      if (n != x.size()) continue;
      std::string bad = payload;
      if (codec.kind() == CodecKind::kFp16) {
        bad.replace(0, 2, "\x00\x7c", 2);
      } else {
        bad.replace(0, 4, "\x00\x00\x80\x7f", 4);
      }
      add(name + "-inf", i, 0, n, bad);
      if (codec.kind() == CodecKind::kOnebit) {
        bad.replace(0, 4, "\x00\x00\x00\x80", 4);
        add(name + "-negzero-scale", i, 0, n, bad);
      }
    }
  }
  return seeds;
}

}  // namespace onebit

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  return onebit::fuzz::Initialize(argc, argv, onebit::Seeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace onebit;
  fuzz::Input in(data, size);
  const size_t which = in.Byte() % kNumCodecs;
  const uint8_t flags = in.Byte();
  const uint32_t n_hint = in.U32();
  const std::string rest = in.Rest();
  const auto& paths = AllCodecs().paths[which];
  const Codec& codec = *paths[0];
  const size_t n = n_hint % (MaxElements(codec, rest.size()) + 1);
  const size_t bytes = codec.EncodedSize(n);
  FUZZ_CHECK(bytes <= rest.size());

  // Exactly `bytes` on the heap, so that ASan sees a read past them.
  const bool odd = flags & 1;
  std::unique_ptr<uint8_t[]> buf(new uint8_t[bytes + odd]);
  uint8_t* payload = buf.get() + odd;
  if (bytes > 0) std::memcpy(payload, rest.data(), bytes);
  if (n == 0 && (flags & 2)) payload = nullptr;

  const float w = 0.25f;
  std::vector<float> acc0(n);
  for (size_t i = 0; i < n; ++i) acc0[i] = static_cast<float>(i % 7) - 3.0f;

  const Decoded first = DecodeWith(codec, payload, n, w, acc0);
  const bool ok = first.check.ok();
  FUZZ_CHECK(first.decode == first.check);
  FUZZ_CHECK(first.decode_add == first.check);
  if (ok) {
    for (size_t i = 0; i < n; ++i) {
      FUZZ_CHECK(std::isfinite(first.out[i]));
      const float want = acc0[i] + w * first.out[i];
      FUZZ_CHECK(std::memcmp(&first.acc[i], &want, 4) == 0);
    }
  } else {
    // All or nothing: a refused payload writes nothing.
    FUZZ_CHECK(SameBits(first.out, std::vector<float>(n, Untouched())));
    FUZZ_CHECK(SameBits(first.acc, acc0));
  }
  for (size_t p = 1; p < paths.size(); ++p) {
    const Decoded other = DecodeWith(*paths[p], payload, n, w, acc0);
    FUZZ_CHECK(other.check == first.check);
    FUZZ_CHECK(other.decode == first.decode && other.decode_add == first.decode_add);
    FUZZ_CHECK(SameBits(other.out, first.out));
    FUZZ_CHECK(SameBits(other.acc, first.acc));
  }
  // fp32 and fp16 are exact on their own values: the payload comes back
  // (onebit's scale is a mean, not exact; for n = 0 the buffers are null).
  if (ok && (codec.kind() != CodecKind::kOnebit || n == 0)) {
    std::vector<uint8_t> again(bytes);
    FUZZ_CHECK(codec.Encode(first.out.data(), n, again.data()).ok());
    FUZZ_CHECK(bytes == 0 || std::memcmp(again.data(), payload, bytes) == 0);
  }
  return 0;
}
