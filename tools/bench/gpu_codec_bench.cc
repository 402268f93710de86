// onebit-bench-gpu-codec: the GPU codec and update kernels (cuda/kernels.h)
// against the device-to-device copy bandwidth measured in the same run.
// Prints a table and, last,
//   gpu_ef_encode_vs_copy_ratio=<x>
// the GB/s of the fused onebit error-feedback encode (read y and e, write e
// and the payload: the bytes it must move) over the GB/s of cudaMemcpy
// device to device (read + write). Each figure is the median wall time of
// --reps calls, each call followed by a stream synchronisation, so launch
// and result-readback costs count as a caller sees them.
//
// Without a usable GPU it says so and exits 0: there is nothing to measure.
//
//   onebit-bench-gpu-codec [--elements N] [--reps R] [--block B] [--scale l1|l2]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "cuda/memory.h"

namespace {

using Clock = std::chrono::steady_clock;
using onebit::cuda::DeviceBuffer;

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "onebit-bench-gpu-codec: %s: %s\n", what,
                 std::string(s.message()).c_str());
    std::exit(1);
  }
}

DeviceBuffer Alloc(size_t bytes) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Create(bytes);
  Check(b.status(), "allocating device memory");
  return std::move(*b);
}

DeviceBuffer Fill(const std::vector<float>& host) {
  DeviceBuffer b = Alloc(4 * host.size());
  Check(onebit::cuda::CopyToDevice(b.data(), host.data(), 4 * host.size()), "upload");
  return b;
}

// Median seconds of `reps` calls of fn (each synchronised), after two warm-ups.
double MedianSeconds(int reps, const std::function<absl::Status()>& fn) {
  std::vector<double> t;
  for (int r = -2; r < reps; ++r) {
    const auto start = Clock::now();
    Check(fn(), "kernel");
    Check(onebit::cuda::Synchronize(nullptr), "synchronize");
    if (r >= 0) t.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double Row(const char* what, double bytes, double sec, double copy_gbps) {
  const double gbps = bytes / sec / 1e9;
  std::printf("%-40s %9.3f ms %9.1f GB/s %6.2f x copy\n", what, sec * 1e3, gbps,
              copy_gbps > 0 ? gbps / copy_gbps : 1.0);
  return gbps;
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{64} << 20;
  int reps = 20;
  uint32_t block = 2048;
  onebit::ScaleRule rule = onebit::ScaleRule::kL1;
  constexpr char kUsage[] =
      "usage: onebit-bench-gpu-codec [--elements N] [--reps R] [--block B] [--scale l1|l2]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const char* value = i + 1 < argc ? argv[i + 1] : "";
    bool ok = true;
    if (arg == "--help" || arg == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (arg == "--elements") {
      ok = absl::SimpleAtoi(value, &n) && n > 0;
    } else if (arg == "--reps") {
      ok = absl::SimpleAtoi(value, &reps) && reps > 0;
    } else if (arg == "--block") {
      ok = absl::SimpleAtoi(value, &block) && block >= 32 && block % 32 == 0;
    } else if (arg == "--scale") {
      auto r = onebit::ParseScaleRule(value);
      ok = r.ok();
      if (ok) rule = *r;
    } else {
      std::fprintf(stderr, "%sunknown flag: %s\n", kUsage, arg.c_str());
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "onebit-bench-gpu-codec: bad value \"%s\" for %s\n", value, arg.c_str());
      return 2;
    }
    ++i;
  }

  std::string why;
  if (onebit::cuda::DeviceCount(&why) == 0) {
    std::printf("onebit-bench-gpu-codec: no CUDA device (%s); nothing to measure\n", why.c_str());
    return 0;
  }

  std::vector<float> hy(n), he(n), hx(n), hden(n), hv(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    hy[i] = normal(rng);
    he[i] = 0.01f * normal(rng);
    hx[i] = normal(rng);
    hv[i] = 1e-4f * std::fabs(normal(rng)) + 1e-8f;
    hden[i] = std::sqrt(hv[i]) + 1e-8f;
  }
  const size_t nb = (n + block - 1) / block;
  const size_t payload = 4 * nb + (n + 7) / 8;
  DeviceBuffer y = Fill(hy), e = Fill(he), e2 = Fill(he), x = Fill(hx), den = Fill(hden);
  DeviceBuffer m = Fill(he), v = Fill(hv), g = Fill(hy), acc = Fill(hx), mbar = Alloc(4 * n);
  DeviceBuffer out = Alloc(payload), halves = Alloc(2 * n), scales = Alloc(4 * nb);
  hy.clear();
  hy.shrink_to_fit();

  const double f = 4.0 * n;  // bytes of one fp32 array
  const double bits = static_cast<double>((n + 7) / 8), sc = 4.0 * nb;
  auto* py = y.as<float>();
  auto* pe = e.as<float>();
  auto* pe2 = e2.as<float>();
  auto* pout = out.as<uint8_t>();
  auto* pscales = out.as<float>();
  auto* pbits = out.as<uint8_t>() + 4 * nb;
  auto* ph = halves.as<uint16_t>();

  std::printf("onebit-bench-gpu-codec: %zu elements, onebit-%s-b%u, median of %d calls\n", n,
              std::string(onebit::ScaleRuleName(rule)).c_str(), block, reps);
  const double t_copy = MedianSeconds(
      reps, [&] { return onebit::cuda::CopyOnDevice(e2.data(), e.data(), 4 * n, nullptr); });
  const double copy = Row("cudaMemcpy d2d (rd a, wr b)", 2 * f, t_copy, 0);

  // Fresh e2 for the encodes (the copy above wrote it).
  Check(onebit::cuda::CopyToDevice(e2.data(), he.data(), 4 * n), "upload");
  const double ef = Row(
      "onebit EF encode fused (rd y,e; wr e',c)", 3 * f + bits + sc,
      MedianSeconds(
          reps,
          [&] { return onebit::cuda::OnebitEncode(py, pe, pe2, n, block, rule, pout, nullptr); }),
      copy);
  // Each kernel on its own (OnebitEncode picks one by the block size).
  auto via = [&](onebit::cuda::EncodePath path) {
    return MedianSeconds(reps, [&] {
      return onebit::cuda::OnebitEncodeVia(path, py, pe, pe2, n, block, rule, pout, nullptr);
    });
  };
  const double ef_warp =
      Row("  via the warp kernel", 3 * f + bits + sc, via(onebit::cuda::EncodePath::kWarp), copy);
  const double ef_staged = block <= onebit::cuda::kMaxStagedBlock
                               ? Row("  via the staged kernel", 3 * f + bits + sc,
                                     via(onebit::cuda::EncodePath::kStaged), copy)
                               : 0.0;
  const double inplace_sec = MedianSeconds(reps, [&]() -> absl::Status {
    absl::StatusOr<size_t> bad =
        onebit::cuda::OnebitScales(py, pe2, n, block, rule, scales.as<float>(), nullptr);
    if (!bad.ok()) return bad.status();
    return onebit::cuda::OnebitSigns(py, pe2, n, block, scales.as<float>(), pbits, nullptr);
  });
  const double inplace =
      Row("onebit EF encode in place (2 passes)", 3 * f + bits + sc, inplace_sec, copy);
  Row("  onebit_scales (rd y,e)", 2 * f + sc,
      MedianSeconds(reps,
                    [&]() -> absl::Status {
                      return onebit::cuda::OnebitScales(py, pe2, n, block, rule, scales.as<float>(),
                                                        nullptr)
                          .status();
                    }),
      copy);
  Row("  onebit_signs (rd y,e; wr e,bits)", 3 * f + bits + sc,
      MedianSeconds(reps,
                    [&] {
                      return onebit::cuda::OnebitSigns(py, pe2, n, block, scales.as<float>(), pbits,
                                                       nullptr);
                    }),
      copy);
  Row("onebit encode, no EF (rd y; wr c)", f + bits + sc,
      MedianSeconds(reps,
                    [&] {
                      return onebit::cuda::OnebitEncode(py, nullptr, nullptr, n, block, rule, pout,
                                                        nullptr);
                    }),
      copy);
  Row("onebit decode (rd c; wr out)", f + bits + sc,
      MedianSeconds(reps,
                    [&] {
                      return onebit::cuda::OnebitDecode(pscales, pbits, n, block, mbar.as<float>(),
                                                        nullptr);
                    }),
      copy);
  Row("onebit decode_add (rd c,acc; wr acc)", 2 * f + bits + sc,
      MedianSeconds(reps,
                    [&] {
                      return onebit::cuda::OnebitDecodeAdd(pscales, pbits, n, block, 0.25f,
                                                           acc.as<float>(), nullptr);
                    }),
      copy);
  Row("fp16_check (rd y,e)", 2 * f,
      MedianSeconds(
          reps,
          [&]() -> absl::Status { return onebit::cuda::Fp16Check(py, pe, n, nullptr).status(); }),
      copy);
  Row("fp16 EF encode (rd y,e; wr e,h)", 3.5 * f,
      MedianSeconds(reps, [&] { return onebit::cuda::Fp16Encode(py, pe2, n, ph, nullptr); }), copy);
  Row("fp16 decode (rd h; wr out)", 1.5 * f,
      MedianSeconds(reps,
                    [&] { return onebit::cuda::Fp16Decode(ph, n, mbar.as<float>(), nullptr); }),
      copy);
  Row("fp16 decode_add (rd h,acc; wr acc)", 2.5 * f,
      MedianSeconds(
          reps,
          [&] { return onebit::cuda::Fp16DecodeAdd(ph, n, 0.25f, acc.as<float>(), nullptr); }),
      copy);
  Row("apply momentum (rd mbar,den,x; wr x)", 4 * f,
      MedianSeconds(reps,
                    [&] {
                      return onebit::cuda::ApplyMomentum(mbar.as<float>(), den.as<float>(), 1e-6f,
                                                         0.01f, n, x.as<float>(), nullptr);
                    }),
      copy);
  const onebit::AdamCoefficients c =
      onebit::MakeAdamCoefficients(0.9f, 0.999f, 1e-8f, 0.01f, 1e-6f, false, 0);
  Row("adam (rd g,m,v,x; wr g,m,v,x)", 8 * f,
      MedianSeconds(reps,
                    [&] {
                      return onebit::cuda::AdamUpdate(c, n, g.as<float>(), m.as<float>(),
                                                      v.as<float>(), x.as<float>(), nullptr);
                    }),
      copy);

  std::printf("gpu_copy_gbps=%.1f\n", copy);
  std::printf("gpu_ef_encode_gbps=%.1f\n", ef);
  std::printf("gpu_ef_encode_inplace_vs_copy_ratio=%.3f\n", inplace / copy);
  std::printf("gpu_ef_encode_warp_vs_copy_ratio=%.3f\n", ef_warp / copy);
  if (ef_staged > 0) std::printf("gpu_ef_encode_staged_vs_copy_ratio=%.3f\n", ef_staged / copy);
  std::printf("gpu_ef_encode_vs_copy_ratio=%.3f\n", ef / copy);
  return 0;
}
