// onebit-bench-pushpull: the data plane alone. Runs onebit-launch with the
// synthetic model's arithmetic skipped (--skip_model), --params floats per
// worker per step, for each workers x servers config, in two phases (fp32
// push and reply as in the warm-up; 1-bit both ways as in the compression
// phase) and several ways (plaintext --insecure; secured with each of
// --ciphers: CURVE, the default, and --data_cipher aes-gcm), and prints
// medians over the steps after the warm-up. Goodput
// counts payload bytes moved (all workers): push+reply = (bytes pushed +
// bytes replied) / step time. The phases overlap (chunks pipeline), so each
// is also timed on its own: push = from a worker's first push to the server
// holding every push, reply = from the first reply sent to the step's end
// (one host's clock). Then, per phase and cipher, what encryption costs:
// the secured step time over the plaintext one (medians of the first
// config), the 1-bit
// plaintext step over the fp32 one, and the last line is
// pushpull_goodput_gbs=<push+reply> of the first config, fp32, plaintext.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "job/flags.h"
#include "util/subprocess.h"

ABSL_FLAG(uint64_t, params, 10000000, "floats pushed and replied per worker per step");
ABSL_FLAG(std::string, configs, "1x1,2x2,2x4", "comma-separated WORKERSxSERVERS");
ABSL_FLAG(int32_t, warmup, 3, "steps left out of the figures");
ABSL_FLAG(int32_t, reps, 10, "measured steps");
ABSL_FLAG(uint64_t, chunk, 1 << 20, "elements per chunk (--chunk_elems)");
ABSL_FLAG(uint64_t, compressed_chunk, 0,
          "elements per chunk of the 1-bit steps (--compressed_chunk_elems; 0: auto)");
ABSL_FLAG(uint32_t, connections, 1,
          "connections from each worker to each server (--data_connections)");
ABSL_FLAG(std::string, ciphers, "curve,aes-gcm",
          "the secured runs' --data_cipher values, comma-separated (empty: plaintext only)");
ABSL_FLAG(std::string, launcher, "", "path of onebit-launch (default: next to this binary)");

namespace onebit {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Figures {
  double step_s = 0, total_gbs = 0, push_s = 0, up_gbs = 0, reply_s = 0, down_gbs = 0;
  size_t steps = 0;
};

// One launch of a w x s job; its medians over the steps after `warmup`.
// `cipher`: the secured run's --data_cipher; empty: --insecure.
Figures RunOnce(const std::string& launcher, int w, int s, bool onebit, const std::string& cipher,
                int warmup, int reps) {
  char tmpl[] = "/tmp/onebit-bench.XXXXXX";
  if (mkdtemp(tmpl) == nullptr) ExitError(1, "mkdtemp failed");
  const std::string dir = tmpl;
  const std::string log = dir + "/launch.log";
  int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  std::vector<std::string> argv = {
      launcher,
      absl::StrCat("--workers=", w),
      absl::StrCat("--servers=", s),
      "--model=synthetic",
      absl::StrCat("--dim=", absl::GetFlag(FLAGS_params)),
      absl::StrCat("--steps=", warmup + reps),
      "--skip_model",
      absl::StrCat("--chunk_elems=", absl::GetFlag(FLAGS_chunk)),
      absl::StrCat("--compressed_chunk_elems=", absl::GetFlag(FLAGS_compressed_chunk)),
      absl::StrCat("--data_connections=", absl::GetFlag(FLAGS_connections)),
      "--out=" + dir + "/run"};
  if (onebit) {
    // Compression from step 1: every measured step is 1-bit both ways.
    argv.insert(argv.end(), {"--optimizer=onebit-adam", "--freeze_step=1"});
  } else {
    argv.push_back("--optimizer=sgd");
  }
  if (cipher.empty()) {
    argv.push_back("--insecure");
  } else {
    argv.push_back("--data_cipher=" + cipher);
  }
  auto p = Subprocess::Spawn(argv, fd, fd);
  close(fd);
  if (!p.ok()) ExitError(1, std::string(p.status().message()));
  auto code = p->Wait(absl::Minutes(10));
  if (!code || *code != 0) {
    std::ifstream in(log);
    std::stringstream ss;
    ss << in.rdbuf();
    std::fprintf(stderr, "%s\n", ss.str().c_str());
    ExitError(1, absl::StrCat(w, "x", s, ": onebit-launch failed"));
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
  Figures out;
  out.steps = step_s.size();
  out.step_s = Median(step_s);
  out.total_gbs = Median(total);
  out.push_s = Median(push_s);
  out.up_gbs = Median(up);
  out.reply_s = Median(reply_s);
  out.down_gbs = Median(down);
  return out;
}

int Main(int argc, char** argv) {
  ParseFlagsOrExit(argc, argv, "onebit-bench-pushpull [--params 10000000] [--configs 1x1,2x2,2x4]");
  std::string launcher = absl::GetFlag(FLAGS_launcher);
  if (launcher.empty()) {
    launcher = std::filesystem::read_symlink("/proc/self/exe").parent_path() / "onebit-launch";
  }
  const int warmup = absl::GetFlag(FLAGS_warmup), reps = absl::GetFlag(FLAGS_reps);
  if (warmup < 1) ExitFlagError("warmup", "must be >= 1 (step 0 is fp32 in every job)");
  if (reps < 1) ExitFlagError("reps", "must be >= 1");
  double first_total = -1;
  // "" (plaintext), then each cipher
  std::vector<std::string> ways = {""};
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_ciphers), ',', absl::SkipEmpty())) {
    if (c != "curve" && c != "aes-gcm") {
      ExitFlagError("ciphers", absl::StrCat("unknown cipher '", c, "' (want curve or aes-gcm)"));
    }
    ways.emplace_back(c);
  }
  // phase -> way -> step time of the first config (-1: none yet)
  std::vector<std::vector<double>> first_steps(2, std::vector<double>(ways.size(), -1));
  for (absl::string_view cfg : absl::StrSplit(absl::GetFlag(FLAGS_configs), ',')) {
    std::vector<std::string> wxs = absl::StrSplit(cfg, 'x');
    int w = 0, s = 0;
    if (wxs.size() != 2 || !absl::SimpleAtoi(wxs[0], &w) || !absl::SimpleAtoi(wxs[1], &s) ||
        w < 1 || s < 1) {
      ExitFlagError("configs", absl::StrCat("bad config '", cfg, "' (want WxS)"));
    }
    for (int phase = 0; phase < 2; ++phase) {
      for (size_t way = 0; way < ways.size(); ++way) {
        const Figures f = RunOnce(launcher, w, s, phase == 1, ways[way], warmup, reps);
        std::printf(
            "pushpull %dx%d d=%llu %s %s chunk=%llu (median of %zu steps): step %.2f ms, "
            "push+reply %.3f GB/s | push phase %.2f ms %.3f GB/s, reply phase %.2f ms %.3f GB/s\n",
            w, s, static_cast<unsigned long long>(absl::GetFlag(FLAGS_params)),
            phase == 1 ? "onebit" : "fp32", way == 0 ? "plain" : ways[way].c_str(),
            static_cast<unsigned long long>(absl::GetFlag(FLAGS_chunk)), f.steps, f.step_s * 1e3,
            f.total_gbs, f.push_s * 1e3, f.up_gbs, f.reply_s * 1e3, f.down_gbs);
        std::fflush(stdout);
        if (first_steps[phase][way] < 0) first_steps[phase][way] = f.step_s;
        if (first_total < 0) first_total = f.total_gbs;
      }
    }
  }
  for (size_t way = 1; way < ways.size(); ++way) {
    for (int phase = 0; phase < 2; ++phase) {
      std::printf("%s_vs_plain_step_ratio_%s=%.3f\n", ways[way] == "curve" ? "curve" : "aes_gcm",
                  phase == 1 ? "onebit" : "fp32", first_steps[phase][way] / first_steps[phase][0]);
    }
  }
  // The 1-bit step's cost against fp32's, both plaintext, first config: on
  // loopback what is left of it is CPU work (encode, decode, the updates).
  std::printf("onebit_vs_fp32_plain_step_ratio=%.3f\n", first_steps[1][0] / first_steps[0][0]);
  std::printf("pushpull_goodput_gbs=%.3f\n", first_total);
  return 0;
}

}  // namespace
}  // namespace onebit

int main(int argc, char** argv) { return onebit::Main(argc, argv); }
