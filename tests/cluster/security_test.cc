// What an outsider on the network can do to a running job, secured as by
// default: nothing. Each move an outsider made against the unsecured planes
// (control: registering as a server, forged heartbeats and Done; data:
// squatting a worker's routing id, floods) is tried against a real
// coordinator, server and workers on 127.0.0.1, and the job must end as a
// clean run ends, bit for bit.
#include <signal.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
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
#include "security/data_seal.h"
#include "security/job_secret.h"
#include "security/tls.h"
#include "tests/cluster/test_util.h"
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
  cfg.mutable_compression()->set_chunk_elems(512);
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
    EXPECT_EQ(std::count(csv.begin(), csv.end(), '\n'),
              static_cast<long>(cfg_.model().steps()) + 1);
  }

  std::string Log(const std::string& name) const {
    return ReadFile(absl::StrCat(dir_, "/", name, ".log"));
  }
  void WaitForSteps() {
    EXPECT_TRUE(WaitForText(dir_ + "/worker0.log", "steps/s", absl::Seconds(30)))
        << "worker0:\n"
        << Log("worker0") << "server:\n"
        << Log("server") << "coordinator:\n"
        << Log("coordinator");
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
  // Pauses (SIGSTOP) or resumes (SIGCONT) both workers: the job waits.
  void SignalWorkers(int sig) {
    for (size_t i = 2; i < procs_.size(); ++i) kill(procs_[i].pid(), sig);
  }
  pid_t coordinator_pid() const { return procs_.at(0).pid(); }
  pid_t server_pid() const { return procs_.at(1).pid(); }

 private:
  const std::string dir_;
  const control::TrainingConfig cfg_;
  const std::string security_;
  std::string target_;
  int data_port_ = FreeLocalPort();
  std::vector<Subprocess> procs_;
};

Security JobSecurity() {
  auto s = ResolveSecurity(SecretFile(), false, "secret");
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

// A TLS channel that trusts the job's certificate (which the coordinator
// shows anyone who connects) but carries no job credential; with
// `client_certificate`, it also presents the job's certificate, as only a
// holder of the secret can.
std::shared_ptr<grpc::Channel> ChannelWithoutCredential(const std::string& target,
                                                        bool client_certificate = false) {
  const ControlCertificate cert = ControlCertificateOf(*JobSecurity().secret);
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = cert.cert_pem;
  if (client_certificate) {
    o.pem_private_key = cert.key_pem;
    o.pem_cert_chain = cert.cert_pem;
  }
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
  auto uncertified = control::Coordinator::NewStub(ChannelWithoutCredential(job.target()));
  // (Only a holder of the secret can make this one: the call credential is
  // checked as well, from each call's headers.)
  auto uncredentialed = control::Coordinator::NewStub(ChannelWithoutCredential(job.target(), true));

  // During registration (an outsider once took the only server rank then),
  // and again while the job runs.
  for (int phase = 0; phase < 2; ++phase) {
    SCOPED_TRACE(phase == 0 ? "registering" : "running");
    // Plaintext, TLS without this job's certificate, or without presenting
    // it: no connection at all.
    for (auto* stub : {plain.get(), wrong.get(), uncertified.get()}) {
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
// `before_connect`, when given, sees the socket before it connects.
zmq::socket_t Dealer(zmq::context_t* ctx, const std::string& identity, const std::string& endpoint,
                     const CurveKeys* keys = nullptr, const std::string& server_key = "",
                     const std::function<void(zmq::socket_t&)>& before_connect = nullptr) {
  zmq::socket_t s(*ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::routing_id, identity);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::sndhwm, 0);
  if (keys != nullptr) MakeCurveClient(&s, *keys, server_key);
  if (before_connect) before_connect(s);
  s.connect(endpoint);
  return s;
}

// Whether anything at all comes back on `s` within `wait`.
bool GetsAnyReply(zmq::socket_t& s, absl::Duration wait) {
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  // (A negative timeout would make poll wait for ever.)
  zmq::poll(&item, 1, absl::ToChronoMilliseconds(std::max(wait, absl::ZeroDuration())));
  return (item.revents & ZMQ_POLLIN) != 0;
}

// Sends 20 requests of junk (a header, a payload, a seal-sized frame) from
// each of `sockets`; none gets any reply.
void SendJunkAndExpectNoReply(std::initializer_list<zmq::socket_t*> sockets) {
  for (int i = 0; i < 20; ++i) {
    for (zmq::socket_t* s : sockets) {
      std::vector<zmq::message_t> frames;
      frames.emplace_back(std::string("\x08\x01\x10\x02 not a header"));
      frames.emplace_back(std::string(1024, 'x'));
      frames.emplace_back(std::string(kSealBytes, 's'));
      (void)zmq::send_multipart(*s, frames, zmq::send_flags::dontwait);
    }
  }
  for (zmq::socket_t* s : sockets) EXPECT_FALSE(GetsAnyReply(*s, absl::Milliseconds(500)));
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
  SendJunkAndExpectNoReply({&bare, &keyed});
  job.ExpectCleanEnd();
  // Nothing of theirs reached the server's request handling.
  EXPECT_THAT(job.Log("server"), Not(HasSubstr("refused a request")));
}

// Under --data_cipher aes-gcm the port takes PLAIN handshakes with the
// passwords of the job's pairs only: no outsider gets a message in, nor
// takes a worker's routing id first, and the job's result is the
// reference's bit for bit over the sealed connections. (A NULL or CURVE
// client fails the handshake outright; a wrong password waits in the ZAP
// handler, refused after kZapWait: tests/security/data_seal_test.cc.)
TEST(Security, TheSealedDataPortAdmitsOnlyTheJobsPasswords) {
  control::TrainingConfig cfg = JobConfig(1500);
  cfg.mutable_compression()->set_data_cipher(control::DATA_CIPHER_AES_GCM);
  cfg.mutable_compression()->set_data_connections(2);
  Job job("sealed-squat", cfg, SecretFlag());
  job.StartServer();
  const std::string endpoint = absl::StrCat("tcp://127.0.0.1:", job.data_port());
  zmq::context_t ctx(1);
  zmq::socket_t bare = Dealer(&ctx, WorkerIdentity(0, 0), endpoint);
  const CurveKeys mine = NewCurveKeys();
  zmq::socket_t keyed =
      Dealer(&ctx, WorkerIdentity(0, 1), endpoint, &mine, NewCurveKeys().public_key);
  zmq::socket_t guessed =
      Dealer(&ctx, WorkerIdentity(0, 0), endpoint, nullptr, "",
             [](zmq::socket_t& s) { MakePlainClient(&s, WorkerPeerId(0), std::string(64, 'a')); });
  job.StartWorkers();
  job.WaitForSteps();
  SendJunkAndExpectNoReply({&bare, &keyed, &guessed});
  job.ExpectCleanEnd();
  const std::string server = job.Log("server");
  EXPECT_THAT(server, HasSubstr("data plane sealed with AES-256-GCM"));
  EXPECT_THAT(server, Not(HasSubstr("refused a request")));
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

// The open sockets of `pid` (its listeners and connections).
int OpenSockets(pid_t pid) {
  int n = 0;
  std::error_code ec;
  for (const auto& e :
       std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec)) {
    std::error_code link_ec;
    const std::filesystem::path target = std::filesystem::read_symlink(e.path(), link_ec);
    n += !link_ec && absl::StartsWith(target.string(), "socket:");
  }
  return n;
}

// How many requests `log` says were refused: "refused a ..." is one,
// "refused N more request(s)" N (a process says the last count as it exits).
uint64_t RefusalsLogged(const std::string& log) {
  uint64_t n = 0;
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    const size_t at = line.find(": refused ");
    if (at == absl::string_view::npos) continue;
    absl::string_view rest = line.substr(at + 10);
    uint64_t more = 0;
    if (absl::ConsumePrefix(&rest, "a ")) {
      ++n;
    } else if (absl::SimpleAtoi(rest.substr(0, rest.find(' ')), &more) &&
               absl::StrContains(rest, " more ")) {
      n += more;
    }
  }
  return n;
}

// Counts what happens to one socket's connections (ZeroMQ's monitor): how
// the peer took what we sent.
class ConnectionEvents {
 public:
  ConnectionEvents(zmq::context_t* ctx, zmq::socket_t& s)
      : watched_(s.handle()), pair_(*ctx, zmq::socket_type::pair) {
    static int next = 0;
    const std::string endpoint = absl::StrCat("inproc://events-", next++);
    EXPECT_EQ(zmq_socket_monitor(watched_, endpoint.c_str(), ZMQ_EVENT_ALL), 0);
    pair_.connect(endpoint);
  }
  // Stops the monitor before its reader goes: ZeroMQ sends events with a
  // blocking send, so an event for a socket whose reader has closed (its
  // own close, say) would stop the I/O thread that sends it for good, and
  // with it every connection of the context on that thread. Requires the
  // watched socket to be open still (destroy these before the sockets).
  ~ConnectionEvents() { zmq_socket_monitor(watched_, nullptr, 0); }
  ConnectionEvents(const ConnectionEvents&) = delete;
  ConnectionEvents& operator=(const ConnectionEvents&) = delete;
  // Waits until a connection of ours has ended (the peer dropped it, or a
  // handshake failed) or `timeout` passes.
  bool WaitForEnd(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (ended_ == 0 && absl::Now() < deadline) {
      zmq::pollitem_t item{pair_.handle(), 0, ZMQ_POLLIN, 0};
      zmq::poll(&item, 1, std::chrono::milliseconds(50));
      std::vector<zmq::message_t> frames;
      while (zmq::recv_multipart(pair_, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
        uint16_t event = 0;
        if (!frames.empty() && frames[0].size() >= 2) std::memcpy(&event, frames[0].data(), 2);
        seen_ += absl::StrCat(" ", event);
        ended_ +=
            (event & (ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                      ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)) != 0;
        frames.clear();
      }
    }
    return ended_ > 0;
  }
  bool ended() const { return ended_ > 0; }
  // The events seen, by number (zmq.h), for messages.
  const std::string& seen() const { return seen_; }

 private:
  void* watched_;
  zmq::socket_t pair_;
  int ended_ = 0;
  std::string seen_;
};

// Floods a serving server (its data port opens once the cluster has
// formed): 4 connections with worker 0's routing id (as a squatter and its
// duplicates) each queue 64 MB of 1 MB frames and one sends a 100 MB
// frame, all above the job's frame limit (8 KiB chunks: 12 KiB); then 16
// connections each send 8 malformed requests within it and close. Each
// flood is seen to arrive: the oversized connections are dropped (a
// secured server never completes their handshake), and the small requests
// are refused (an ERROR each under --insecure; secured, the handshake
// fails). What the server holds afterwards (VmRSS) stays within 20 MB of
// before, secured or not (an --insecure server once kept 120 MB of such
// frames after their sender closed), and the job ends as a clean run.
void FloodAndRun(const std::string& name, const std::string& security) {
  const bool insecure = security == "--insecure";
  // The workers are paused while the floods go on (so the server is still
  // serving when they are over, however fast the job), with timeouts that
  // a loaded machine's flood does not reach.
  control::TrainingConfig cfg = JobConfig(20000);
  // fp32 chunks of 8 KiB: above the limit's fixed part (CURVE frames
  // carry 33 bytes more than their payload).
  cfg.mutable_compression()->set_chunk_elems(2048);
  cfg.mutable_timeouts()->set_heartbeat_ms(120000);
  cfg.mutable_timeouts()->set_step_ms(120000);
  Job job(name, cfg, security);
  job.StartServer();
  job.StartWorkers();
  job.WaitForSteps();
  job.SignalWorkers(SIGSTOP);
  const std::string endpoint = absl::StrCat("tcp://127.0.0.1:", job.data_port());
  const uint64_t before = ResidentBytes(job.server_pid());
  ASSERT_GT(before, 0u);
  zmq::context_t ctx(2);
  int dropped = 0;
  {
    std::vector<zmq::socket_t> floods;
    std::vector<std::unique_ptr<ConnectionEvents>> events;
    const std::string mb(1 << 20, 'f');
    for (int c = 0; c < 5; ++c) {
      floods.push_back(Dealer(&ctx, c < 4 ? WorkerIdentity(0, 0) : "huge", endpoint, nullptr, "",
                              [&](zmq::socket_t& s) {
                                events.push_back(std::make_unique<ConnectionEvents>(&ctx, s));
                              }));
      if (c == 4) {
        (void)floods.back().send(zmq::buffer(std::string(100 << 20, 'h')),
                                 zmq::send_flags::dontwait);
        continue;
      }
      // Single-frame messages: libzmq 4.3.4 aborts the sender (errno
      // assert in session_base.cpp's clean_pipes) when the peer drops a
      // connection in the middle of a multi-frame message.
      for (int i = 0; i < 64; ++i) {
        (void)floods.back().send(zmq::buffer(mb), zmq::send_flags::dontwait);
      }
    }
    for (size_t c = 0; c < floods.size(); ++c) {
      dropped += events[c]->WaitForEnd(absl::Seconds(30));
      EXPECT_TRUE(events[c]->ended())
          << "flood connection " << c << " was never dropped; events:" << events[c]->seen();
    }
  }
  // Within the limit: malformed requests, 8 from each of 16 connections,
  // which then close.
  int answered = 0;
  {
    std::vector<zmq::socket_t> peers;
    std::vector<std::unique_ptr<ConnectionEvents>> events;
    for (int c = 0; c < 16; ++c) {
      peers.push_back(
          Dealer(&ctx, absl::StrCat("garbage-", c), endpoint, nullptr, "", [&](zmq::socket_t& s) {
            events.push_back(std::make_unique<ConnectionEvents>(&ctx, s));
          }));
      for (int i = 0; i < 8; ++i) {
        std::vector<zmq::message_t> frames;
        frames.emplace_back(std::string("\x08\x01\x10\x02 not a header"));
        frames.emplace_back(std::string(2000, 'x'));
        (void)zmq::send_multipart(peers.back(), frames, zmq::send_flags::dontwait);
      }
    }
    // One budget for all of them: a server that answers none fails in a
    // minute, not in 16 waits.
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    for (size_t c = 0; c < peers.size(); ++c) {
      if (!insecure) {
        EXPECT_TRUE(events[c]->WaitForEnd(absl::Seconds(30))) << "connection " << c;
        continue;
      }
      // Each refused with an ERROR naming why.
      for (int i = 0; i < 8 && GetsAnyReply(peers[c], deadline - absl::Now()); ++i) {
        std::vector<zmq::message_t> reply;
        (void)zmq::recv_multipart(peers[c], std::back_inserter(reply));
        ++answered;
      }
    }
  }
  if (insecure) {
    EXPECT_EQ(answered, 16 * 8);
  }
  const uint64_t after = ResidentBytes(job.server_pid());
  const double grown_mb = (static_cast<double>(after) - static_cast<double>(before)) / (1 << 20);
  std::printf(
      "%s server: %d of 5 oversized flood connections dropped, %d of %d small requests "
      "answered with ERROR; grew from %llu to %llu MB (%.1f MB; bound 20)\n",
      insecure ? "insecure" : "secured", dropped, answered, insecure ? 16 * 8 : 0,
      static_cast<unsigned long long>(before >> 20), static_cast<unsigned long long>(after >> 20),
      grown_mb);
  EXPECT_LT(grown_mb, 20.0) << "the server held what the floods sent";
  job.SignalWorkers(SIGCONT);
  job.ExpectCleanEnd();
  if (insecure) {
    EXPECT_GE(RefusalsLogged(job.Log("server")), 16u * 8) << job.Log("server");
  } else {
    EXPECT_THAT(job.Log("server"), Not(HasSubstr("refused a request")));
  }
}

TEST(Security, FloodsOfLargeFramesAndDuplicateIdentitiesStayBounded) {
  FloodAndRun("flood", SecretFlag());
}

TEST(Security, FloodsStayBoundedUnderInsecureToo) { FloodAndRun("flood-insecure", "--insecure"); }

// What a client without the secret can make a secured coordinator hold,
// after each kind of flood that once grew it (by 31, 17 and 34 MB on their
// own; 88 MB for 1000 connections here): 1000 TLS connections meant to
// idle, 100 forged heartbeats of 1 MB of metrics each, and one of 64 MB.
// Each flood is seen to arrive (every connection attempt ends READY or
// refused, every call is refused), the coordinator's growth (VmRSS) stays
// under 20 MB in all, and the job then runs as a clean run does.
TEST(Security, FloodsWithoutTheSecretLeaveTheCoordinatorBounded) {
  Job job("coordflood", JobConfig(300), SecretFlag());
  const pid_t pid = job.coordinator_pid();
  auto stub = control::Coordinator::NewStub(ChannelWithoutCredential(job.target()));
  auto forged = [&](int rows, size_t error_bytes) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    control::HeartbeatRequest req;
    req.set_role(control::WORKER);
    req.set_error(std::string(error_bytes, 'e'));
    for (int i = 0; i < rows; ++i) {
      control::StepMetrics* m = req.add_metrics();
      m->set_step(i);
      m->set_loss(1.5f);
      m->set_wall_s(i);
      m->set_step_s(0.25);
      m->set_bytes_up(uint64_t{1} << 40);
      m->set_bytes_down(uint64_t{1} << 40);
      m->set_push_s(0.125);
      m->set_reply_s(0.125);
      m->set_phase("compress");
      m->set_epoch(i);
      m->set_test_loss(2.5);
      m->set_test_accuracy(0.5);
    }
    control::HeartbeatReply r;
    return stub->Heartbeat(&c, req, &r);
  };
  // A refused call's status: the coordinator heard it and said no. Its TLS
  // handshake asks for the job's certificate, which this client lacks, and
  // closes the connection ("Socket closed"; not a connection refused, which
  // would be a coordinator that is not there).
  auto refused = [](const grpc::Status& st) {
    return st.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
           st.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED ||
           (st.error_code() == grpc::StatusCode::UNAVAILABLE &&
            !absl::StrContains(st.error_message(), "Connection refused"));
  };
  // What gRPC allocates once (its threads, the TLS context) is not growth.
  const grpc::Status warm = forged(100, 0);
  ASSERT_TRUE(refused(warm)) << warm.error_code() << " " << warm.error_message();
  const int sockets_before = OpenSockets(pid);
  const uint64_t before = ResidentBytes(pid);
  ASSERT_GT(before, 0u);
  auto grown_mb = [&](uint64_t now) {
    return (static_cast<double>(now) - static_cast<double>(before)) / (1 << 20);
  };
  constexpr double kBoundMb = 20;

  // What the coordinator holds once a flood is over: it hands freed memory
  // back every second, so this waits (at most 10 s) for the growth to fall
  // under the bound.
  auto settled_mb = [&] {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    double mb = grown_mb(ResidentBytes(pid));
    while (mb >= kBoundMb && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(100));
      mb = grown_mb(ResidentBytes(pid));
    }
    return mb;
  };

  // 1000 connections at once, each its own (no shared subchannel), meant
  // to idle; each ends READY (TLS done) or refused.
  {
    grpc::SslCredentialsOptions o;
    o.pem_root_certs = ControlCertificateOf(*JobSecurity().secret).cert_pem;
    std::vector<std::shared_ptr<grpc::Channel>> idle;
    for (int i = 0; i < 1000; ++i) {
      grpc::ChannelArguments args;
      args.SetSslTargetNameOverride(kControlServerName);
      args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
      idle.push_back(grpc::CreateCustomChannel(job.target(), grpc::SslCredentials(o), args));
      idle.back()->GetState(/*try_to_connect=*/true);
    }
    int ready = 0, failed = 0;
    const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(60);
    for (auto& ch : idle) {
      while (true) {
        const grpc_connectivity_state s = ch->GetState(false);
        if (s == GRPC_CHANNEL_READY || s == GRPC_CHANNEL_TRANSIENT_FAILURE) {
          ++(s == GRPC_CHANNEL_READY ? ready : failed);
          break;
        }
        if (!ch->WaitForStateChange(s, deadline)) break;
      }
    }
    const int sockets = OpenSockets(pid);
    const uint64_t held = ResidentBytes(pid);
    std::printf(
        "1000 connections: %d READY, %d refused; meanwhile the coordinator had %d sockets "
        "(%d before) and had grown by %.1f MB\n",
        ready, failed, sockets, sockets_before, grown_mb(held));
    EXPECT_EQ(ready + failed, 1000) << "connection attempts that never ended";
    EXPECT_EQ(ready, 0) << "connections without the job's certificate got through TLS";
  }
  // Closed on our side (the channels stop retrying): the coordinator's
  // sockets go with them.
  const absl::Time closed_by = absl::Now() + absl::Seconds(30);
  while (OpenSockets(pid) > sockets_before + 2 && absl::Now() < closed_by) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  const double after_idle = settled_mb();
  std::printf("after they closed: %d sockets; grown by %.1f MB (bound %.0f)\n", OpenSockets(pid),
              after_idle, kBoundMb);
  EXPECT_LT(after_idle, kBoundMb) << "after 1000 connections";

  // 100 forged heartbeats of 10 000 metrics rows (1 MB) each.
  int refusals = 0;
  for (int i = 0; i < 100; ++i) {
    const grpc::Status st = forged(10000, 0);
    EXPECT_TRUE(refused(st)) << st.error_code() << " " << st.error_message();
    refusals += refused(st);
  }
  const double after_metrics = settled_mb();
  std::printf("100 forged heartbeats of 1 MB: %d refused; grown by %.1f MB (bound %.0f)\n",
              refusals, after_metrics, kBoundMb);
  EXPECT_EQ(refusals, 100);
  EXPECT_LT(after_metrics, kBoundMb) << "after forged metrics";

  // One forged heartbeat of 64 MB; and one from a client that has the
  // job's certificate (only a holder of the secret can) but no call
  // credential, which is refused from its headers before it is read.
  auto certified = control::Coordinator::NewStub(ChannelWithoutCredential(job.target(), true));
  for (auto* s : {stub.get(), certified.get()}) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    control::HeartbeatRequest req;
    req.set_error(std::string(64u << 20, 'e'));
    control::HeartbeatReply r;
    const grpc::Status big = s->Heartbeat(&c, req, &r);
    const double after_big = settled_mb();
    const char* who = s == stub.get() ? "without the certificate" : "without the credential";
    std::printf("a forged request of 64 MB %s: %s (%s); grown by %.1f MB (bound %.0f)\n", who,
                refused(big) ? "refused" : "NOT refused", big.error_message().substr(0, 60).c_str(),
                after_big, kBoundMb);
    EXPECT_TRUE(refused(big)) << who << ": " << big.error_code() << " " << big.error_message();
    EXPECT_LT(after_big, kBoundMb) << "after a 64 MB request " << who;
  }
  EXPECT_TRUE(WaitForText(job.dir() + "/coordinator.log",
                          "refused a Heartbeat: no valid job credential", absl::Seconds(10)));

  job.StartServer();
  job.StartWorkers();
  job.ExpectCleanEnd();
  // The coordinator saw them: their handshakes failed (counted every few
  // seconds).
  EXPECT_THAT(job.Log("coordinator"), HasSubstr("TLS handshake(s) failed"));
}

// A process of the job on a starved host heartbeats late, and the
// coordinator gives it kSlowCoordinatorFactor heartbeat timeouts before it
// calls it dead; its connection is kept as long (when it was closed after
// one timeout, 256 processes on 2 cores lost theirs, and then their new
// handshakes, and gave up). It is still closed after that: a connection
// idle so long is nobody's.
TEST(Security, AQuietConnectionIsKeptForTheSlowBudgetAndClosedAfter) {
  control::TrainingConfig cfg = JobConfig(30);
  cfg.mutable_timeouts()->set_heartbeat_ms(1000);
  Job job("quiet", cfg, SecretFlag());
  // With the job's certificate, the TLS handshake succeeds (the call itself
  // lacks the credential and is refused, which still uses the connection).
  std::shared_ptr<grpc::Channel> channel = ChannelWithoutCredential(job.target(), true);
  auto stub = control::Coordinator::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  control::StatusRequest req;
  control::StatusReply reply;
  EXPECT_EQ(stub->Status(&ctx, req, &reply).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  const absl::Time last_call = absl::Now();
  ASSERT_EQ(channel->GetState(false), GRPC_CHANNEL_READY);
  // Three heartbeat timeouts of silence: still connected.
  absl::SleepFor(absl::Seconds(3));
  EXPECT_EQ(channel->GetState(false), GRPC_CHANNEL_READY)
      << "the coordinator closed a connection quiet for 3 heartbeat timeouts";
  // The coordinator closes it at 6 (kSlowCoordinatorFactor); the channel
  // then idles.
  const auto deadline = std::chrono::system_clock::now() + std::chrono::seconds(20);
  grpc_connectivity_state st = channel->GetState(false);
  while (st == GRPC_CHANNEL_READY && channel->WaitForStateChange(st, deadline)) {
    st = channel->GetState(false);
  }
  EXPECT_NE(st, GRPC_CHANNEL_READY) << "a connection quiet for 20 s was kept";
  const absl::Duration quiet = absl::Now() - last_call;
  EXPECT_GE(quiet, absl::Seconds(kSlowCoordinatorFactor) - absl::Milliseconds(500));
  std::printf("a quiet connection was closed after %s (heartbeat timeout 1s)\n",
              absl::FormatDuration(quiet).c_str());
  job.StartServer();
  job.StartWorkers();
  job.ExpectCleanEnd();
}

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
