// What an outsider on the network can do to a running job, secured as by
// default: nothing. Each move an outsider made against the unsecured planes
// (control: registering as a server, forged heartbeats and Done; data:
// squatting a worker's routing id, floods) is tried against a real
// coordinator, server and workers on 127.0.0.1, and the job must end as a
// clean run ends, bit for bit.
#include <signal.h>

#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "proto/control.grpc.pb.h"
#include "security/curve.h"
#include "security/job_secret.h"
#include "security/tls.h"
#include "tests/runtime/test_util.h"
#include "zmq.hpp"
#include "zmq_addon.hpp"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The job of these tests: 2 workers, 1 server, sgd on d = 4000 (small
// enough that the reference is quick, long enough to forge things during).
control::TrainingConfig JobConfig(uint64_t steps) {
  control::TrainingConfig cfg = MakeConfig(2, 1, 4000, steps, "adam");
  cfg.set_chunk_elems(512);
  return cfg;
}

// A job started process by process (as pods are), each with `security`
// ("--secret_file=..." or "--insecure").
class Job {
 public:
  Job(const std::string& name, const control::TrainingConfig& cfg, std::string security)
      : dir_(TempDir(name)), cfg_(cfg), security_(std::move(security)) {
    std::vector<std::string> argv = {Bin("onebit-coordinator"),
                                     security_,
                                     "--port=0",
                                     "--port_file=" + dir_ + "/port",
                                     "--bind_host=127.0.0.1",
                                     "--out=" + dir_ + "/run"};
    for (const std::string& a : ConfigArgs(cfg)) argv.push_back(a);
    procs_.push_back(Start(argv, dir_ + "/coordinator.log"));
    const absl::Time deadline = absl::Now() + absl::Seconds(20);
    int port = 0;
    while (port == 0 && absl::Now() < deadline) {
      std::ifstream in(dir_ + "/port");
      if (!(in >> port)) port = 0;
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_GT(port, 0) << ReadFile(dir_ + "/coordinator.log");
    target_ = absl::StrCat("127.0.0.1:", port);
  }

  void StartServer() {
    procs_.push_back(Start({Bin("onebit-server"), security_, "--coordinator=" + target_,
                            "--shard=0", "--bind_host=127.0.0.1", "--advertise_host=127.0.0.1",
                            "--data_port=" + absl::StrCat(data_port_)},
                           dir_ + "/server.log"));
  }
  void StartWorkers() {
    for (int w = 0; w < 2; ++w) {
      procs_.push_back(
          Start({Bin("onebit-worker"), security_, "--coordinator=" + target_,
                 absl::StrCat("--rank=", w), "--bind_host=127.0.0.1", "--progress_interval=20ms",
                 absl::StrCat("--dump_x=", dir_, "/replica_w", w, ".f32")},
                absl::StrCat(dir_, "/worker", w, ".log")));
    }
  }

  // Every process exits 0 and every replica is the reference's, bit for bit.
  void ExpectCleanEnd() {
    const char* names[] = {"coordinator", "server", "worker0", "worker1"};
    for (size_t i = 0; i < procs_.size(); ++i) {
      const int code = procs_[i].Wait(absl::Seconds(60)).value_or(-1);
      EXPECT_EQ(code, 0) << names[i] << ": " << Log(names[i]);
    }
    const std::string summary = ReadFile(dir_ + "/run/summary.json");
    EXPECT_EQ(Field(summary, "status"), "\"ok\"") << summary;
    EXPECT_EQ(Field(summary, "replicas_equal"), "true") << summary;
    const ReferenceResult ref = Reference(cfg_);
    for (int w = 0; w < 2; ++w) {
      EXPECT_EQ(FirstDifference(ReadFloats(absl::StrCat(dir_, "/replica_w", w, ".f32")), ref.x), "")
          << "worker " << w;
    }
    // One row per step, no more: forged metrics did not get in.
    const std::string csv = ReadFile(dir_ + "/run/metrics.csv");
    EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'), static_cast<long>(cfg_.steps()) + 1);
  }

  std::string Log(const std::string& name) const {
    return ReadFile(absl::StrCat(dir_, "/", name, ".log"));
  }
  void WaitForSteps() {
    EXPECT_TRUE(WaitForText(dir_ + "/worker0.log", "steps/s", absl::Seconds(30))) << Log("worker0");
  }

  const std::string& target() const { return target_; }
  // The job id, as the coordinator's first line says it.
  std::string id_hex() const {
    const std::string log = Log("coordinator");
    const size_t at = log.find("coordinator: job ");
    EXPECT_NE(at, std::string::npos) << log;
    return at == std::string::npos ? "?" : log.substr(at + 17, 16);
  }
  const std::string& dir() const { return dir_; }
  // The server's data port, fixed so that outsiders can be there first.
  int data_port() const { return data_port_; }
  pid_t server_pid() const { return procs_.at(1).pid(); }

 private:
  const std::string dir_;
  const control::TrainingConfig cfg_;
  const std::string security_;
  std::string target_;
  int data_port_ = 20000 + getpid() % 20000;
  std::vector<Subprocess> procs_;
};

Security JobSecurity() {
  auto s = ResolveSecurity(SecretFile(), false, "secret");
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

// A TLS channel that trusts the job's certificate but carries no job
// credential: what a network eavesdropper who somehow had the (public)
// certificate could do.
std::shared_ptr<grpc::Channel> ChannelWithoutCredential(const std::string& target) {
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ControlCertificateOf(*JobSecurity().secret).cert_pem;
  grpc::ChannelArguments args;
  args.SetSslTargetNameOverride(kControlServerName);
  return grpc::CreateCustomChannel(target, grpc::SslCredentials(o), args);
}

grpc::Status CallRegister(control::Coordinator::Stub* stub, control::Role role) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  control::RegisterRequest req;
  req.set_role(role);
  req.set_requested_rank(0);
  req.set_data_endpoint("tcp://127.0.0.1:1");
  req.set_curve_public_key(NewCurveKeys().public_key);
  control::RegisterReply reply;
  return stub->Register(&ctx, req, &reply);
}

// Status, Register, Heartbeat and Done of every kind an outsider tried.
// Register last, and only `with_register`.
std::vector<std::pair<std::string, grpc::Status>> EveryRpc(control::Coordinator::Stub* stub,
                                                           uint64_t job_id, bool with_register) {
  std::vector<std::pair<std::string, grpc::Status>> out;
  auto deadline = [](grpc::ClientContext* c) {
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(3));
  };
  {
    grpc::ClientContext c;
    deadline(&c);
    control::StatusReply r;
    out.emplace_back("Status", stub->Status(&c, control::StatusRequest(), &r));
  }
  for (uint32_t rank : {0u, 1u}) {
    grpc::ClientContext c;
    deadline(&c);
    control::HeartbeatRequest req;
    req.set_role(control::WORKER);
    req.set_rank(rank);
    req.set_job_id(job_id);
    req.set_step(999999);
    req.set_error("forged");
    control::StepMetrics* m = req.add_metrics();
    m->set_step(5);
    m->set_loss(123);
    control::HeartbeatReply r;
    out.emplace_back(absl::StrCat("Heartbeat as worker ", rank), stub->Heartbeat(&c, req, &r));
  }
  for (control::Role role : {control::SERVER, control::WORKER}) {
    grpc::ClientContext c;
    deadline(&c);
    control::DoneRequest req;
    req.set_role(role);
    req.set_rank(0);
    req.set_job_id(job_id);
    control::DoneReply r;
    out.emplace_back(role == control::SERVER ? "Done as server 0" : "Done as worker 0",
                     stub->Done(&c, req, &r));
  }
  if (with_register) {
    out.emplace_back("Register as a server", CallRegister(stub, control::SERVER));
    out.emplace_back("Register as a worker", CallRegister(stub, control::WORKER));
  }
  return out;
}

TEST(Security, WithoutTheSecretNoCallGetsThroughAndNothingChanges) {
  Job job("nosecret", JobConfig(1500), SecretFlag());
  auto plain = control::Coordinator::NewStub(MakeChannel(job.target(), Security{}));
  auto other_secret = JobSecret::Generate();
  Security other;
  other.secret = other_secret;
  auto wrong = control::Coordinator::NewStub(MakeChannel(job.target(), other));
  auto uncredentialed = control::Coordinator::NewStub(ChannelWithoutCredential(job.target()));

  // During registration (an outsider once took the only server rank then),
  // and again while the job runs.
  for (int phase = 0; phase < 2; ++phase) {
    SCOPED_TRACE(phase == 0 ? "registering" : "running");
    // Plaintext, or TLS without this job's certificate: no connection at all.
    for (auto* stub : {plain.get(), wrong.get()}) {
      EXPECT_EQ(CallRegister(stub, control::SERVER).error_code(), grpc::StatusCode::UNAVAILABLE);
    }
    for (const auto& [what, st] :
         EveryRpc(uncredentialed.get(), /*job_id=*/0, /*with_register=*/true)) {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED)
          << what << ": " << st.error_message();
      // No job facts: not its id (as the coordinator's log has it), not its state.
      EXPECT_THAT(st.error_message(), Not(HasSubstr(job.id_hex()))) << what;
      for (const char* fact : {"registering", "running", "registration", "server", "worker"}) {
        EXPECT_THAT(st.error_message(), Not(HasSubstr(fact))) << what;
      }
    }
    if (phase == 0) {
      job.StartServer();
      job.StartWorkers();
      job.WaitForSteps();
    }
  }
  // A burst of failed handshakes is a line every few seconds, not one each.
  for (int i = 0; i < 30; ++i) (void)CallRegister(plain.get(), control::SERVER);
  job.ExpectCleanEnd();
  const std::string log = job.Log("coordinator");
  EXPECT_THAT(log, HasSubstr("refused a Status: no valid job credential"));
  EXPECT_THAT(log, HasSubstr("TLS handshake(s) failed"));
  int lines = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n'))
    lines += absl::StrContains(line, "andshake");
  EXPECT_LE(lines, 4) << log;
}

TEST(Security, AHolderOfTheSecretCannotSpeakForAnotherProcess) {
  Job job("otherrank", JobConfig(1500), SecretFlag());
  job.StartServer();
  job.StartWorkers();
  job.WaitForSteps();
  // The job's credential, but not a registered process's own.
  auto stub = control::Coordinator::NewStub(MakeChannel(job.target(), JobSecurity()));
  uint64_t job_id = 0;
  {
    grpc::ClientContext c;
    control::StatusReply r;
    ASSERT_TRUE(stub->Status(&c, control::StatusRequest(), &r).ok());
    job_id = r.job_id();
  }
  // (Registering under a rank that is taken is how a restarted process comes
  // back: a holder of the secret may do that, and the job rolls back.)
  for (const auto& [what, st] : EveryRpc(stub.get(), job_id, /*with_register=*/false)) {
    if (absl::StartsWith(what, "Heartbeat")) {
      // Taken for a stranger: told to register again, nothing it says counts.
      EXPECT_TRUE(st.ok()) << what << ": " << st.error_message();
    } else if (absl::StartsWith(what, "Done")) {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::PERMISSION_DENIED) << what;
      EXPECT_THAT(st.error_message(), HasSubstr("without its credential")) << what;
    }
  }
  job.ExpectCleanEnd();
}

// A DEALER socket to `endpoint` as `identity`, optionally a CURVE client.
zmq::socket_t Dealer(zmq::context_t* ctx, const std::string& identity, const std::string& endpoint,
                     const CurveKeys* keys = nullptr, const std::string& server_key = "") {
  zmq::socket_t s(*ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::routing_id, identity);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::sndhwm, 0);
  if (keys != nullptr) MakeCurveClient(&s, *keys, server_key);
  s.connect(endpoint);
  return s;
}

// Whether anything at all comes back on `s` within `wait`.
bool GetsAnyReply(zmq::socket_t& s, absl::Duration wait) {
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, absl::ToChronoMilliseconds(wait));
  return (item.revents & ZMQ_POLLIN) != 0;
}

TEST(Security, TheDataPortAdmitsOnlyTheJobsKeys) {
  Job job("squat", JobConfig(1500), SecretFlag());
  job.StartServer();
  const std::string endpoint = absl::StrCat("tcp://127.0.0.1:", job.data_port());
  // Before the workers, as worker 0 (whose routing id an outsider once took
  // first): one socket without keys, one with keys of its own. (One with
  // the server's public key but an unknown key of its own is refused by the
  // ZAP handler: tests/security.)
  zmq::context_t ctx(1);
  zmq::socket_t bare = Dealer(&ctx, WorkerIdentity(0, 0), endpoint);
  const CurveKeys mine = NewCurveKeys();
  zmq::socket_t keyed =
      Dealer(&ctx, WorkerIdentity(0, 0), endpoint, &mine, NewCurveKeys().public_key);
  job.StartWorkers();
  job.WaitForSteps();
  for (int i = 0; i < 20; ++i) {
    for (zmq::socket_t* s : {&bare, &keyed}) {
      std::vector<zmq::message_t> frames;
      frames.emplace_back(std::string("\x08\x01\x10\x02 not a header"));
      frames.emplace_back(std::string(1024, 'x'));
      (void)zmq::send_multipart(*s, frames, zmq::send_flags::dontwait);
    }
  }
  EXPECT_FALSE(GetsAnyReply(bare, absl::Milliseconds(500)));
  EXPECT_FALSE(GetsAnyReply(keyed, absl::Milliseconds(500)));
  job.ExpectCleanEnd();
  // Nothing of theirs reached the server's request handling.
  EXPECT_THAT(job.Log("server"), Not(HasSubstr("refused a request")));
}

// Resident memory of `pid` in bytes.
uint64_t ResidentBytes(pid_t pid) {
  for (absl::string_view line :
       absl::StrSplit(ReadFile(absl::StrCat("/proc/", pid, "/status")), '\n')) {
    if (!absl::ConsumePrefix(&line, "VmRSS:")) continue;
    uint64_t kb = 0;
    if (absl::SimpleAtoi(absl::StripSuffix(absl::StripAsciiWhitespace(line), " kB"), &kb)) {
      return kb << 10;
    }
  }
  return 0;
}

// 4 connections with worker 0's routing id (as a squatter and its
// duplicates) each queue 256 MB of 1 MB frames, and one sends a 100 MB
// frame, at a server still waiting for its cluster: what it may hold is
// bounded by its high-water marks and the frame limit (net/data_plane.h),
// secured or not. Then the job runs as if nothing happened.
void FloodAndRun(const std::string& name, const std::string& security) {
  Job job(name, JobConfig(300), security);
  job.StartServer();
  const std::string endpoint = absl::StrCat("tcp://127.0.0.1:", job.data_port());
  absl::SleepFor(absl::Milliseconds(500));  // listening
  const uint64_t before = ResidentBytes(job.server_pid());
  ASSERT_GT(before, 0u);
  zmq::context_t ctx(2);
  std::vector<zmq::socket_t> floods;
  const std::string mb(1 << 20, 'f');
  for (int c = 0; c < 4; ++c) {
    floods.push_back(Dealer(&ctx, WorkerIdentity(0, 0), endpoint));
    for (int i = 0; i < 256; ++i) {
      // Never blocking: a secured server never completes the handshake,
      // and then there is nowhere to queue.
      if (floods.back().send(zmq::buffer(mb),
                             zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
        (void)floods.back().send(zmq::buffer(mb), zmq::send_flags::dontwait);
      }
    }
  }
  zmq::socket_t huge = Dealer(&ctx, "huge", endpoint);
  (void)huge.send(zmq::buffer(std::string(100 << 20, 'h')), zmq::send_flags::dontwait);
  absl::SleepFor(absl::Seconds(3));
  const uint64_t after = ResidentBytes(job.server_pid());
  // 4 connections x kServerRcvHwm frames of 2 MB, and slack for libzmq's own
  // buffers.
  const uint64_t bound = 4 * kServerRcvHwm * (2u << 20) + (32u << 20);
  EXPECT_LT(after, before + bound)
      << "server grew from " << (before >> 20) << " MB to " << (after >> 20) << " MB";
  job.StartWorkers();
  job.ExpectCleanEnd();
}

TEST(Security, FloodsOfLargeFramesAndDuplicateIdentitiesStayBounded) {
  FloodAndRun("flood", SecretFlag());
}

TEST(Security, FloodsStayBoundedUnderInsecureToo) { FloodAndRun("flood-insecure", "--insecure"); }

TEST(Security, RunningWithoutASecretMustBeAskedFor) {
  for (const std::string bin : {"onebit-coordinator", "onebit-server", "onebit-worker"}) {
    // The rest of a valid command line for each.
    const std::vector<std::string> rest =
        bin == "onebit-coordinator"
            ? std::vector<std::string>{"--workers=1", "--servers=1", "--port=0"}
            : std::vector<std::string>{"--coordinator=127.0.0.1:1"};
    std::vector<std::string> argv = {"/usr/bin/env", "-u", "ONEBIT_SECRET_FILE", Bin(bin)};
    argv.insert(argv.end(), rest.begin(), rest.end());
    RunResult r = RunCommand(argv, absl::Seconds(10));
    EXPECT_EQ(r.code, 2) << bin << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr("--secret_file: no job secret: give --secret_file")) << bin;
    argv.push_back("--insecure");
    argv.push_back(SecretFlag());
    RunResult both = RunCommand(argv, absl::Seconds(10));
    EXPECT_EQ(both.code, 2) << bin << ": " << both.output;
    EXPECT_THAT(both.output, HasSubstr("both given")) << bin;
  }
  const std::string short_secret = TempDir("short") + "/secret";
  std::ofstream(short_secret) << "0123456789\n";
  RunResult r = RunCommand(
      {Bin("onebit-server"), "--coordinator=127.0.0.1:1", "--secret_file=" + short_secret},
      absl::Seconds(10));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_THAT(r.output, HasSubstr("holds 10 bytes; a job secret needs at least 32"));
}

TEST(Security, TheLauncherSecuresAJobByItselfAndRunsInsecureOnlyWhenAsked) {
  for (bool insecure : {false, true}) {
    const std::string out = TempDir(insecure ? "launch-insecure" : "launch-secure");
    std::vector<std::string> argv = {"/usr/bin/env", "-u", "ONEBIT_SECRET_FILE",
                                     Bin("onebit-launch"), "--out=" + out};
    for (const std::string& a : ConfigArgs(JobConfig(30))) argv.push_back(a);
    if (insecure) argv.push_back("--insecure");
    RunResult r = RunCommand(argv, absl::Seconds(60));
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(Field(ReadFile(out + "/summary.json"), "replicas_equal"), "true");
    if (insecure) {
      EXPECT_THAT(r.output, HasSubstr("[server0] server: INSECURE (--insecure)"));
      EXPECT_THAT(r.output, HasSubstr("[worker1] worker: INSECURE (--insecure)"));
    } else {
      EXPECT_THAT(r.output, HasSubstr("[coordinator] coordinator: secured by the job secret in "
                                      "/tmp/onebit-launch."));
      EXPECT_THAT(r.output, Not(HasSubstr("INSECURE")));
    }
  }
}

}  // namespace
}  // namespace onebit::testing
