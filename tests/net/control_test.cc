// The control-plane client (net/control.h, net/liveness.h): the liveness
// probe, and the heartbeater against coordinators that answer slowly, late
// or not at all, served in-process on 127.0.0.1.
#include "net/control.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "net/liveness.h"
#include "tests/cluster/test_util.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;
using testing::LocalCoordinator;
using testing::Ports;
using testing::ServeLocally;

TEST(Liveness, AProbeTellsAListeningProcessFromAGoneOne) {
  Ports ports;
  const std::vector<Liveness> answers = ProbeListening(
      {ports.listening, ports.gone, "", "no-port", "127.0.0.1:notaport", ports.listening},
      absl::Seconds(1));
  EXPECT_EQ(answers,
            (std::vector<Liveness>{Liveness::kListening, Liveness::kGone, Liveness::kUnknown,
                                   Liveness::kUnknown, Liveness::kUnknown, Liveness::kListening}));
}

// A prober that gets the CPU only after its deadline (a starved
// coordinator) still reads the connections the kernel completed meanwhile:
// with no time at all, a loopback connection has completed by the one look
// it takes, and nothing listening is still told apart.
TEST(Liveness, AProberPastItsDeadlineStillReadsCompletedConnections) {
  Ports ports;
  for (int round = 0; round < 30; ++round) {  // 90 of the backlog's 128
    const std::vector<Liveness> answers = ProbeListening(
        {ports.listening, ports.listening, ports.gone, ports.listening}, absl::ZeroDuration());
    ASSERT_EQ(answers, (std::vector<Liveness>{Liveness::kListening, Liveness::kListening,
                                              Liveness::kGone, Liveness::kListening}))
        << "round " << round;
  }
}

// Each rank once until taken, in order; ranks beyond the job's are not
// kept; marks from several threads at once all arrive.
TEST(PeersHeard, EachRankOnceUntilTakenAndNoneBeyondTheJob) {
  PeersHeard heard(4);
  EXPECT_EQ(heard.Take(), std::vector<uint32_t>{});
  heard.Heard(2);
  heard.Heard(0);
  heard.Heard(2);
  heard.Heard(4);
  heard.Heard(1000);
  EXPECT_EQ(heard.Take(), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(heard.Take(), std::vector<uint32_t>{});
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < 3; ++t) {
    threads.emplace_back([&heard, t] {
      for (int i = 0; i < 10000; ++i) heard.Heard(t == 2 ? 3 : t);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(heard.Take(), (std::vector<uint32_t>{0, 1, 3}));
}

// A coordinator that records each heartbeat's `heard`, and fails the first
// call that carries any (a heartbeat lost on the way).
class HeardRecordingCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply*) override {
    absl::MutexLock l(&mu_);
    if (req->heard_size() == 0) return grpc::Status::OK;
    calls_.emplace_back(req->heard().begin(), req->heard().end());
    if (calls_.size() == 1) return grpc::Status(grpc::StatusCode::INTERNAL, "lost");
    return grpc::Status::OK;
  }
  std::vector<std::vector<uint32_t>> Calls() {
    absl::MutexLock l(&mu_);
    return calls_;
  }
  absl::Mutex mu_;
  std::vector<std::vector<uint32_t>> calls_ ABSL_GUARDED_BY(mu_);
};

// A heartbeat carries the peers heard since the previous one, each once; a
// heartbeat that did not get through leaves them for the next.
TEST(Heartbeater, EachHeartbeatCarriesThePeersHeardSinceThePreviousOne) {
  HeardRecordingCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  auto heard = std::make_shared<PeersHeard>(5);
  Heartbeater hb(local.stub.get(), local.target, control::SERVER, 0, 42, absl::Milliseconds(20),
                 absl::Seconds(10));
  hb.SetPeersHeard(heard);
  hb.Start();
  auto wait_for_calls = [&](size_t n) {
    const absl::Time until = absl::Now() + absl::Seconds(10);
    while (svc.Calls().size() < n && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
    return svc.Calls();
  };
  heard->Heard(3);
  heard->Heard(1);
  std::vector<std::vector<uint32_t>> calls = wait_for_calls(2);
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0], (std::vector<uint32_t>{1, 3}));
  EXPECT_EQ(calls[1], (std::vector<uint32_t>{1, 3})) << "the lost heartbeat's peers";
  absl::SleepFor(absl::Milliseconds(200));  // ten more heartbeats: nothing heard
  EXPECT_EQ(svc.Calls().size(), 2u);
  heard->Heard(4);
  calls = wait_for_calls(3);
  ASSERT_EQ(calls.size(), 3u);
  EXPECT_EQ(calls[2], std::vector<uint32_t>{4});
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A coordinator that answers heartbeats slowly and records, for Done, which
// metrics had been counted when it came.
class SlowCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply*) override {
    entered_ = true;
    absl::SleepFor(absl::Milliseconds(400));
    absl::MutexLock l(&mu_);
    for (const auto& m : req->metrics()) counted_.push_back(m.step());
    return grpc::Status::OK;
  }
  grpc::Status Done(grpc::ServerContext*, const control::DoneRequest* req,
                    control::DoneReply*) override {
    absl::MutexLock l(&mu_);
    before_done_ = counted_;
    for (const auto& m : req->metrics()) with_done_.push_back(m.step());
    return grpc::Status::OK;
  }
  std::atomic<bool> entered_{false};  // a heartbeat has reached it
  absl::Mutex mu_;
  std::vector<uint64_t> counted_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> before_done_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> with_done_ ABSL_GUARDED_BY(mu_);
};

// The coordinator may end the job on Done: metrics a heartbeat still
// carries must have been counted before Done comes, else they are lost.
TEST(Heartbeater, DoneComesAfterTheHeartbeatInFlightIsAnswered) {
  SlowCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  const std::string& target = local.target;
  control::Coordinator::Stub* stub = local.stub.get();
  Heartbeater hb(stub, target, control::WORKER, 0, 42, absl::Seconds(30), absl::Seconds(10));
  hb.Start();
  for (uint64_t step = 0; step < 5; ++step) {
    control::StepMetrics m;
    m.set_step(step);
    hb.AddMetrics(m);
  }
  hb.Kick();
  // That heartbeat is being answered when Done goes out.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!svc.entered_ && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
  ASSERT_TRUE(svc.entered_);
  control::StepMetrics last;
  last.set_step(5);
  hb.AddMetrics(last);
  EXPECT_TRUE(hb.Done({}, 6).ok());
  std::vector<uint64_t> before_done, with_done;
  {
    absl::MutexLock l(&svc.mu_);
    before_done = svc.before_done_;
    with_done = svc.with_done_;
  }
  EXPECT_EQ(before_done, (std::vector<uint64_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(with_done, (std::vector<uint64_t>{5}));
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A coordinator that answers heartbeats at once but its first Done too late
// (a crowded host at the end of a large job): counts the Done calls.
class LateDoneCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest*,
                         control::HeartbeatReply*) override {
    return grpc::Status::OK;
  }
  grpc::Status Done(grpc::ServerContext*, const control::DoneRequest*,
                    control::DoneReply*) override {
    if (calls_.fetch_add(1) == 0) absl::SleepFor(absl::Milliseconds(900));
    return grpc::Status::OK;
  }
  std::atomic<int> calls_{0};
};

// Its answer missed the deadline, so Done asks again (the coordinator
// answers a repeated Done of a counted process), rather than failing a
// process whose job ended well.
TEST(Heartbeater, ADoneAnsweredTooLateIsSentAgain) {
  LateDoneCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  Heartbeater hb(local.stub.get(), local.target, control::WORKER, 0, 42, absl::Seconds(30),
                 absl::Milliseconds(300));
  hb.Start();
  absl::Status st = hb.Done({}, 1);
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_GE(svc.calls_.load(), 2);
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A coordinator that answers each heartbeat after `delay_` (a starved
// one), with ABORT and a reason.
class LateAnsweringCoordinator final : public control::Coordinator::Service {
 public:
  explicit LateAnsweringCoordinator(absl::Duration delay) : delay_(delay) {}
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const control::HeartbeatRequest*,
                         control::HeartbeatReply* reply) override {
    const absl::Time until = absl::Now() + delay_;
    while (absl::Now() < until && !ctx->IsCancelled()) absl::SleepFor(absl::Milliseconds(10));
    reply->set_command(control::ABORT);
    reply->set_reason("answered late");
    return grpc::Status::OK;
  }
  const absl::Duration delay_;
};

// A heartbeat waits for its answer as long as the heartbeat timeout (at
// least 2 s): an answer 2.5 s late, within a 4 s timeout, is heard. With a
// fixed 2 s deadline no call of a process came back from a coordinator this
// late, and the coordinator heard none of them either.
TEST(Heartbeater, AnAnswerLateButWithinTheTimeoutIsHeard) {
  LateAnsweringCoordinator svc(absl::Milliseconds(2500));
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  Heartbeater hb(local.stub.get(), local.target, control::WORKER, 0, 42, absl::Milliseconds(100),
                 absl::Seconds(4));
  hb.Start();
  EXPECT_EQ(hb.WaitForCommand(absl::Seconds(8)), control::ABORT);
  EXPECT_EQ(hb.reason(), "answered late");
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// Its longer wait does not hold up a process that exits: the call in
// flight is cancelled after 2 s.
TEST(Heartbeater, AHeartbeatInFlightDoesNotHoldUpExit) {
  LateAnsweringCoordinator svc(absl::Seconds(6));
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  auto hb = std::make_unique<Heartbeater>(local.stub.get(), local.target, control::WORKER, 0, 42,
                                          absl::Milliseconds(50), absl::Seconds(10));
  hb->Start();
  absl::SleepFor(absl::Milliseconds(300));  // its first call is in flight
  const absl::Time start = absl::Now();
  hb.reset();
  const absl::Duration exit_took = absl::Now() - start;
  EXPECT_LT(exit_took, absl::Seconds(4));
  EXPECT_GE(exit_took, absl::Milliseconds(1500));
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

// A coordinator whose heartbeats do not come back in time (a crowded host):
// each call waits until released, longer than the client's deadline.
class UnansweringCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest*,
                         control::HeartbeatReply*) override {
    absl::MutexLock l(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&released_), absl::Seconds(3));
    return grpc::Status::OK;
  }
  void Release() {
    absl::MutexLock l(&mu_);
    released_ = true;
  }
  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
};

// A heartbeat that runs out of time means a slow coordinator, not a lost
// one: the process gives up after kSlowCoordinatorFactor (6) timeouts, not
// one (a refused connection: one, as the next test's lost coordinator).
TEST(Heartbeater, ACoordinatorThatAnswersTooLateIsSlowNotLost) {
  UnansweringCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  const absl::Time start = absl::Now();
  Heartbeater hb(local.stub.get(), local.target, control::WORKER, 0, 42, absl::Milliseconds(50),
                 absl::Milliseconds(500));
  hb.Start();
  while (hb.command() == control::CONTINUE && absl::Now() - start < absl::Seconds(30)) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const absl::Duration gave_up = absl::Now() - start;
  EXPECT_EQ(hb.command(), control::ABORT);
  EXPECT_GE(gave_up, absl::Seconds(3)) << "gave up on a slow coordinator after one timeout";
  EXPECT_THAT(hb.reason(), HasSubstr("is unreachable (no heartbeat for 3s): Deadline Exceeded"));
  svc.Release();
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

TEST(Heartbeater, TheJobBeatsAtMostFiftyTimesASecondInAll) {
  control::TrainingConfig c = testing::MakeConfig(2, 1, 100, 1, "sgd");
  c.mutable_timeouts()->set_heartbeat_ms(10000);
  EXPECT_EQ(HeartbeatInterval(c), absl::Seconds(1));  // 3 processes: the timeout's tenth
  c.mutable_cluster()->set_workers(128);
  c.mutable_cluster()->set_servers(32);
  EXPECT_EQ(HeartbeatInterval(c), absl::Milliseconds(3200));  // 160 / 50 a second
  c.mutable_cluster()->set_workers(1000);
  EXPECT_EQ(HeartbeatInterval(c), absl::Seconds(10) / 3);  // still three beats per timeout
  c.mutable_cluster()->set_workers(2);
  c.mutable_cluster()->set_servers(1);
  c.mutable_timeouts()->set_heartbeat_ms(1000);
  EXPECT_EQ(HeartbeatInterval(c), absl::Milliseconds(100));  // 3 / 50 s is less
  c.mutable_timeouts()->set_heartbeat_ms(
      100);  // 3 / 50 s is more than the tenth, 20 ms; a third at most
  EXPECT_EQ(HeartbeatInterval(c), absl::Milliseconds(100) / 3);
}

// A coordinator that records the heartbeats it is sent.
class RecordingCoordinator final : public control::Coordinator::Service {
 public:
  grpc::Status Heartbeat(grpc::ServerContext*, const control::HeartbeatRequest* req,
                         control::HeartbeatReply*) override {
    absl::MutexLock l(&mu_);
    seen_.push_back(*req);
    return grpc::Status::OK;
  }
  absl::Mutex mu_;
  std::vector<control::HeartbeatRequest> seen_ ABSL_GUARDED_BY(mu_);
};

// A failing process's report carries the metrics still queued, with the
// steps done (without which the coordinator takes no row): metrics.csv
// keeps every step completed before the failure.
TEST(Heartbeater, AnErrorReportCarriesTheQueuedMetricsAndTheStepsDone) {
  RecordingCoordinator svc;
  const LocalCoordinator local = ServeLocally(&svc);
  ASSERT_NE(local.server, nullptr);
  const std::string& target = local.target;
  control::Coordinator::Stub* stub = local.stub.get();
  // Not started: no periodic heartbeat carries the metrics first.
  Heartbeater hb(stub, target, control::WORKER, 1, 42, absl::Seconds(30), absl::Seconds(10));
  for (uint64_t step = 0; step < 3; ++step) {
    control::StepMetrics m;
    m.set_step(step);
    hb.AddMetrics(m);
  }
  hb.SetStep(3);
  hb.ReportError("worker 1: loss is not finite (nan) at rank 1 step 3");
  absl::MutexLock l(&svc.mu_);
  ASSERT_EQ(svc.seen_.size(), 1u);
  const control::HeartbeatRequest& req = svc.seen_[0];
  EXPECT_EQ(req.error(), "worker 1: loss is not finite (nan) at rank 1 step 3");
  EXPECT_EQ(req.step(), 3u);
  std::vector<uint64_t> steps;
  for (const auto& m : req.metrics()) steps.push_back(m.step());
  EXPECT_EQ(steps, (std::vector<uint64_t>{0, 1, 2}));
  local.server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
}

}  // namespace
}  // namespace onebit
