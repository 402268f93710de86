// The coordinator service (coordinator/coordinator.h) driven in-process:
// metrics rows, Done, the replica verdict, and how it tells a slow process
// from a dead one.
#include "coordinator/coordinator.h"

#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/cluster/test_util.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;
using testing::Ports;

// A Heartbeat or Done request of job 42 from `role` `rank`, holding
// `credential`.
template <typename Request>
Request From(control::Role role, uint32_t rank, const std::string& credential) {
  Request r;
  r.set_role(role);
  r.set_rank(rank);
  r.set_job_id(42);
  r.set_credential(credential);
  return r;
}

// A job of 1 server and 1 worker on d = 100 (two shards' worth of checks
// come from one server's map), registered; the replies by role.
struct Formed {
  std::unique_ptr<CoordinatorService> svc;
  control::RegisterReply server, worker;
};
Formed FormOneByOne(uint64_t checkpoint_every = 0) {
  Formed f;
  control::TrainingConfig cfg = testing::MakeConfig(1, 1, 100, 10, "sgd");
  if (checkpoint_every > 0) {
    cfg.mutable_checkpoint()->set_dir("/nonexistent/checkpoints");  // the service writes nothing
    cfg.mutable_checkpoint()->set_every(checkpoint_every);
  }
  f.svc = std::make_unique<CoordinatorService>(cfg, std::set<std::string>{}, 42, absl::Seconds(10),
                                               Security{});
  std::thread t([&] {
    grpc::ServerContext ctx;
    control::RegisterRequest req;
    req.set_role(control::SERVER);
    req.set_requested_rank(0);
    req.set_data_endpoint("tcp://example:1");
    EXPECT_TRUE(f.svc->Register(&ctx, &req, &f.server).ok());
  });
  grpc::ServerContext ctx;
  control::RegisterRequest req;
  req.set_role(control::WORKER);
  req.set_requested_rank(0);
  EXPECT_TRUE(f.svc->Register(&ctx, &req, &f.worker).ok());
  t.join();
  return f;
}

TEST(CoordinatorService, MetricsOfStepsNotRunAreRefused) {
  Formed f = FormOneByOne();
  grpc::ServerContext ctx;
  control::HeartbeatRequest hb =
      From<control::HeartbeatRequest>(control::WORKER, 0, f.worker.credential());
  hb.set_step(2);  // steps 0 and 1 are done
  for (uint64_t step : {0, 1, 2, 3, 9, 500000}) {
    control::StepMetrics* m = hb.add_metrics();
    m->set_step(step);
    m->set_loss(1);
  }
  control::HeartbeatReply reply;
  ASSERT_TRUE(f.svc->Heartbeat(&ctx, &hb, &reply).ok());
  std::vector<uint64_t> steps;
  for (const MetricsRow& r : f.svc->MetricsRows()) steps.push_back(r.step);
  // Step 2's row may come with the count of 2 (sampled just before it); no later one.
  EXPECT_EQ(steps, (std::vector<uint64_t>{0, 1, 2}));
}

// A worker's row of step S - 1 goes with its next step's start, and its
// file of step S can come first. A manifest written then, and the
// coordinator killed before the row, would leave a checkpoint a job
// resumes from without that row: metrics.csv would miss it for good.
TEST(CoordinatorService, ACheckpointWaitsForTheMetricsRowsBeforeIt) {
  Formed f = FormOneByOne(/*checkpoint_every=*/2);
  auto heartbeat = [&](control::Role role, const std::string& credential,
                       std::vector<uint64_t> metrics, bool part) {
    grpc::ServerContext ctx;
    control::HeartbeatRequest hb = From<control::HeartbeatRequest>(role, 0, credential);
    hb.set_step(2);
    for (uint64_t step : metrics) {
      control::StepMetrics* m = hb.add_metrics();
      m->set_step(step);
      m->set_loss(1);
    }
    if (part) {
      control::CheckpointPart* p = hb.add_checkpoint_parts();
      p->set_step(2);
      p->set_name(role == control::WORKER ? "worker-0" : "server-0");
      p->set_size(8);
    }
    control::HeartbeatReply reply;
    ASSERT_TRUE(f.svc->Heartbeat(&ctx, &hb, &reply).ok());
  };
  heartbeat(control::SERVER, f.server.credential(), {}, true);
  heartbeat(control::WORKER, f.worker.credential(), {0}, true);  // step 1's row not yet
  auto steps = [](const std::vector<MetricsRow>& rows) {
    std::vector<uint64_t> s;
    for (const MetricsRow& r : rows) s.push_back(r.step);
    return s;
  };
  EXPECT_EQ(steps(f.svc->TakeNewRows()), std::vector<uint64_t>{0});
  EXPECT_TRUE(f.svc->TakeCompleteCheckpoints().empty()) << "complete before step 1's row";
  heartbeat(control::WORKER, f.worker.credential(), {1}, false);
  // Not before the row is taken (for metrics.csv).
  EXPECT_TRUE(f.svc->TakeCompleteCheckpoints().empty());
  EXPECT_EQ(steps(f.svc->TakeNewRows()), std::vector<uint64_t>{1});
  const std::vector<checkpoint::Manifest> complete = f.svc->TakeCompleteCheckpoints();
  ASSERT_EQ(complete.size(), 1u);
  EXPECT_EQ(complete[0].step(), 2u);
  EXPECT_EQ(complete[0].files_size(), 2);
}

TEST(CoordinatorService, DoneMustCoverTheShardMapAndCarryItsCredential) {
  Formed f = FormOneByOne();
  auto done = [&](control::Role role, const std::string& credential,
                  const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
    grpc::ServerContext ctx;
    control::DoneRequest req = From<control::DoneRequest>(role, 0, credential);
    req.set_steps(10);
    for (auto [b, e] : ranges) {
      control::ShardChecksum* c = req.add_checksums();
      c->set_begin(b);
      c->set_end(e);
    }
    control::DoneReply reply;
    return f.svc->Done(&ctx, &req, &reply);
  };
  EXPECT_EQ(done(control::WORKER, "", {{0, 100}}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(done(control::WORKER, f.server.credential(), {{0, 100}}).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);  // the server's, not the worker's
  for (const auto& ranges : std::vector<std::vector<std::pair<uint64_t, uint64_t>>>{
           {}, {{0, 50}}, {{0, 100}, {0, 100}}, {{0, 101}}}) {
    grpc::Status st = done(control::WORKER, f.worker.credential(), ranges);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << ranges.size();
    EXPECT_THAT(st.error_message(), HasSubstr("Done of worker 0: ")) << st.error_message();
  }
  EXPECT_EQ(f.svc->state(), CoordinatorService::State::kRunning);  // nothing counted
  EXPECT_TRUE(done(control::WORKER, f.worker.credential(), {{0, 100}}).ok());
  EXPECT_TRUE(done(control::SERVER, f.server.credential(), {{0, 100}}).ok());
  EXPECT_EQ(f.svc->state(), CoordinatorService::State::kFinished);
}

// Registers server 0 (process 0) and workers 0 and 1 (processes 1, 2) of
// job 42 at once; returns their replies.
std::vector<control::RegisterReply> RegisterServerAndTwoWorkers(CoordinatorService* svc) {
  std::vector<std::thread> threads;
  std::vector<control::RegisterReply> replies(3);
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      grpc::ServerContext ctx;
      control::RegisterRequest req;
      req.set_role(i == 0 ? control::SERVER : control::WORKER);
      req.set_requested_rank(i == 0 ? 0 : i - 1);
      req.set_data_endpoint("tcp://example:1");
      EXPECT_TRUE(svc->Register(&ctx, &req, &replies[i]).ok());
      EXPECT_EQ(replies[i].job_id(), 42u);
    });
  }
  for (auto& t : threads) t.join();
  return replies;
}

// Process i's Done (as above) with one checksum of the whole d = 100.
grpc::Status DoneOf(CoordinatorService* svc, const std::vector<control::RegisterReply>& replies,
                    int i, uint32_t crc) {
  grpc::ServerContext ctx;
  control::DoneRequest req = From<control::DoneRequest>(
      i == 0 ? control::SERVER : control::WORKER, i == 0 ? 0 : i - 1, replies[i].credential());
  auto* c = req.add_checksums();
  c->set_shard(0);
  c->set_end(100);
  c->set_crc32(crc);
  control::DoneReply reply;
  return svc->Done(&ctx, &req, &reply);
}

TEST(CoordinatorService, ReplicasEqualOnlyWhenEveryChecksumMatches) {
  for (bool corrupt : {false, true}) {
    control::TrainingConfig cfg = testing::MakeConfig(2, 1, 100, 1, "sgd");
    CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
    const std::vector<control::RegisterReply> replies = RegisterServerAndTwoWorkers(&svc);
    EXPECT_EQ(svc.state(), CoordinatorService::State::kRunning);
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(DoneOf(&svc, replies, i, corrupt && i == 2 ? 7 : 1234).ok());
    }
    EXPECT_EQ(svc.state(), CoordinatorService::State::kFinished);
    EXPECT_EQ(svc.MakeSummary().replicas_equal(), !corrupt);
  }
}

// A Done whose answer missed its caller's deadline (a loaded host) is sent
// again: after the job finished with it, the repeat is answered OK and
// changes nothing (after a failure, a Done is refused: the next test).
TEST(CoordinatorService, ARepeatedDoneOfACountedProcessIsAnsweredAfterTheJobFinished) {
  control::TrainingConfig cfg = testing::MakeConfig(2, 1, 100, 1, "sgd");
  CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
  const std::vector<control::RegisterReply> replies = RegisterServerAndTwoWorkers(&svc);
  EXPECT_TRUE(DoneOf(&svc, replies, 0, 1234).ok());
  EXPECT_TRUE(DoneOf(&svc, replies, 1, 1234).ok());
  EXPECT_TRUE(DoneOf(&svc, replies, 1, 1234).ok());  // a repeat while the job runs: counted once
  EXPECT_EQ(svc.state(), CoordinatorService::State::kRunning);
  EXPECT_TRUE(DoneOf(&svc, replies, 2, 1234).ok());
  ASSERT_EQ(svc.state(), CoordinatorService::State::kFinished);
  EXPECT_TRUE(DoneOf(&svc, replies, 2, 1234).ok());
  EXPECT_TRUE(DoneOf(&svc, replies, 0, 7).ok());  // what a repeat carries no longer counts
  EXPECT_EQ(svc.state(), CoordinatorService::State::kFinished);
  EXPECT_TRUE(svc.MakeSummary().replicas_equal());
}

TEST(CoordinatorService, ADoneAfterTheJobFailedIsRefused) {
  Formed f = FormOneByOne();
  {
    // The worker's failure, as ControlClient::ReportError sends it.
    grpc::ServerContext ctx;
    control::HeartbeatRequest report =
        From<control::HeartbeatRequest>(control::WORKER, 0, f.worker.credential());
    report.set_error("out of memory");
    control::HeartbeatReply reply;
    EXPECT_TRUE(f.svc->Heartbeat(&ctx, &report, &reply).ok());
  }
  ASSERT_EQ(f.svc->state(), CoordinatorService::State::kFailed);
  grpc::ServerContext ctx;
  control::DoneRequest req = From<control::DoneRequest>(control::SERVER, 0, f.server.credential());
  control::DoneReply reply;
  grpc::Status st = f.svc->Done(&ctx, &req, &reply);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(st.error_message(), HasSubstr("out of memory"));
}

// Registers server 0 ("tcp://s0:5") and worker 0 (no data endpoint, its
// health endpoint `worker_health`), both of host w0host, at once (the
// cluster forms when both are in); returns their replies.
std::vector<control::RegisterReply> RegisterServerAndWorker(CoordinatorService* svc,
                                                            const std::string& worker_health) {
  std::vector<std::thread> threads;
  std::vector<control::RegisterReply> replies(2);
  for (int i = 0; i < 2; ++i) {
    threads.emplace_back([&, i] {
      grpc::ServerContext ctx;
      control::RegisterRequest req;
      req.set_role(i == 0 ? control::SERVER : control::WORKER);
      req.set_requested_rank(0);
      req.set_data_endpoint(i == 0 ? "tcp://s0:5" : "");
      req.set_host("w0host");
      if (i == 1) req.set_health_endpoint(worker_health);
      EXPECT_TRUE(svc->Register(&ctx, &req, &replies[i]).ok());
    });
  }
  for (auto& t : threads) t.join();
  return replies;
}

// A heartbeat of server 0 (job 42) with `credential`, saying it heard from
// the workers `heard` in the data plane; the reply.
control::HeartbeatReply BeatAsServer(CoordinatorService* svc, const std::string& credential,
                                     const std::vector<uint32_t>& heard = {}) {
  grpc::ServerContext ctx;
  control::HeartbeatRequest hb = From<control::HeartbeatRequest>(control::SERVER, 0, credential);
  for (uint32_t r : heard) hb.add_heard(r);
  control::HeartbeatReply reply;
  EXPECT_TRUE(svc->Heartbeat(&ctx, &hb, &reply).ok());
  return reply;
}

// How long a 1 x 1 job whose worker falls silent at registration takes to
// fail when the coordinator ticks every `tick` (the server beating just
// before each tick), and why; the worker's health endpoint `health`.
struct SilentWorkerVerdict {
  absl::Duration failed_after;  // an upper bound on the worker's silence
  std::string reason;
  // When `heard`: a lower bound on the date the coordinator gives the last
  // news of the worker (the server's heartbeat before its last one saying
  // so), from the start.
  absl::Duration news_after = absl::ZeroDuration();
};
// For `heard` from the start the server says, with each heartbeat, that it
// hears from the worker in the data plane.
SilentWorkerVerdict FailWithASilentWorker(const std::string& health, absl::Duration heartbeat,
                                          absl::Duration tick,
                                          absl::Duration heard = absl::ZeroDuration()) {
  control::TrainingConfig cfg = testing::MakeConfig(1, 1, 100, 1, "sgd");
  cfg.mutable_timeouts()->set_heartbeat_ms(absl::ToInt64Milliseconds(heartbeat));
  CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
  const absl::Time start = absl::Now();  // no later than the worker was last seen
  const std::vector<control::RegisterReply> replies = RegisterServerAndWorker(&svc, health);
  // The news a heartbeat carries is dated by the previous one's arrival,
  // which comes after the time taken before sending it.
  absl::Duration previous_beat = absl::ZeroDuration(), news = absl::ZeroDuration();
  while (absl::Now() - start < 20 * heartbeat + heard) {
    absl::SleepFor(tick);
    const absl::Duration beat = absl::Now() - start;
    const bool hearing = beat < heard;
    if (hearing) news = previous_beat;
    BeatAsServer(&svc, replies[0].credential(),
                 hearing ? std::vector<uint32_t>{0} : std::vector<uint32_t>{});
    previous_beat = beat;
    svc.Tick();
    if (svc.state() == CoordinatorService::State::kFailed) {
      return {absl::Now() - start, svc.reason(), news};
    }
  }
  return {absl::InfiniteDuration(), "still running", news};
}

// A worker that falls silent but still listens at its health endpoint (a
// starved process, a slow start) gets kSlowFactor (6) times the heartbeat
// timeout; one whose endpoint refuses connections is presumed dead at the
// timeout, as before the probe.
TEST(CoordinatorService, ASilentProcessThatStillListensIsSlowNotDead) {
  Ports ports;
  const SilentWorkerVerdict slow =
      FailWithASilentWorker(ports.listening, absl::Seconds(1), absl::Milliseconds(20));
  EXPECT_GE(slow.failed_after, absl::Seconds(6)) << "declared dead while it still listened";
  EXPECT_THAT(slow.reason,
              HasSubstr("worker 0 (w0host) sent no heartbeat for 6s, although it "
                        "still listens at its health endpoint (hung?): presumed dead"));
  const SilentWorkerVerdict gone =
      FailWithASilentWorker(ports.gone, absl::Seconds(1), absl::Milliseconds(20));
  EXPECT_LT(gone.failed_after, absl::Seconds(6)) << "a gone process waited for as a slow one";
  EXPECT_THAT(gone.reason,
              HasSubstr(absl::StrCat("worker 0 (w0host) sent no heartbeat for 1s, and its health "
                                     "endpoint ",
                                     ports.gone, " refused a connection (gone): presumed dead")));
  // An endpoint that gives no answer (here: one that does not resolve) is
  // no evidence of life either; the verdict says what the probe found.
  const SilentWorkerVerdict unknown =
      FailWithASilentWorker("no-port", absl::Seconds(1), absl::Milliseconds(20));
  EXPECT_LT(unknown.failed_after, absl::Seconds(6));
  EXPECT_THAT(unknown.reason, HasSubstr("sent no heartbeat for 1s, and its health endpoint "
                                        "no-port took no connection within 250ms: presumed dead"));
}

// A starved coordinator ticks late: here every 1.5 heartbeat timeouts, so
// a probe's answer has gone stale by the next tick. It still tells a slow
// process (listening) from a dead one, judging each on the answer it has
// just taken.
TEST(CoordinatorService, ACoordinatorThatTicksLateStillTellsSlowFromDead) {
  Ports ports;
  const absl::Duration heartbeat = absl::Milliseconds(500);
  const SilentWorkerVerdict slow =
      FailWithASilentWorker(ports.listening, heartbeat, 1.5 * heartbeat);
  EXPECT_GE(slow.failed_after, 6 * heartbeat) << "declared dead while it still listened";
  EXPECT_THAT(slow.reason, HasSubstr("although it still listens at its health endpoint (hung?)"));
  const SilentWorkerVerdict gone = FailWithASilentWorker(ports.gone, heartbeat, 1.5 * heartbeat);
  EXPECT_LT(gone.failed_after, 6 * heartbeat) << "a gone process waited for as a slow one";
  EXPECT_THAT(gone.reason,
              HasSubstr(absl::StrCat("worker 0 (w0host) sent no heartbeat for 500ms, and its "
                                     "health endpoint ",
                                     ports.gone, " refused a connection (gone): presumed dead")));
}

// A worker whose heartbeats stop while its server still hears from it in
// the data plane works (its heartbeats are late: a starved host): it is
// not declared dead or hung, listening or not, for as long as that lasts.
// When the server stops hearing from it the bounds run from then: the slow
// limit for one that still listens, the timeout for a gone one.
TEST(CoordinatorService, AProcessItsPeersStillHearFromIsNotDeclaredDead) {
  Ports ports;
  const absl::Duration heartbeat = absl::Milliseconds(300);
  const absl::Duration heard = 10 * heartbeat;  // longer than the slow limit
  const SilentWorkerVerdict slow =
      FailWithASilentWorker(ports.listening, heartbeat, absl::Milliseconds(20), heard);
  // Not hung before the slow limit (6 timeouts) from the last news, which
  // came close to `heard` (a tick before, unless the host stalled).
  EXPECT_GE(slow.news_after, heard / 2);
  EXPECT_GE(slow.failed_after, slow.news_after + 6 * heartbeat) << slow.reason;
  EXPECT_THAT(slow.reason,
              HasSubstr("sent no heartbeat, nor did its servers hear from it, for 1.8s, "
                        "although it still listens at its health endpoint (hung?)"));
  const SilentWorkerVerdict gone =
      FailWithASilentWorker(ports.gone, heartbeat, absl::Milliseconds(20), heard);
  EXPECT_GE(gone.news_after, heard / 2);
  EXPECT_GE(gone.failed_after, gone.news_after + heartbeat) << gone.reason;
  EXPECT_LT(gone.failed_after, heard + 6 * heartbeat) << "a gone process waited for as a slow one";
  EXPECT_THAT(gone.reason, HasSubstr("worker 0 (w0host) sent no heartbeat, nor did its servers "
                                     "hear from it, for 300ms, and its health endpoint"));
}

// A heartbeat that says it heard from a rank the job does not have is
// refused, naming it, and counts for nothing.
TEST(CoordinatorService, AHeartbeatHearingARankBeyondTheJobIsRefused) {
  control::TrainingConfig cfg = testing::MakeConfig(1, 1, 100, 1, "sgd");
  CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
  const std::vector<control::RegisterReply> replies = RegisterServerAndWorker(&svc, "");
  grpc::ServerContext ctx;
  control::HeartbeatRequest hb =
      From<control::HeartbeatRequest>(control::SERVER, 0, replies[0].credential());
  hb.add_heard(1);
  control::HeartbeatReply reply;
  const grpc::Status st = svc.Heartbeat(&ctx, &hb, &reply);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(st.error_message(), HasSubstr("server 0 heard from worker 1 in a job of 1"));
  hb.set_heard(0, 0);
  hb.add_heard(0);  // more ranks than the job has
  grpc::ServerContext ctx2;
  const grpc::Status many = svc.Heartbeat(&ctx2, &hb, &reply);
  EXPECT_EQ(many.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(many.error_message(), HasSubstr("server 0 heard from 2 workers in a job of 1"));
}

TEST(CoordinatorService, SilentProcessIsDeclaredDeadByName) {
  control::TrainingConfig cfg = testing::MakeConfig(1, 1, 100, 1, "sgd");
  cfg.mutable_timeouts()->set_heartbeat_ms(100);
  CoordinatorService svc(cfg, {}, 42, absl::Seconds(10), Security{});
  const std::vector<control::RegisterReply> replies = RegisterServerAndWorker(&svc, "");
  // The server keeps beating, each beat just before the coordinator's check
  // (so a loaded machine's pauses fall between a check and the next beat);
  // the worker falls silent. Until the 100 ms run out, at most 10 s.
  const absl::Time start = absl::Now();
  while (svc.state() != CoordinatorService::State::kFailed &&
         absl::Now() - start < absl::Seconds(10)) {
    absl::SleepFor(absl::Milliseconds(30));
    BeatAsServer(&svc, replies[0].credential());
    svc.Tick();
  }
  EXPECT_EQ(svc.state(), CoordinatorService::State::kFailed);
  EXPECT_THAT(svc.reason(), HasSubstr("worker 0 (w0host) sent no heartbeat"));
  const control::HeartbeatReply reply = BeatAsServer(&svc, replies[0].credential());
  EXPECT_EQ(reply.command(), control::ABORT);
  EXPECT_THAT(reply.reason(), HasSubstr("worker 0"));
}

}  // namespace
}  // namespace onebit
