// JobMember (job/member.h) against a real CoordinatorService served on
// 127.0.0.1: registering, rolling back and registering again, and the
// checkpoint files it writes and reports.
#include "job/member.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint_dir.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "job/run_folder.h"
#include "tests/cluster/test_util.h"

namespace onebit {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

constexpr uint64_t kJobId = 42;

// A job of 1 server and 1 worker (d = 100, 10 steps) that saves every 2
// steps into `checkpoint_dir`, its coordinator served on a free loopback
// port.
struct LocalJob {
  explicit LocalJob(const std::string& checkpoint_dir)
      : svc(Config(checkpoint_dir), {}, kJobId, absl::Seconds(30), Security{}) {
    int port = 0;
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&svc);
    server = b.BuildAndStart();
    target = absl::StrCat("127.0.0.1:", port);
  }
  ~LocalJob() {
    if (server == nullptr) return;  // it could not listen
    server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  static control::TrainingConfig Config(const std::string& checkpoint_dir) {
    control::TrainingConfig c = testing::MakeConfig(1, 1, 100, 10, "sgd");
    c.mutable_checkpoint()->set_dir(checkpoint_dir);
    c.mutable_checkpoint()->set_every(2);
    c.mutable_timeouts()->set_rejoin_ms(30000);
    return c;
  }

  CoordinatorService svc;
  std::unique_ptr<grpc::Server> server;
  std::string target;
};

// A process of `role` asking for rank 0.
std::unique_ptr<JobMember> NewMember(const LocalJob& job, control::Role role) {
  JobMemberOptions o;
  o.coordinator = job.target;
  o.register_timeout = absl::Seconds(30);
  o.snapshot_arrays = 1;
  control::RegisterRequest req;
  req.set_role(role);
  req.set_requested_rank(0);
  if (role == control::SERVER) req.set_data_endpoint("tcp://127.0.0.1:1");
  return std::make_unique<JobMember>(o, Security{}, req);
}

// Both register at once: the cluster forms when both are in.
void JoinBoth(JobMember& server, JobMember& worker) {
  absl::Status joined;
  std::thread t([&] { joined = server.Join(); });
  EXPECT_EQ(worker.Join(), absl::OkStatus());
  t.join();
  EXPECT_EQ(joined, absl::OkStatus());
}

// A member's state file for the checkpoint of `step`: three floats.
absl::StatusOr<StateWriter> SmallState(const JobMember& m, uint64_t step,
                                       const std::shared_ptr<SnapshotBuffers>& buffers) {
  checkpoint::StateHeader h;
  h.set_step(step);
  h.set_role(m.name().substr(0, m.name().find(' ')));  // "server 0": "server"
  h.set_rank(m.rank());
  StateWriter w(h);
  const std::vector<float> e = {1, 2, 3};
  w.AddFloats("e", buffers->Copy(e));
  return w;
}

// The worker's heartbeat says it has run steps 0 and 1, with their
// metrics: the checkpoint of step 2 waits for their rows.
void RunTwoSteps(JobMember& worker) {
  worker.heartbeat().SetStep(2);
  for (uint64_t step : {0, 1}) {
    control::StepMetrics m;
    m.set_step(step);
    m.set_loss(1);
    worker.heartbeat().AddMetrics(m);
  }
}

// The manifests the coordinator completes within 30 s (at least one),
// taking the rows first, as its run loop does.
std::vector<checkpoint::Manifest> CompleteCheckpoints(CoordinatorService& svc) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::vector<checkpoint::Manifest> complete;
  while (complete.empty() && absl::Now() < deadline) {
    svc.TakeNewRows();
    complete = svc.TakeCompleteCheckpoints();
    absl::SleepFor(absl::Milliseconds(10));
  }
  return complete;
}

TEST(JobMember, RegisteringGivesEachProcessItsCredentialAndTheJobsIncarnation) {
  LocalJob job(testing::TempDir("member-register"));
  auto server = NewMember(job, control::SERVER);
  auto worker = NewMember(job, control::WORKER);
  JoinBoth(*server, *worker);
  EXPECT_EQ(job.svc.state(), CoordinatorService::State::kRunning);
  for (const JobMember* m : {server.get(), worker.get()}) {
    EXPECT_EQ(m->registration().job_id(), kJobId);
    EXPECT_EQ(m->rank(), 0u);
    EXPECT_EQ(m->registration().credential().size(), 16u);
    EXPECT_EQ(m->incarnation(), 0u);  // the cluster's first forming
    EXPECT_EQ(m->data_plane_id(), kJobId);
    EXPECT_TRUE(m->has_heartbeat());
    EXPECT_FALSE(m->rolling_back());
  }
  EXPECT_NE(server->registration().credential(), worker->registration().credential());
  EXPECT_EQ(server->incarnation(), worker->incarnation());
  EXPECT_EQ(server->name(), "server 0");
  EXPECT_EQ(worker->Named(absl::DataLossError("bad file")),
            absl::DataLossError("worker 0: bad file"));

  // A registration the coordinator refuses comes back with its reason.
  JobMemberOptions o;
  o.coordinator = job.target;
  o.register_timeout = absl::Seconds(30);
  control::RegisterRequest req;
  req.set_role(control::WORKER);
  req.set_requested_rank(5);
  JobMember refused(o, Security{}, req);
  const absl::Status st = refused.Join();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("refused the registration: worker rank 5 out of range"));
  EXPECT_FALSE(refused.has_heartbeat());
}

TEST(JobMember, ACheckpointWritesItsFileAndReportsItsPart) {
  const std::string root = testing::TempDir("member-checkpoint");
  LocalJob job(root);
  auto server = NewMember(job, control::SERVER);
  auto worker = NewMember(job, control::WORKER);
  JoinBoth(*server, *worker);
  RunTwoSteps(*worker);
  EXPECT_TRUE(worker->CheckpointDue(4));
  EXPECT_FALSE(worker->CheckpointDue(3));
  for (JobMember* m : {server.get(), worker.get()}) {
    ASSERT_EQ(m->Checkpoint(2,
                            [m](std::shared_ptr<SnapshotBuffers> buffers) {
                              return SmallState(*m, 2, buffers);
                            }),
              absl::OkStatus());
  }
  // Step 0 and a step saved already take no snapshot.
  int snapshots = 0;
  auto counted = [&](std::shared_ptr<SnapshotBuffers> buffers) {
    ++snapshots;
    return SmallState(*worker, 2, buffers);
  };
  EXPECT_EQ(worker->Checkpoint(0, counted), absl::OkStatus());
  EXPECT_EQ(worker->Checkpoint(2, counted), absl::OkStatus());
  EXPECT_EQ(snapshots, 0);

  const std::vector<checkpoint::Manifest> complete = CompleteCheckpoints(job.svc);
  ASSERT_EQ(complete.size(), 1u);
  EXPECT_EQ(complete[0].step(), 2u);
  std::vector<std::string> names;
  for (const checkpoint::ManifestFile& f : complete[0].files()) {
    names.push_back(f.name());
    EXPECT_EQ(f.size(), std::filesystem::file_size(StepDir(root, 2) + "/" + f.name()));
  }
  std::sort(names.begin(), names.end());
  EXPECT_THAT(names, ElementsAre("server-0.state", "worker-0.state"));
}

TEST(JobMember, AFolderThatCannotBeMadeIsAFailedCheckpointTheCoordinatorCounts) {
  // A file where the checkpoints' folder would be.
  const std::string base = testing::TempDir("member-unwritable");
  std::ofstream(base + "/file") << "not a folder";
  LocalJob job(base + "/file/checkpoints");
  auto server = NewMember(job, control::SERVER);
  auto worker = NewMember(job, control::WORKER);
  JoinBoth(*server, *worker);
  bool snapshot = false;
  EXPECT_EQ(worker->Checkpoint(2,
                               [&](std::shared_ptr<SnapshotBuffers> buffers) {
                                 snapshot = true;
                                 return SmallState(*worker, 2, buffers);
                               }),
            absl::OkStatus());
  EXPECT_FALSE(snapshot);
  std::vector<uint64_t> failed;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (failed.empty() && absl::Now() < deadline) {
    failed = job.svc.TakeFailedCheckpoints();
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_THAT(failed, ElementsAre(2u));
  const run::Summary summary = job.svc.MakeSummary();
  EXPECT_EQ(summary.checkpoint_errors(), 1u);
  EXPECT_THAT(summary.last_checkpoint_error(), HasSubstr("worker 0: "));
  EXPECT_EQ(job.svc.state(), CoordinatorService::State::kRunning);  // not durable, but on
}

TEST(JobMember, ASnapshotThatFailsIsThisProcesssFailure) {
  LocalJob job(testing::TempDir("member-snapshot"));
  auto server = NewMember(job, control::SERVER);
  auto worker = NewMember(job, control::WORKER);
  JoinBoth(*server, *worker);
  const absl::Status st =
      worker->Checkpoint(4, [](std::shared_ptr<SnapshotBuffers>) -> absl::StatusOr<StateWriter> {
        return absl::InternalError("the device is lost");
      });
  EXPECT_EQ(st, absl::InternalError("checkpoint of step 4: the device is lost"));
  worker->ReportFailure(st);
  EXPECT_EQ(job.svc.state(), CoordinatorService::State::kFailed);
  EXPECT_THAT(job.svc.reason(), HasSubstr("worker 0: checkpoint of step 4: the device is lost"));
}

TEST(JobMember, ARollBackMakesItRegisterAgainInANewIncarnation) {
  const std::string root = testing::TempDir("member-rollback");
  LocalJob job(root);
  auto server = NewMember(job, control::SERVER);
  auto worker = NewMember(job, control::WORKER);
  JoinBoth(*server, *worker);
  RunTwoSteps(*worker);
  for (JobMember* m : {server.get(), worker.get()}) {
    ASSERT_EQ(m->Checkpoint(2,
                            [m](std::shared_ptr<SnapshotBuffers> buffers) {
                              return SmallState(*m, 2, buffers);
                            }),
              absl::OkStatus());
  }
  // The coordinator's part: the manifest, and the checkpoint to roll back to.
  const std::vector<checkpoint::Manifest> complete = CompleteCheckpoints(job.svc);
  ASSERT_EQ(complete.size(), 1u);
  const std::string dir = StepDir(root, 2);
  ASSERT_EQ(WriteManifest(dir, complete[0]), absl::OkStatus());
  job.svc.CheckpointWritten({dir, complete[0]});
  const control::RegisterReply before = worker->registration();

  // The server's process dies and is started again: the job rolls back.
  server.reset();
  auto restarted = NewMember(job, control::SERVER);
  absl::Status joined;
  std::thread t([&] { joined = restarted->Join(); });
  EXPECT_EQ(worker->heartbeat().WaitForCommand(absl::Seconds(30)), control::REJOIN);
  EXPECT_TRUE(worker->rolling_back());
  EXPECT_THAT(worker->heartbeat().reason(),
              HasSubstr("server 0 registered again (restarted); rolling back to the checkpoint "
                        "of step 2"));
  const absl::Status rejoined = worker->Rejoin(5);
  t.join();
  ASSERT_EQ(rejoined, absl::OkStatus());
  ASSERT_EQ(joined, absl::OkStatus());

  EXPECT_NE(worker->incarnation(), before.incarnation());
  EXPECT_EQ(worker->incarnation(), restarted->incarnation());
  EXPECT_EQ(worker->data_plane_id(), kJobId ^ worker->incarnation());
  EXPECT_NE(worker->registration().credential(), before.credential());
  EXPECT_EQ(worker->rank(), 0u);
  EXPECT_FALSE(worker->rolling_back());
  std::vector<uint64_t> loaded;
  EXPECT_EQ(worker->LoadCheckpoint([&](const control::ResumePoint& resume) {
    loaded.push_back(resume.step());
    EXPECT_EQ(resume.dir(), dir);
    return absl::OkStatus();
  }),
            absl::OkStatus());
  EXPECT_THAT(loaded, ElementsAre(2u));
  // The checkpoint it continues from is not written again.
  bool snapshot = false;
  EXPECT_EQ(worker->Checkpoint(2,
                               [&](std::shared_ptr<SnapshotBuffers> buffers) {
                                 snapshot = true;
                                 return SmallState(*worker, 2, buffers);
                               }),
            absl::OkStatus());
  EXPECT_FALSE(snapshot);
  // The steps the worker said it had done: 5, 3 past the checkpoint.
  const run::Summary summary = job.svc.MakeSummary();
  EXPECT_EQ(summary.restarts(), 1u);
  EXPECT_EQ(summary.rolled_back_steps(), 3u);
}

}  // namespace
}  // namespace onebit
