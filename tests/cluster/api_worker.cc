// A worker program written against the public API (include/onebit/worker.h)
// for the tests that run it through onebit-launch --worker_cmd. Its model is
// a deterministic quadratic: g_i = x_i - t_i + noise(rank, step, i).
//   --d N            parameters to declare (default 1000)
//   --bad_d_rank R   rank R declares d + 1 instead
//   --init rank|same each rank starts from its own x (rank-dependent) or
//                    every rank from rank 0's values
//   --steps N        steps to run when the job does not fix them
//   --release K      release the gradient in K GradientsReady calls, last
//                    range first (0: one plain Step())
//   --lr V           SetLearningRate(V) before every step (<0: never)
//   --lr_rank R --lr_value V   ... rank R sets V instead
//   --wd B:E:V       parameters [B, E) decay by V instead of the job's
//   --wd_rank R      ... except on rank R, which declares no range
//   --lr_scale B:E:V parameters [B, E) step at the job's lr times V
//   --lr_scale_rank R  ... except on rank R, which declares twice V
//   --set NAME=VALUE a job setting this program chooses (repeatable)
//   --set_rank R     ... on every rank but R, which declares none
//   --layers E1,E2,..  the tensors' ends (WorkerOptions::layer_ends)
//   --layers_rank R  ... except on rank R, which declares one tensor fewer
//   --bad_loss R:T:V rank R reports the loss V (e.g. nan, inf) at step T,
//                    with StepOptions::has_loss
//   --gather         GatherOptimizerState() in step 0 between GradientsReady
//                    and Step (must be refused) and after the last step
//                    (prints the arrays; the servers' x must be this
//                    replica's)
//   --gather_after T GatherOptimizerState() between steps T and T + 1
//   --no_loss        report no loss (StepOptions' default, a NaN)
//   --abort_after_job R  rank R, once finished, waits for the coordinator to
//                    exit (its port to refuse connections) and then aborts,
//                    as a process crashing at its exit would
// Writes its final x to $ONEBIT_DUMP_X when set. Exits 1 with the error.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "onebit/worker.h"

namespace {

float Noise(uint32_t rank, uint64_t step, uint64_t i) {
  uint64_t h = (rank + 1) * 0x9E3779B97F4A7C15ull ^ (step + 7) * 0xC2B2AE3D27D4EB4Full ^ i;
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  return static_cast<float>(static_cast<double>(h >> 40) / (1 << 24) - 0.5) * 0.1f;
}

int Fail(const std::string& what, const absl::Status& st) {
  std::fprintf(stderr, "api_worker: %s: %s\n", what.c_str(), std::string(st.message()).c_str());
  return 1;
}

// Whether 127.0.0.1:port takes a connection.
bool Listening(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = {};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  close(fd);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t d = 1000, steps = 6;
  int bad_d_rank = -1, lr_rank = -1, release = 0, gather_after = -1, abort_rank = -1;
  std::string init = "rank", wd, lr_scale;
  int wd_rank = -1, set_rank = -1, layers_rank = -1, lr_scale_rank = -1;
  std::string layers, bad_loss;
  bool no_loss = false, gather = false;
  std::vector<std::string> settings;
  double lr = -1, lr_value = 0;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--no_loss" || k == "--gather") {
      (k == "--no_loss" ? no_loss : gather) = true;
      --i;  // a flag without a value
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "api_worker: %s needs a value\n", k.c_str());
      return 2;
    }
    const char* v = argv[i + 1];
    if (k == "--d")
      d = std::strtoull(v, nullptr, 10);
    else if (k == "--bad_d_rank")
      bad_d_rank = std::atoi(v);
    else if (k == "--init")
      init = v;
    else if (k == "--steps")
      steps = std::strtoull(v, nullptr, 10);
    else if (k == "--release")
      release = std::atoi(v);
    else if (k == "--gather_after")
      gather_after = std::atoi(v);
    else if (k == "--lr")
      lr = std::atof(v);
    else if (k == "--lr_rank")
      lr_rank = std::atoi(v);
    else if (k == "--lr_value")
      lr_value = std::atof(v);
    else if (k == "--wd")
      wd = v;
    else if (k == "--wd_rank")
      wd_rank = std::atoi(v);
    else if (k == "--lr_scale")
      lr_scale = v;
    else if (k == "--lr_scale_rank")
      lr_scale_rank = std::atoi(v);
    else if (k == "--set")
      settings.push_back(v);
    else if (k == "--set_rank")
      set_rank = std::atoi(v);
    else if (k == "--layers")
      layers = v;
    else if (k == "--layers_rank")
      layers_rank = std::atoi(v);
    else if (k == "--bad_loss")
      bad_loss = v;
    else if (k == "--abort_after_job")
      abort_rank = std::atoi(v);
    else {
      std::fprintf(stderr, "api_worker: unknown argument %s\n", k.c_str());
      return 2;
    }
  }
  const char* r = std::getenv("ONEBIT_RANK");
  const int my_rank = r == nullptr ? -1 : std::atoi(r);
  auto options = onebit::WorkerOptionsFromEnvironment(my_rank == bad_d_rank ? d + 1 : d);
  if (!options.ok()) return Fail("environment", options.status());
  if (!wd.empty() && my_rank != wd_rank) {
    onebit::WeightDecayRange range;
    char* end = nullptr;
    range.begin = std::strtoull(wd.c_str(), &end, 10);
    range.end = std::strtoull(end + 1, &end, 10);
    range.weight_decay = std::strtof(end + 1, nullptr);
    options->weight_decay.push_back(range);
  }
  if (!lr_scale.empty()) {
    onebit::LearningRateScale range;
    char* end = nullptr;
    range.begin = std::strtoull(lr_scale.c_str(), &end, 10);
    range.end = std::strtoull(end + 1, &end, 10);
    range.scale = std::strtof(end + 1, nullptr) * (my_rank == lr_scale_rank ? 2.0f : 1.0f);
    options->lr_scale.push_back(range);
  }
  for (const char* at = layers.c_str(); *at != '\0';) {
    char* end = nullptr;
    options->layer_ends.push_back(std::strtoull(at, &end, 10));
    at = *end == ',' ? end + 1 : end;
  }
  if (my_rank == layers_rank && !options->layer_ends.empty()) {
    options->layer_ends.erase(options->layer_ends.begin());
  }
  for (const std::string& kv : settings) {
    if (my_rank == set_rank) break;
    const size_t eq = kv.find('=');
    options->settings[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  auto connected = onebit::Worker::Connect(*options);
  if (!connected.ok()) return Fail("connect", connected.status());
  onebit::Worker& w = **connected;
  const uint32_t rank = w.rank();
  float* x = w.params();
  for (uint64_t i = 0; i < d; ++i) {
    x[i] = std::sin(0.01f * static_cast<float>(i) + (init == "same" ? 0.0f : 1.0f * rank));
  }
  if (absl::Status st = w.BroadcastParameters(); !st.ok()) return Fail("broadcast", st);
  const uint64_t n = w.job().steps > 0 ? w.job().steps : steps;
  for (uint64_t t = 0; t < n; ++t) {
    const double my_lr = static_cast<int>(rank) == lr_rank ? lr_value : lr;
    if (my_lr >= 0) {
      if (absl::Status st = w.SetLearningRate(static_cast<float>(my_lr)); !st.ok()) {
        return Fail("lr", st);
      }
    }
    float* g = w.grads();
    double loss = 0;
    for (uint64_t i = 0; i < d; ++i) {
      const float target = std::cos(0.003f * static_cast<float>(i));
      g[i] = x[i] - target + Noise(rank, t, i);
      loss += 0.5 * (x[i] - target) * (x[i] - target);
    }
    for (int k = release; k > 0; --k) {
      if (absl::Status st = w.GradientsReady(d * (k - 1) / release, d * k / release); !st.ok()) {
        return Fail("GradientsReady", st);
      }
    }
    if (gather && t == 0) {
      auto mid = w.GatherOptimizerState();
      if (mid.ok()) return Fail("gather", absl::InternalError("a gather mid-step was not refused"));
      std::fprintf(stderr, "api_worker: gather mid-step refused: %s\n",
                   std::string(mid.status().message()).c_str());
    }
    onebit::StepOptions so;
    if (!no_loss) so.loss = loss / static_cast<double>(d);
    if (!bad_loss.empty()) {
      char* end = nullptr;
      const long bad_rank = std::strtol(bad_loss.c_str(), &end, 10);
      const unsigned long long bad_step = std::strtoull(end + 1, &end, 10);
      if (bad_rank == static_cast<long>(rank) && bad_step == t) {
        so.loss = std::strtod(end + 1, nullptr);
        so.has_loss = true;
      }
    }
    auto stats = w.Step(so);
    if (!stats.ok()) return Fail("step", stats.status());
    if (static_cast<int64_t>(t) == gather_after) {
      auto state = w.GatherOptimizerState();
      if (!state.ok()) return Fail("gather", state.status());
      std::fprintf(stderr, "api_worker: rank %u gathered after step %llu\n", rank,
                   static_cast<unsigned long long>(t));
    }
  }
  if (gather) {
    auto state = w.GatherOptimizerState();
    if (!state.ok()) return Fail("gather", state.status());
    std::vector<float> mine(d);
    if (absl::Status st = w.ReadParams(mine.data()); !st.ok()) return Fail("read", st);
    if (state->server["x"] != mine) {
      return Fail("gather", absl::InternalError("the servers' x is not this replica's"));
    }
    std::string server, worker;
    for (const auto& [name, a] : state->server) server += (server.empty() ? "" : ",") + name;
    for (const auto& [name, a] : state->worker) worker += (worker.empty() ? "" : ",") + name;
    std::fprintf(stderr, "api_worker: rank %u state step %llu frozen %d server %s worker %s\n",
                 rank, static_cast<unsigned long long>(state->step), state->frozen ? 1 : 0,
                 server.c_str(), worker.c_str());
  }
  if (const char* dump = std::getenv("ONEBIT_DUMP_X")) {
    std::vector<float> out(d);
    if (absl::Status st = w.ReadParams(out.data()); !st.ok()) return Fail("read", st);
    std::ofstream(dump, std::ios::binary)
        .write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(4 * d));
  }
  if (absl::Status st = w.Finish(); !st.ok()) return Fail("finish", st);
  if (my_rank == abort_rank) {
    const char* coordinator = std::getenv("ONEBIT_COORDINATOR");
    const std::string target = coordinator == nullptr ? "" : coordinator;
    const int port = std::atoi(target.substr(target.rfind(':') + 1).c_str());
    for (int i = 0; i < 3000 && Listening(port); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    std::fprintf(stderr, "api_worker: rank %d aborting after the job\n", my_rank);
    std::abort();
  }
  return 0;
}
