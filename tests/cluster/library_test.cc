// The three roles as library calls (include/onebit/server.h, worker.h): a
// whole job — coordinator, 2 servers, 3 workers — on threads of one process,
// over 127.0.0.1. Each call stands alone: nothing global is shared.
#include <atomic>
#include <cmath>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "onebit/server.h"
#include "onebit/worker.h"
#include "tests/cluster/test_util.h"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;

TEST(Library, AWholeJobOnThreadsOfOneProcess) {
  const std::string dir = TempDir("library");
  std::atomic<int> port{0};
  CoordinatorOptions co;
  co.secret_file = SecretFile();
  co.config_json =
      R"({"workers": 3, "servers": 2, "model": "external", "optimizer": "onebit-adam",
          "freeze_step": 2, "lr": 0.01, "block_size": 32, "chunk_elems": 64})";
  co.bind_host = "127.0.0.1";
  co.port = 0;
  co.on_listening = [&](int p) { port = p; };
  co.out = dir;
  co.register_timeout = absl::Seconds(20);
  absl::Status coordinator_status;
  std::thread coordinator([&] { coordinator_status = RunCoordinator(co); });
  while (port == 0) absl::SleepFor(absl::Milliseconds(5));
  const std::string target = absl::StrCat("127.0.0.1:", port.load());

  std::vector<absl::Status> server_status(2);
  std::vector<std::thread> servers;
  for (int k = 0; k < 2; ++k) {
    servers.emplace_back([&, k] {
      ServerOptions so;
      so.coordinator = target;
      so.secret_file = SecretFile();
      so.shard = k;
      so.bind_host = so.advertise_host = "127.0.0.1";
      so.register_timeout = absl::Seconds(20);
      server_status[k] = RunServer(so);
    });
  }
  constexpr uint64_t kD = 300;
  std::vector<absl::Status> worker_status(3);
  std::vector<std::vector<float>> x(3, std::vector<float>(kD));
  std::vector<std::thread> workers;
  for (int r = 0; r < 3; ++r) {
    workers.emplace_back([&, r] {
      WorkerOptions wo;
      wo.coordinator = target;
      wo.secret_file = SecretFile();
      wo.rank = r;
      wo.num_params = kD;
      wo.bind_host = wo.advertise_host = "127.0.0.1";
      wo.register_timeout = absl::Seconds(20);
      auto w = Worker::Connect(wo);
      if (!w.ok()) {
        worker_status[r] = w.status();
        return;
      }
      for (uint64_t i = 0; i < kD; ++i) (*w)->params()[i] = std::cos(0.1f * i);
      absl::Status st = (*w)->BroadcastParameters();
      for (int t = 0; t < 5 && st.ok(); ++t) {
        for (uint64_t i = 0; i < kD; ++i) {
          (*w)->grads()[i] = (*w)->params()[i] - 0.5f + 0.01f * static_cast<float>(r + t);
        }
        st = (*w)->Step().status();
      }
      if (st.ok()) st = (*w)->ReadParams(x[r].data());
      if (st.ok()) st = (*w)->Finish();
      worker_status[r] = st;
    });
  }
  for (auto& t : workers) t.join();
  for (auto& t : servers) t.join();
  coordinator.join();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(worker_status[r].ok()) << r << ": " << worker_status[r];
  for (int k = 0; k < 2; ++k) EXPECT_TRUE(server_status[k].ok()) << k << ": " << server_status[k];
  EXPECT_TRUE(coordinator_status.ok()) << coordinator_status;
  const std::string summary = ReadFile(dir + "/summary.json");
  EXPECT_EQ(Field(summary, "replicas_equal"), "true");
  EXPECT_EQ(Field(summary, "steps"), "5");
  EXPECT_EQ(Field(summary, "compress_steps"), "3");
  EXPECT_EQ(FirstDifference(x[1], x[0]), "");
  EXPECT_EQ(FirstDifference(x[2], x[0]), "");
}

TEST(Library, BadOptionsAreErrorsNamingTheField) {
  EXPECT_THAT(std::string(RunServer(ServerOptions{}).message()),
              HasSubstr("ServerOptions.coordinator"));
  CoordinatorOptions co;
  co.config_json = R"({"workers": 0})";
  EXPECT_THAT(std::string(RunCoordinator(co).message()), HasSubstr("--workers"));
  co.config_json = "not json";
  EXPECT_THAT(std::string(RunCoordinator(co).message()), HasSubstr("not a JSON object"));
  EXPECT_THAT(std::string(Worker::Connect(WorkerOptions{}).status().message()),
              HasSubstr("WorkerOptions.coordinator"));
  // Neither a secret nor insecure: refused before anything starts.
  ServerOptions no_secret;
  no_secret.coordinator = "127.0.0.1:1";
  EXPECT_THAT(std::string(RunServer(no_secret).message()),
              HasSubstr("no job secret: give ServerOptions.secret_file"));
  WorkerOptions wo;
  wo.coordinator = "127.0.0.1:1";
  EXPECT_THAT(std::string(Worker::Connect(wo).status().message()),
              HasSubstr("no job secret: give WorkerOptions.secret_file"));
  co.config_json = "{}";
  co.port = 0;
  EXPECT_THAT(std::string(RunCoordinator(co).message()),
              HasSubstr("no job secret: give CoordinatorOptions.secret_file"));
  ServerOptions so;
  so.coordinator = "127.0.0.1:1";
  so.shard = -2;
  EXPECT_EQ(RunServer(so).message(), "ServerOptions.shard: must be -1 (any) or a shard");
  co.config_json = "{}";
  co.health_port = 70000;
  EXPECT_EQ(RunCoordinator(co).message(), "CoordinatorOptions.health_port: must be in [0, 65535]");
  co.health_port = 0;
  co.metrics_port = -2;
  EXPECT_EQ(RunCoordinator(co).message(),
            "CoordinatorOptions.metrics_port: must be -1 (none) or in [0, 65535]");
  co.metrics_port = 0;
  for (absl::Duration linger : {absl::Seconds(-1), absl::InfiniteDuration()}) {
    co.metrics_linger = linger;
    EXPECT_EQ(RunCoordinator(co).message(),
              "CoordinatorOptions.metrics_linger: must be in [0s, 1h]");
  }
}

// A timeout that cannot bound a wait (negative, zero, endless) is refused up
// front, naming the option, instead of failing at once or waiting forever.
TEST(Library, TimeoutsMustBePositiveAndFinite) {
  for (const auto& [timeout, why] : std::vector<std::pair<absl::Duration, std::string>>{
           {absl::Seconds(-5), "must be > 0"},
           {absl::ZeroDuration(), "must be > 0"},
           {absl::InfiniteDuration(), "must be finite"}}) {
    ServerOptions so;
    so.coordinator = "127.0.0.1:1";
    so.bind_host = "127.0.0.1";
    so.register_timeout = timeout;
    absl::Status s = RunServer(so);
    EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
    EXPECT_EQ(s.message(), "ServerOptions.register_timeout: " + why);

    CoordinatorOptions co;
    co.bind_host = "127.0.0.1";
    co.port = 0;
    co.register_timeout = timeout;
    absl::Status c = RunCoordinator(co);
    EXPECT_TRUE(absl::IsInvalidArgument(c)) << c;
    EXPECT_EQ(c.message(), "CoordinatorOptions.register_timeout: " + why);

    WorkerOptions wo;
    wo.coordinator = "127.0.0.1:1";
    wo.bind_host = "127.0.0.1";
    wo.register_timeout = timeout;
    absl::Status w = Worker::Connect(wo).status();
    EXPECT_TRUE(absl::IsInvalidArgument(w)) << w;
    EXPECT_EQ(w.message(), "WorkerOptions.register_timeout: " + why);
  }
}

}  // namespace
}  // namespace onebit::testing
