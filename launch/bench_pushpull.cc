// onebit-bench-pushpull: the data plane alone. Runs onebit-launch with the
// synthetic model's arithmetic skipped (--skip_model), fp32 push and reply of
// --params floats per worker per step, for each workers x servers config, and
// prints medians over the steps after the warm-up. Goodput counts value bytes
// moved (all workers): push+reply = (bytes pushed + bytes replied) / step
// time. The phases overlap (chunks pipeline), so each is also timed on its
// own: push = from a worker's first push to the server holding every push,
// reply = from the first reply sent to the step's end (one host's clock).
// The last line is pushpull_goodput_gbs=<push+reply> of the first config.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "net/flags.h"
#include "net/subprocess.h"

ABSL_FLAG(uint64_t, params, 10000000, "floats pushed and replied per worker per step");
ABSL_FLAG(std::string, configs, "1x1,2x2,2x4", "comma-separated WORKERSxSERVERS");
ABSL_FLAG(int32_t, warmup, 3, "steps left out of the figures");
ABSL_FLAG(int32_t, reps, 10, "measured steps");
ABSL_FLAG(uint64_t, chunk, 1 << 20, "elements per chunk (--chunk_elems)");
ABSL_FLAG(std::string, launcher, "", "path of onebit-launch (default: next to this binary)");

namespace onebit {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Main(int argc, char** argv) {
  ParseFlagsOrExit(argc, argv, "onebit-bench-pushpull [--params 10000000] [--configs 1x1,2x2,2x4]");
  std::string launcher = absl::GetFlag(FLAGS_launcher);
  if (launcher.empty()) {
    launcher = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "onebit-launch";
  }
  const int warmup = absl::GetFlag(FLAGS_warmup), reps = absl::GetFlag(FLAGS_reps);
  if (warmup < 0) ExitFlagError("warmup", "must be >= 0");
  if (reps < 1) ExitFlagError("reps", "must be >= 1");
  double first_total = -1;
  for (absl::string_view cfg : absl::StrSplit(absl::GetFlag(FLAGS_configs), ',')) {
    std::vector<std::string> wxs = absl::StrSplit(cfg, 'x');
    int w = 0, s = 0;
    if (wxs.size() != 2 || !absl::SimpleAtoi(wxs[0], &w) || !absl::SimpleAtoi(wxs[1], &s) ||
        w < 1 || s < 1) {
      ExitFlagError("configs", absl::StrCat("bad config '", cfg, "' (want WxS)"));
    }
    char tmpl[] = "/tmp/onebit-bench.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) ExitError(1, "mkdtemp failed");
    const std::string dir = tmpl;
    const std::string log = dir + "/launch.log";
    int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    auto p = Subprocess::Spawn(
        {launcher, absl::StrCat("--workers=", w), absl::StrCat("--servers=", s),
         "--model=synthetic", absl::StrCat("--dim=", absl::GetFlag(FLAGS_params)),
         absl::StrCat("--steps=", warmup + reps), "--skip_model", "--optimizer=sgd",
         absl::StrCat("--chunk_elems=", absl::GetFlag(FLAGS_chunk)), "--out=" + dir + "/run"},
        fd, fd);
    close(fd);
    if (!p.ok()) ExitError(1, std::string(p.status().message()));
    auto code = p->Wait(absl::Minutes(10));
    if (!code || *code != 0) {
      std::ifstream in(log);
      std::stringstream ss;
      ss << in.rdbuf();
      std::fprintf(stderr, "%s\n", ss.str().c_str());
      ExitError(1, absl::StrCat("config ", cfg, ": onebit-launch failed"));
    }
    std::ifstream csv(dir + "/run/metrics.csv");
    std::string line;
    std::getline(csv, line);  // header
    std::vector<double> step_s, up, down, total, push_s, reply_s;
    while (std::getline(csv, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ',');
      uint64_t step = 0;
      double bu = 0, bd = 0, ss = 0, ps = 0, rs = 0;
      if (f.size() < 9 || !absl::SimpleAtoi(f[0], &step) || !absl::SimpleAtod(f[4], &bu) ||
          !absl::SimpleAtod(f[5], &bd) || !absl::SimpleAtod(f[6], &ss) ||
          !absl::SimpleAtod(f[7], &ps) || !absl::SimpleAtod(f[8], &rs)) {
        ExitError(1, absl::StrCat("bad metrics line: ", line));
      }
      if (step < static_cast<uint64_t>(warmup)) continue;
      step_s.push_back(ss);
      push_s.push_back(ps);
      reply_s.push_back(rs);
      up.push_back(bu / ps / 1e9);
      down.push_back(bd / rs / 1e9);
      total.push_back((bu + bd) / ss / 1e9);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    const double gt = Median(total);
    std::printf(
        "pushpull %dx%d d=%llu fp32 chunk=%llu (median of %zu steps): step %.1f ms, "
        "push+reply %.3f GB/s | push phase %.1f ms %.3f GB/s, reply phase %.1f ms %.3f GB/s\n",
        w, s, static_cast<unsigned long long>(absl::GetFlag(FLAGS_params)),
        static_cast<unsigned long long>(absl::GetFlag(FLAGS_chunk)), step_s.size(),
        Median(step_s) * 1e3, gt, Median(push_s) * 1e3, Median(up), Median(reply_s) * 1e3,
        Median(down));
    std::fflush(stdout);
    if (first_total < 0) first_total = gt;
  }
  std::printf("pushpull_goodput_gbs=%.3f\n", first_total);
  return 0;
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
