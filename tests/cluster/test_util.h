// Helpers for the tests: running the binaries, reading run folders,
// in-process coordinators on loopback,
// and the single-process reference of a job (the oracle of docs/design.md §1.5
// for sgd/adam: same model, same codecs, same update rule, same order).
#ifndef ONEBIT_TESTS_CLUSTER_TEST_UTIL_H_
#define ONEBIT_TESTS_CLUSTER_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "optim/optimizer.h"
#include "proto/control.grpc.pb.h"
#include "proto/control.pb.h"
#include "util/subprocess.h"

namespace onebit::testing {

// A field of summary.json as its JSON text ("true", "20", "null",
// "\"onebit\"", "[\"cpu\", \"cuda:0\"]"): the rest of the key's line.
std::string Field(const std::string& summary, const std::string& key);

// Path of a binary in the build root, e.g. Bin("onebit-launch"); the
// environment's ONEBIT_TEST_BIN_DIR, when set, instead (binaries built on
// another machine, as tools/gpu-check runs them).
std::string Bin(const std::string& name);

// A fresh empty folder under the test's temporary directory.
std::string TempDir(const std::string& name);

// "--secret_file=PATH" of a job secret made once per test process, for
// processes a test starts by hand (onebit-launch makes its own).
std::string SecretFlag();
// That secret's file.
std::string SecretFile();

struct RunResult {
  int code = -1;       // -1: timed out (the process was killed)
  std::string output;  // stdout + stderr
};

// Runs argv to completion (or kills it after `timeout`).
RunResult RunCommand(const std::vector<std::string>& argv, absl::Duration timeout);

// Starts argv with stdout+stderr going to `log_path`.
Subprocess Start(const std::vector<std::string>& argv, const std::string& log_path);

// A loopback TCP port that nothing holds now, drawn below Linux's
// ephemeral range (32768 up), so that no process's outgoing connection or
// port-0 listener is handed it meanwhile; for a process that must be told
// its port before it starts. Aborts the test if none is found.
int FreeLocalPort();

std::string ReadFile(const std::string& path);
// Whether the file at `path` contains `text` within `timeout` (polled).
bool WaitForText(const std::string& path, const std::string& text, absl::Duration timeout);
// Live processes whose command line contains `text` (zombies have none).
std::vector<int> ProcessesMentioning(const std::string& text);
std::vector<float> ReadFloats(const std::string& path);

// Bitwise equality of two float vectors; on mismatch, a message naming the
// first differing index.
std::string FirstDifference(const std::vector<float>& a, const std::vector<float>& b,
                            uint64_t offset = 0);

struct ReferenceResult {
  std::vector<float> x;                     // worker 0's replica
  std::vector<std::vector<float>> workers;  // every worker's replica
  std::vector<WorkerState> worker_states;   // every worker's whole state
  std::vector<ServerShardState> masters;    // one per shard
  std::vector<double> losses;               // mean over workers, per step
  uint64_t freeze_step = kNever;
  std::vector<uint64_t> push_bytes;   // payload bytes per step, all workers
  std::vector<uint64_t> reply_bytes;  // payload bytes per step, all workers
};

// The whole job in one process (optim/reference.h) on the synthetic model.
ReferenceResult Reference(const control::TrainingConfig& config);

// The config the launcher would build from these flag values (defaults as in
// job/config.cc for the rest).
control::TrainingConfig MakeConfig(uint32_t workers, uint32_t servers, uint64_t dim, uint64_t steps,
                                   const std::string& optimizer);

// Sets the job setting `name` (its flag's name) of *config from its text,
// as the flag would ("onebit-adam", "fp16"); a bad value fails the test.
void SetSetting(control::TrainingConfig* config, const char* name, const std::string& text);

// Flags for onebit-launch / onebit-coordinator that express `config`.
std::vector<std::string> ConfigArgs(const control::TrainingConfig& config);

// A socket listening on 127.0.0.1, and a port on which nothing listens
// (bound, then closed: nothing else on this machine takes it that fast).
struct Ports {
  int listening_fd = -1;
  std::string listening, gone;
  Ports();
  ~Ports();
};

// A coordinator service served on a free loopback port, and a stub to it
// (server null when it could not listen).
struct LocalCoordinator {
  std::unique_ptr<grpc::Server> server;
  std::string target;
  std::unique_ptr<control::Coordinator::Stub> stub;
};

LocalCoordinator ServeLocally(control::Coordinator::Service* svc);

}  // namespace onebit::testing

#endif  // ONEBIT_TESTS_CLUSTER_TEST_UTIL_H_
