// Integration: bad input and faults. Every refusal must name the
// problem and change no state; every failure must name what died or is
// missing, within its timeout, never hang.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "compress/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/model.h"
#include "net/control.h"
#include "net/data_plane.h"
#include "net/health.h"
#include "security/curve.h"
#include "security/job_secret.h"
#include "tests/cluster/test_util.h"
#include "util/checksum.h"
#include "zmq.hpp"
#include "zmq_addon.hpp"

namespace onebit::testing {
namespace {

using ::testing::HasSubstr;

// Waits for the coordinator's --port_file; fails the test on timeout.
int WaitForPort(const std::string& port_file, Subprocess* coordinator, const std::string& log) {
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (absl::Now() < deadline) {
    std::ifstream in(port_file);
    int port = 0;
    if (in >> port && port > 0) return port;
    if (coordinator->Poll()) {
      ADD_FAILURE() << "coordinator exited: " << ReadFile(log);
      return 0;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  ADD_FAILURE() << "no port file " << port_file;
  return 0;
}

// A test double of a worker's data-plane socket.
class FakeWorker {
 public:
  // With `keys`: a CURVE client of the server of `server_key`.
  FakeWorker(zmq::context_t* ctx, const std::string& identity, const std::string& endpoint,
             const CurveKeys* keys = nullptr, const std::string& server_key = "")
      : socket_(*ctx, zmq::socket_type::dealer) {
    socket_.set(zmq::sockopt::routing_id, identity);
    socket_.set(zmq::sockopt::linger, 0);
    if (keys != nullptr) MakeCurveClient(&socket_, *keys, server_key);
    socket_.connect(endpoint);
  }

  void SendFrames(const std::vector<std::string>& frames) {
    for (size_t i = 0; i < frames.size(); ++i) {
      socket_.send(zmq::buffer(frames[i]),
                   i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  void Send(const data::Header& h, const std::string& payload) {
    SendFrames({h.SerializeAsString(), payload});
  }

  // The next message, or a header with kind UNSPECIFIED after 10 s.
  std::pair<data::Header, std::string> Receive() {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(10000));
    std::vector<zmq::message_t> frames;
    if (!(item.revents & ZMQ_POLLIN) ||
        !zmq::recv_multipart(socket_, std::back_inserter(frames), zmq::recv_flags::dontwait)) {
      return {};
    }
    data::Header h;
    EXPECT_TRUE(h.ParseFromArray(frames[0].data(), static_cast<int>(frames[0].size())));
    return {h, frames.size() > 1 ? frames[1].to_string() : ""};
  }

  // Expects an ERROR reply whose reason contains `text`.
  void ExpectError(const std::string& text) {
    auto [h, payload] = Receive();
    EXPECT_EQ(h.kind(), data::ERROR) << "want an error naming '" << text << "'";
    EXPECT_THAT(h.error(), HasSubstr(text));
  }

 private:
  zmq::socket_t socket_;
};

// How long ago, by the coordinator at `target` (secured by the test's
// secret), a peer last said it heard from `role` `rank` in the data plane;
// asked every 50 ms until some peer has, for up to `wait`; -1: none has.
double SinceHeard(const std::string& target, control::Role role, uint32_t rank,
                  absl::Duration wait) {
  auto security = ResolveSecurity(SecretFile(), false, "secret");
  EXPECT_TRUE(security.ok()) << security.status();
  if (!security.ok()) return -1;
  auto stub = control::Coordinator::NewStub(MakeChannel(target, *security));
  const absl::Time until = absl::Now() + wait;
  double since = -1;
  while (since < 0 && absl::Now() < until) {
    grpc::ClientContext ctx;
    control::StatusReply st;
    EXPECT_TRUE(stub->Status(&ctx, control::StatusRequest(), &st).ok());
    for (const auto& p : st.processes()) {
      if (p.role() == role && p.rank() == rank) since = p.since_heard_s();
    }
    if (since < 0) absl::SleepFor(absl::Milliseconds(50));
  }
  return since;
}

std::string Fp32Bytes(const float* x, size_t n) {
  return std::string(reinterpret_cast<const char*>(x), n * sizeof(float));
}

// A job of 2 workers played by the test against a real coordinator and
// server (secured, as by default): every kind of bad request first, then the
// real steps; the result must equal the reference exactly, so no bad request
// changed any state.
TEST(Faults, BadRequestsAreRefusedByNameAndChangeNothing) {
  const std::string dir = TempDir("badreq");
  control::TrainingConfig cfg = MakeConfig(2, 1, 1000, 2, "adam");
  std::vector<std::string> cargv = {Bin("onebit-coordinator"),      "--port=0",
                                    "--port_file=" + dir + "/port", "--bind_host=127.0.0.1",
                                    "--out=" + dir + "/run",        SecretFlag()};
  for (const std::string& a : ConfigArgs(cfg)) cargv.push_back(a);
  Subprocess coord = Start(cargv, dir + "/coordinator.log");
  const int port = WaitForPort(dir + "/port", &coord, dir + "/coordinator.log");
  ASSERT_GT(port, 0);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  Subprocess server =
      Start({Bin("onebit-server"), "--coordinator=" + target, "--shard=0", "--bind_host=127.0.0.1",
             "--advertise_host=127.0.0.1", "--dump_x=" + dir + "/master.f32", SecretFlag()},
            dir + "/server.log");

  auto security = ResolveSecurity(SecretFile(), false, "secret");
  ASSERT_TRUE(security.ok()) << security.status();
  auto stub = control::Coordinator::NewStub(MakeChannel(target, *security));
  std::vector<absl::StatusOr<control::RegisterReply>> regs(2, absl::UnknownError("unset"));
  const CurveKeys keys[2] = {NewCurveKeys(), NewCurveKeys()};
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        control::RegisterRequest req;
        req.set_role(control::WORKER);
        req.set_requested_rank(r);
        req.set_curve_public_key(keys[r].public_key);
        regs[r] = RegisterWithCoordinator(stub.get(), target, req, absl::Seconds(20));
      });
    }
    for (auto& t : threads) t.join();
  }
  ASSERT_TRUE(regs[0].ok()) << regs[0].status();
  ASSERT_TRUE(regs[1].ok()) << regs[1].status();
  const uint64_t job = regs[0]->job_id();
  ASSERT_EQ(regs[0]->servers_size(), 1);
  const std::string endpoint = regs[0]->servers(0).data_endpoint();

  // Every process serves grpc.health.v1; the coordinator also on its
  // plaintext --health_port (any free one here), named in its first line.
  EXPECT_TRUE(CheckHealth(target, absl::Seconds(5), &*security).ok());
  {
    const std::string log = ReadFile(dir + "/coordinator.log");
    const size_t at = log.find("(health on port ");
    ASSERT_NE(at, std::string::npos) << log;
    int health_port = 0;
    ASSERT_TRUE(absl::SimpleAtoi(log.substr(at + 16, log.find(')', at) - at - 16), &health_port))
        << log;
    EXPECT_NE(health_port, port);
    EXPECT_TRUE(CheckHealth(absl::StrCat("127.0.0.1:", health_port), absl::Seconds(5)).ok());
  }
  {
    grpc::ClientContext ctx;
    control::StatusRequest req;
    control::StatusReply st;
    ASSERT_TRUE(stub->Status(&ctx, req, &st).ok());
    EXPECT_EQ(st.state(), "running");
    for (const auto& p : st.processes()) {
      if (p.role() == control::SERVER) {
        EXPECT_TRUE(CheckHealth(p.health_endpoint(), absl::Seconds(5)).ok()) << p.health_endpoint();
      }
    }
  }

  zmq::context_t ctx(1);
  const std::string server_key = regs[0]->servers(0).curve_public_key();
  {
    // Worker 1's key as worker 0, there before worker 0 (its routing id is
    // the sender's to choose, its key is not).
    FakeWorker squatter(&ctx, WorkerIdentity(job, 0), endpoint, &keys[1], server_key);
    data::Header h;
    h.set_version(kProtocolVersion);
    h.set_job_id(job);
    h.set_kind(data::PUSH);
    h.set_rank(0);
    h.set_shard(0);
    h.set_count(cfg.compression().chunk_elems());
    h.set_codec("fp32");
    h.set_block_size(cfg.compression().block_size());
    h.set_payload_bytes(cfg.compression().chunk_elems() * 4);
    squatter.Send(h, std::string(cfg.compression().chunk_elems() * 4, '\0'));
    squatter.ExpectError("rank 0 claimed by the key of worker 1");
  }
  absl::SleepFor(absl::Milliseconds(300));  // its disconnect frees the routing id
  FakeWorker w0(&ctx, WorkerIdentity(job, 0), endpoint, &keys[0], server_key);
  FakeWorker w1(&ctx, WorkerIdentity(job, 1), endpoint, &keys[1], server_key);
  // Worker 1's key on another socket.
  FakeWorker intruder(&ctx, "intruder", endpoint, &keys[1], server_key);

  auto model = NewModel(cfg);
  ASSERT_TRUE(model.ok());
  std::vector<float> x(cfg.model().dim()), g0(cfg.model().dim()), g1(cfg.model().dim());
  (*model)->Init(x.data());
  const uint64_t chunk = cfg.compression().chunk_elems();  // 256: chunks of 256, 256, 256, 232
  auto header = [&](uint32_t rank, uint64_t step, uint64_t c, data::Kind kind) {
    data::Header h;
    h.set_version(kProtocolVersion);
    h.set_job_id(job);
    h.set_kind(kind);
    h.set_rank(rank);
    h.set_step(step);
    h.set_shard(0);
    h.set_begin(c * chunk);
    const uint64_t n = std::min<uint64_t>(chunk, cfg.model().dim() - c * chunk);
    h.set_count(n);
    h.set_codec("fp32");
    h.set_block_size(cfg.compression().block_size());
    h.set_payload_bytes(n * 4);
    return h;
  };
  const std::string good_payload = Fp32Bytes(g1.data(), chunk);

  // --- every bad request, each refused by name ---
  auto bad = [&](auto mutate, const std::string& text) {
    data::Header h = header(1, 0, 0, data::PUSH);
    std::string payload = good_payload;
    mutate(h, payload);
    w1.Send(h, payload);
    w1.ExpectError(text);
  };
  bad([](data::Header& h, std::string&) { h.set_version(7); }, "unsupported protocol version 7");
  bad([](data::Header& h, std::string&) { h.set_job_id(h.job_id() ^ 1); }, "wrong job id");
  bad([](data::Header& h, std::string&) { h.set_rank(5); }, "unknown worker rank 5");
  bad([](data::Header& h, std::string&) { h.set_rank(0); }, "claimed by a socket");
  bad([](data::Header& h, std::string&) { h.set_shard(3); }, "shard 3 out of range");
  bad([](data::Header& h, std::string&) { h.set_begin(10); }, "not at a chunk");
  bad([](data::Header& h, std::string&) { h.set_begin(5000); }, "not at a chunk");
  bad([](data::Header& h, std::string&) { h.set_count(100); }, "wrong element count 100");
  bad([](data::Header& h, std::string&) { h.set_payload_bytes(12); }, "wrong payload length 12");
  bad([](data::Header&, std::string& p) { p.resize(p.size() - 4); }, "frame has 1020");
  bad([](data::Header& h, std::string&) { h.set_step(1); }, "step 1 is from the future");
  bad([](data::Header& h, std::string&) { h.set_step(9); }, "beyond the job's last step");
  bad([](data::Header& h, std::string&) { h.set_codec("zstd"); }, "unknown codec 'zstd'");
  bad([](data::Header& h, std::string&) { h.set_block_size(64); }, "wrong block size 64");
  bad([](data::Header& h, std::string&) { h.set_kind(data::REPLY); }, "unexpected message kind");
  bad([](data::Header& h, std::string&) { h.set_kind(data::INIT); }, "only rank 0");
  {
    std::string truncated = header(1, 0, 0, data::PUSH).SerializeAsString();
    truncated.pop_back();  // cuts the last varint in half
    w1.SendFrames({truncated, good_payload});
    w1.ExpectError("malformed header");
    w1.SendFrames({std::string(16, '\xff'), good_payload});
    w1.ExpectError("malformed header");
    w1.SendFrames({header(1, 0, 0, data::PUSH).SerializeAsString()});
    w1.ExpectError("expected 2 frames");
    intruder.SendFrames({"\x13\x37 random bytes \x01\x02\xfe"});
    intruder.ExpectError("malformed header");
    intruder.Send(header(0, 0, 0, data::PUSH), good_payload);
    intruder.ExpectError("claimed by a socket");
    intruder.Send(header(1, 0, 0, data::PUSH), good_payload);
    intruder.ExpectError("claimed by a socket that is not that worker's");
  }

  // --- the real job, with out-of-order arrivals, a corrupt payload and a
  // duplicate on the way ---
  const uint64_t chunks = 4;
  // INIT from rank 0: the masters start from the workers' x0.
  for (uint64_t c = 0; c < chunks; ++c) {
    data::Header h = header(0, 0, c, data::INIT);
    w0.Send(h, Fp32Bytes(x.data() + c * chunk, h.count()));
  }
  {
    // The optimizer state between steps (after the INIT, on its socket):
    // Adam's x, m and v of the chunk as of step 0; a request for another
    // step, or carrying a payload, is refused by name.
    data::Header pull = header(0, 0, 1, data::STATE_PULL);
    pull.set_payload_bytes(0);
    w0.Send(pull, "");
    auto [h, payload] = w0.Receive();
    ASSERT_EQ(h.kind(), data::STATE) << h.error();
    EXPECT_EQ(h.begin(), chunk);
    EXPECT_FALSE(h.frozen());
    ASSERT_EQ(std::vector<std::string>(h.arrays().begin(), h.arrays().end()),
              (std::vector<std::string>{"x", "m", "v"}));
    ASSERT_EQ(payload.size(), 3 * 4 * chunk);
    EXPECT_EQ(payload.substr(0, 4 * chunk), Fp32Bytes(x.data() + chunk, chunk));
    EXPECT_EQ(payload.substr(4 * chunk), std::string(2 * 4 * chunk, '\0'));  // m, v start at 0
    pull.set_rank(1);
    pull.set_step(1);
    w1.Send(pull, "");
    w1.ExpectError("STATE_PULL for step 1, but shard 0 is at step 0");
    pull.set_step(0);
    pull.set_payload_bytes(4);
    w1.Send(pull, "abcd");
    w1.ExpectError("wrong payload length 4");
  }
  {
    // The server's heartbeats pass on that it heard from worker 0 (which
    // itself sends none): the coordinator's status shows it.
    const double since_heard = SinceHeard(target, control::WORKER, 0, absl::Seconds(10));
    EXPECT_GE(since_heard, 0) << "no heartbeat of the server said it heard from worker 0";
    EXPECT_LT(since_heard, 10);
  }
  {
    // Seeding Adam's state before step 0 (rank 0): one array per message,
    // answered with STATE_TAKEN; all must name the same bias_steps. Zeros,
    // so that the job below runs as it would have.
    data::Header seed = header(0, 0, 1, data::STATE_PUSH);
    seed.add_arrays("e");
    const std::string zeros(4 * chunk, '\0');
    w0.Send(seed, zeros);
    w0.ExpectError("STATE_PUSH: names 1 arrays (e); want one, m or v");
    seed.set_arrays(0, "v");
    w0.Send(seed, zeros);
    auto [h, payload] = w0.Receive();
    ASSERT_EQ(h.kind(), data::STATE_TAKEN) << h.error();
    EXPECT_EQ(h.begin(), chunk);
    ASSERT_EQ(h.arrays_size(), 1);
    EXPECT_EQ(h.arrays(0), "v");
    EXPECT_TRUE(payload.empty());
    seed.set_bias_steps(3);
    w0.Send(seed, zeros);
    w0.ExpectError("STATE_PUSH: bias_steps 3, but an earlier STATE_PUSH said 0");
    seed.set_rank(1);
    seed.set_bias_steps(0);
    w1.Send(seed, zeros);
    w1.ExpectError("STATE_PUSH from rank 1 (only rank 0 seeds the optimizer state)");
  }
  {
    // A loss scale's vote before step 0: one per rank, the verdict to both
    // once both are in (rank 1's overflow makes it true).
    data::Header vote = header(0, 0, 0, data::VOTE);
    vote.set_payload_bytes(0);
    w0.Send(vote, "");
    w0.Send(vote, "");
    w0.ExpectError("duplicate VOTE from rank 0 for step 0");
    vote.set_rank(1);
    vote.set_found_inf(true);
    w1.Send(vote, "");
    for (FakeWorker* w : {&w0, &w1}) {
      auto [h, payload] = w->Receive();
      ASSERT_EQ(h.kind(), data::VERDICT) << h.error();
      EXPECT_EQ(h.step(), 0u);
      EXPECT_TRUE(h.found_inf());
      EXPECT_TRUE(payload.empty());
    }
  }
  {
    // A gradient scale names the shard's current step, once per rank; one
    // for pushes that did not wait for it changes nothing.
    data::Header scale = header(0, 1, 0, data::GRAD_SCALE);
    scale.set_payload_bytes(0);
    scale.set_grad_scale(1.0f);
    w0.Send(scale, "");
    w0.ExpectError("GRAD_SCALE for step 1, but shard 0 is at step 0");
    scale.set_step(0);
    w0.Send(scale, "");
    w0.Send(scale, "");
    w0.ExpectError("duplicate GRAD_SCALE from rank 0 for step 0");
  }
  // Replies carry Δ; both workers must get the same bytes; x += Δ.
  // Receives into `replies` (kept from earlier calls) until every chunk's
  // reply is in, or until the first error when `until_error`.
  auto collect = [&](FakeWorker& w, uint64_t step, std::vector<std::string>* replies,
                     std::vector<std::string>* errors, bool until_error = false) {
    replies->resize(chunks);
    size_t got = 0;
    for (const std::string& r : *replies) got += !r.empty();
    while (got < chunks) {
      auto [h, payload] = w.Receive();
      ASSERT_NE(h.kind(), data::KIND_UNSPECIFIED) << "timed out waiting for replies";
      if (h.kind() == data::ERROR) {
        errors->push_back(h.error());
        if (until_error) return;
        continue;
      }
      ASSERT_EQ(h.kind(), data::REPLY);
      ASSERT_EQ(h.step(), step);
      const uint64_t c = h.begin() / chunk;
      ASSERT_LT(c, chunks);
      ASSERT_EQ((*replies)[c], "");
      ASSERT_EQ(payload.size(), h.count() * 4);
      (*replies)[c] = payload;
      ++got;
    }
  };
  auto apply = [&](const std::vector<std::string>& replies) {
    for (uint64_t c = 0; c < chunks; ++c) {
      const float* d = reinterpret_cast<const float*>(replies[c].data());
      for (size_t i = 0; i < replies[c].size() / 4; ++i) x[c * chunk + i] += d[i];
    }
  };

  // Step 0.
  ASSERT_TRUE((*model)->Gradient(x.data(), 0, 0, g0.data()).ok());
  ASSERT_TRUE((*model)->Gradient(x.data(), 1, 0, g1.data()).ok());
  {
    // Rank 1 first (held until rank 0's chunk arrives), chunk 0 carrying a NaN.
    std::vector<float> poisoned(g1.begin(), g1.begin() + chunk);
    poisoned[17] = std::numeric_limits<float>::quiet_NaN();
    w1.Send(header(1, 0, 0, data::PUSH), Fp32Bytes(poisoned.data(), chunk));
    for (uint64_t c = chunks; c-- > 1;) {
      data::Header h = header(1, 0, c, data::PUSH);
      w1.Send(h, Fp32Bytes(g1.data() + c * chunk, h.count()));
    }
    for (uint64_t c = 0; c < chunks; ++c) {
      data::Header h = header(0, 0, c, data::PUSH);
      w0.Send(h, Fp32Bytes(g0.data() + c * chunk, h.count()));
    }
    // The NaN is found when rank 1's chunk 0 is decoded, after rank 0's.
    w1.ExpectError("payload of rank 1 for chunk 0 of step 0 does not decode");
  }
  // A duplicate while chunk 0 waits for rank 1's retry; its error queues
  // behind the replies of chunks 1-3 on w0.
  std::vector<std::string> r0, r1, e0, e1;
  {
    // A loss scale's vote after pushes of its step: every rank votes first.
    data::Header vote = header(0, 0, 0, data::VOTE);
    vote.set_payload_bytes(0);
    w0.Send(vote, "");
    collect(w0, 0, &r0, &e0, /*until_error=*/true);
    ASSERT_EQ(e0.size(), 1u);
    EXPECT_THAT(e0[0], HasSubstr("VOTE from rank 0 for step 0, but rank "));
    EXPECT_THAT(e0[0], HasSubstr(" has pushed to it without one: every rank must step through "
                                 "the same loss scaler"));
    e0.clear();
  }
  w0.Send(header(0, 0, 1, data::PUSH), Fp32Bytes(g0.data() + chunk, chunk));
  collect(w0, 0, &r0, &e0, /*until_error=*/true);
  ASSERT_EQ(e0.size(), 1u);
  EXPECT_THAT(e0[0], HasSubstr("duplicate push from rank 0 for chunk 1 of step 0"));
  e0.clear();
  w1.Send(header(1, 0, 0, data::PUSH), Fp32Bytes(g1.data(), chunk));
  collect(w0, 0, &r0, &e0);
  collect(w1, 0, &r1, &e1);
  EXPECT_TRUE(e0.empty()) << e0[0];
  EXPECT_TRUE(e1.empty()) << e1[0];
  EXPECT_EQ(r0, r1);
  apply(r0);

  // A push of the finished step is from the past.
  w0.Send(header(0, 0, 2, data::PUSH), Fp32Bytes(g0.data() + 2 * chunk, chunk));
  w0.ExpectError("step 0 is from the past (shard 0 is at step 1)");
  {
    data::Header seed = header(0, 1, 2, data::STATE_PUSH);
    seed.add_arrays("m");
    w0.Send(seed, std::string(4 * chunk, '\0'));
    w0.ExpectError("shard 0 is at step 1: a state is seeded only before the job's first step");
  }

  {
    // The state of step 1, asked twice: the step's x (the replicas'), its m
    // and v no longer zero, and the same bytes both times (one payload per
    // chunk and step, shared by every answer).
    data::Header pull = header(0, 1, 1, data::STATE_PULL);
    pull.set_payload_bytes(0);
    std::vector<std::string> got;
    for (int k = 0; k < 2; ++k) {
      w0.Send(pull, "");
      auto [h, payload] = w0.Receive();
      ASSERT_EQ(h.kind(), data::STATE) << h.error();
      ASSERT_EQ(payload.size(), 3 * 4 * chunk);
      got.push_back(payload);
    }
    EXPECT_EQ(got[0], got[1]);
    EXPECT_EQ(got[0].substr(0, 4 * chunk), Fp32Bytes(x.data() + chunk, chunk));
    EXPECT_NE(got[0].substr(4 * chunk, 4 * chunk), std::string(4 * chunk, '\0'));
  }

  // Step 1.
  ASSERT_TRUE((*model)->Gradient(x.data(), 0, 1, g0.data()).ok());
  ASSERT_TRUE((*model)->Gradient(x.data(), 1, 1, g1.data()).ok());
  for (uint64_t c = 0; c < chunks; ++c) {
    data::Header h0 = header(0, 1, c, data::PUSH), h1 = header(1, 1, c, data::PUSH);
    w0.Send(h0, Fp32Bytes(g0.data() + c * chunk, h0.count()));
    w1.Send(h1, Fp32Bytes(g1.data() + c * chunk, h1.count()));
  }
  r0.clear();
  r1.clear();
  collect(w0, 1, &r0, &e0);
  collect(w1, 1, &r1, &e1);
  EXPECT_TRUE(e0.empty() && e1.empty());
  EXPECT_EQ(r0, r1);
  apply(r0);

  ReferenceResult ref = Reference(cfg);
  EXPECT_EQ(FirstDifference(x, ref.x), "");

  // Finish the job: the coordinator must find every replica equal.
  for (uint32_t r = 0; r < 2; ++r) {
    grpc::ClientContext c;
    control::DoneRequest req;
    req.set_role(control::WORKER);
    req.set_rank(r);
    req.set_job_id(job);
    req.set_credential(regs[r]->credential());
    control::ShardChecksum* s = req.add_checksums();
    s->set_shard(0);
    s->set_begin(0);
    s->set_end(cfg.model().dim());
    s->set_crc32(Crc32OfFloats(x.data(), x.size()));
    control::DoneReply reply;
    ASSERT_TRUE(stub->Done(&c, req, &reply).ok());
  }
  auto coord_code = coord.Wait(absl::Seconds(20));
  auto server_code = server.Wait(absl::Seconds(20));
  ASSERT_TRUE(coord_code.has_value());
  ASSERT_TRUE(server_code.has_value());
  EXPECT_EQ(*coord_code, 0) << ReadFile(dir + "/coordinator.log");
  EXPECT_EQ(*server_code, 0) << ReadFile(dir + "/server.log");
  EXPECT_THAT(ReadFile(dir + "/run/summary.json"), HasSubstr("\"replicas_equal\": true"));
  EXPECT_EQ(FirstDifference(ReadFloats(dir + "/master.f32"), ref.masters[0].x), "");
}

// A launched job (d = 3000, 100 steps, a 20 s heartbeat timeout) whose
// worker 1 stops pushing at `stall_at`, into `out`; it must fail, not hang.
RunResult RunWithWorkerOneStalled(const std::string& out, int workers, int servers, int stall_at,
                                  const std::string& step_timeout) {
  RunResult r = RunCommand(
      {Bin("onebit-launch"), absl::StrCat("--workers=", workers),
       absl::StrCat("--servers=", servers), "--dim=3000", "--steps=100", "--block_size=32",
       "--chunk_elems=512", "--stall_worker=1", absl::StrCat("--stall_at_step=", stall_at),
       "--step_timeout=" + step_timeout, "--heartbeat_timeout=20s", "--out=" + out},
      absl::Seconds(30));
  EXPECT_NE(r.code, 0) << r.output;
  EXPECT_NE(r.code, -1) << "hung: " << r.output;
  return r;
}

TEST(Faults, StalledWorkerFailsTheOthersNamingTheRank) {
  const absl::Time t0 = absl::Now();
  const std::string out = TempDir("stalled") + "/run";
  RunResult r = RunWithWorkerOneStalled(out, 3, 2, 2, "3s");
  EXPECT_THAT(r.output, HasSubstr("no push from rank 1 within --step_timeout=3s"));
  // The other workers fail with that reason (from the server's error reply),
  // which names one step, the true one, throughout.
  EXPECT_THAT(r.output, ::testing::ContainsRegex(
                            "\\[worker0\\] .*worker 0: server [01] \\(tcp://[0-9.:]+\\) refused "
                            "rank 0's step 2: shard [01] step 2: no push from rank 1"));
  EXPECT_THAT(r.output, ::testing::Not(::testing::ContainsRegex("refused rank [02]'s step [^2]")));
  // Failed by the 3 s step timeout (the message above), not by the 20 s
  // heartbeat timeout: the one bound a loaded machine cannot break.
  EXPECT_LT(absl::Now() - t0, absl::Seconds(20));
  // Steps 0 and 1 completed: their rows stay. The stalled worker's row of
  // step 1 goes with its next heartbeat (every second here), which the 3 s
  // step timeout leaves time for; with 1 s it lost the race on a loaded
  // machine.
  const std::string metrics = ReadFile(out + "/metrics.csv");
  EXPECT_EQ(std::count(metrics.begin(), metrics.end(), '\n'), 3) << metrics;
  EXPECT_NE(metrics.find("\n1,warmup,"), std::string::npos) << metrics;
}

// The first step carries the job's start-up (every worker connecting to
// every server), so it gets kStartupSteps (4) step timeouts; a worker that
// never pushes it is still named, after that bound and by it. (A stall at
// a later step: the step timeout alone, the test above.)
TEST(Faults, AWorkerMissingTheFirstStepIsNamedAfterTheStartUpBound) {
  const absl::Time t0 = absl::Now();
  RunResult r = RunWithWorkerOneStalled(TempDir("stalled0") + "/run", 2, 1, 0, "1s");
  const absl::Duration took = absl::Now() - t0;
  EXPECT_THAT(r.output,
              HasSubstr("shard 0 step 0: no push from rank 1 within 4s (the first step's bound: "
                        "it carries the job's start-up)"));
  EXPECT_GE(took, absl::Seconds(4)) << "the first step was given the step timeout alone";
  EXPECT_LT(took, absl::Seconds(20)) << "ended by the heartbeat timeout, not the start-up bound";
}

TEST(Faults, KilledServerStopsWorkerAndCoordinatorNamingIt) {
  const std::string dir = TempDir("killed");
  std::vector<std::string> cargv = {Bin("onebit-coordinator"),
                                    SecretFlag(),
                                    "--port=0",
                                    "--port_file=" + dir + "/port",
                                    "--bind_host=127.0.0.1",
                                    "--workers=1",
                                    "--servers=2",
                                    "--dim=4000",
                                    "--steps=100000000",
                                    "--block_size=32",
                                    "--chunk_elems=512",
                                    "--step_timeout=1s",
                                    "--heartbeat_timeout=1s"};
  Subprocess coord = Start(cargv, dir + "/coordinator.log");
  const int port = WaitForPort(dir + "/port", &coord, dir + "/coordinator.log");
  ASSERT_GT(port, 0);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  std::vector<Subprocess> servers;
  for (int k = 0; k < 2; ++k) {
    servers.push_back(
        Start({Bin("onebit-server"), SecretFlag(), "--coordinator=" + target,
               absl::StrCat("--shard=", k), "--bind_host=127.0.0.1", "--advertise_host=127.0.0.1"},
              absl::StrCat(dir, "/server", k, ".log")));
  }
  Subprocess worker = Start({Bin("onebit-worker"), SecretFlag(), "--coordinator=" + target,
                             "--rank=0", "--bind_host=127.0.0.1", "--progress_interval=50ms"},
                            dir + "/worker.log");
  ASSERT_TRUE(WaitForText(dir + "/worker.log", "steps/s", absl::Seconds(20)))
      << ReadFile(dir + "/worker.log");
  // While it runs, each side's heartbeats say it hears from the others: the
  // worker from both servers, the servers from the worker.
  for (uint32_t k = 0; k < 2; ++k) {
    EXPECT_GE(SinceHeard(target, control::SERVER, k, absl::Seconds(10)), 0) << "server " << k;
  }
  EXPECT_GE(SinceHeard(target, control::WORKER, 0, absl::Seconds(10)), 0);
  const absl::Time killed = absl::Now();
  kill(servers[1].pid(), SIGKILL);

  auto wcode = worker.Wait(absl::Seconds(10));
  auto ccode = coord.Wait(absl::Seconds(10));
  auto s0code = servers[0].Wait(absl::Seconds(10));
  ASSERT_TRUE(wcode.has_value()) << "worker hung: " << ReadFile(dir + "/worker.log");
  ASSERT_TRUE(ccode.has_value()) << "coordinator hung";
  ASSERT_TRUE(s0code.has_value()) << "server 0 hung";
  // (Each Wait above bounds the time to 10 s; which process noticed is in
  // the logs below, not in a clock window a loaded machine can break.)
  EXPECT_LT(absl::Now() - killed, absl::Seconds(30));
  EXPECT_NE(*wcode, 0);
  EXPECT_NE(*ccode, 0);
  EXPECT_NE(*s0code, 0);
  const std::string wlog = ReadFile(dir + "/worker.log");
  const std::string clog = ReadFile(dir + "/coordinator.log");
  EXPECT_THAT(wlog, HasSubstr("server 1 ("));
  EXPECT_THAT(clog, HasSubstr("server 1 (tcp://127.0.0.1:"));
  EXPECT_THAT(clog, HasSubstr("presumed dead"));
}

TEST(Faults, KilledCoordinatorStopsEveryoneNamingIt) {
  const std::string dir = TempDir("nocoord");
  Subprocess coord =
      Start({Bin("onebit-coordinator"), SecretFlag(), "--port=0", "--port_file=" + dir + "/port",
             "--bind_host=127.0.0.1", "--workers=1", "--servers=1", "--dim=4000",
             "--steps=100000000", "--block_size=32", "--chunk_elems=512", "--heartbeat_timeout=1s"},
            dir + "/coordinator.log");
  const int port = WaitForPort(dir + "/port", &coord, dir + "/coordinator.log");
  ASSERT_GT(port, 0);
  const std::string target = absl::StrCat("127.0.0.1:", port);
  Subprocess server = Start({Bin("onebit-server"), SecretFlag(), "--coordinator=" + target,
                             "--shard=0", "--bind_host=127.0.0.1", "--advertise_host=127.0.0.1"},
                            dir + "/server.log");
  Subprocess worker = Start({Bin("onebit-worker"), SecretFlag(), "--coordinator=" + target,
                             "--rank=0", "--bind_host=127.0.0.1", "--progress_interval=50ms"},
                            dir + "/worker.log");
  ASSERT_TRUE(WaitForText(dir + "/worker.log", "steps/s", absl::Seconds(20)))
      << ReadFile(dir + "/worker.log");
  kill(coord.pid(), SIGKILL);
  auto wcode = worker.Wait(absl::Seconds(10));
  auto scode = server.Wait(absl::Seconds(10));
  ASSERT_TRUE(wcode.has_value()) << "worker hung: " << ReadFile(dir + "/worker.log");
  ASSERT_TRUE(scode.has_value()) << "server hung: " << ReadFile(dir + "/server.log");
  EXPECT_NE(*wcode, 0);
  EXPECT_NE(*scode, 0);
  const std::string named = "the coordinator at " + target + " is unreachable";
  EXPECT_THAT(ReadFile(dir + "/worker.log"), HasSubstr(named));
  EXPECT_THAT(ReadFile(dir + "/server.log"), HasSubstr(named));
}

// A process that crashes (here: told so by a signal) prints the crashed
// thread's stack, symbolized, and still dies of the signal, so that its
// exit status says which; a stop signal stays a stop request.
TEST(Faults, ACrashingProcessPrintsItsStackAndDiesOfTheSignal) {
  const std::string dir = TempDir("crash");
  Subprocess coord =
      Start({Bin("onebit-coordinator"), SecretFlag(), "--port=0", "--port_file=" + dir + "/port",
             "--bind_host=127.0.0.1", "--workers=1", "--servers=1", "--dim=4000"},
            dir + "/coordinator.log");
  const int port = WaitForPort(dir + "/port", &coord, dir + "/coordinator.log");
  ASSERT_GT(port, 0);
  Subprocess server =
      Start({Bin("onebit-server"), SecretFlag(), absl::StrCat("--coordinator=127.0.0.1:", port),
             "--shard=0", "--bind_host=127.0.0.1", "--advertise_host=127.0.0.1"},
            dir + "/server.log");
  ASSERT_TRUE(WaitForText(dir + "/coordinator.log", "server 0 registered", absl::Seconds(20)))
      << ReadFile(dir + "/coordinator.log");
  coord.Signal(SIGABRT);
  server.Signal(SIGSEGV);
  const auto ccode = coord.Wait(absl::Seconds(10));
  const auto scode = server.Wait(absl::Seconds(10));
  ASSERT_TRUE(ccode.has_value() && scode.has_value());
  EXPECT_EQ(DescribeExit(*ccode), "signal 6 (Aborted)");
  EXPECT_EQ(DescribeExit(*scode), "signal 11 (Segmentation fault)");
  const std::string clog = ReadFile(dir + "/coordinator.log");
  const std::string slog = ReadFile(dir + "/server.log");
  EXPECT_THAT(clog, HasSubstr("*** Aborted (crash); the stack of the thread that crashed:\n"));
  EXPECT_THAT(slog,
              HasSubstr("*** Segmentation fault (crash); the stack of the thread that crashed:\n"));
  // The main threads' frames, by name: the coordinator's job loop, the
  // server waiting in its registration.
  EXPECT_THAT(clog, HasSubstr("onebit::RunCoordinatorJob()")) << clog;
  EXPECT_THAT(slog, HasSubstr("onebit::RunServer(")) << slog;
}

TEST(Faults, KilledLauncherLeavesNoOrphans) {
  const std::string dir = TempDir("orphans");
  Subprocess launch =
      Start({Bin("onebit-launch"), "--workers=2", "--servers=2", "--dim=4000", "--steps=100000000",
             "--block_size=32", "--chunk_elems=512", "--out=" + dir + "/run"},
            dir + "/launch.log");
  ASSERT_TRUE(WaitForText(dir + "/launch.log", "steps/s", absl::Seconds(20)))
      << ReadFile(dir + "/launch.log");
  const std::string log = ReadFile(dir + "/launch.log");
  const size_t at = log.find("coordinator at 127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string target = log.substr(at + 15, log.find(' ', at + 15) - at - 15);
  // 1 coordinator (named by --out) + 2 servers + 2 workers (named by target).
  EXPECT_EQ(ProcessesMentioning("--coordinator=" + target).size(), 4u) << target;
  EXPECT_EQ(ProcessesMentioning("--out=" + dir + "/run").size(), 2u);  // launcher too
  kill(launch.pid(), SIGKILL);
  ASSERT_TRUE(launch.Wait(absl::Seconds(5)).has_value());
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  while (absl::Now() < deadline && (!ProcessesMentioning("--coordinator=" + target).empty() ||
                                    !ProcessesMentioning("--out=" + dir + "/run").empty())) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(ProcessesMentioning("--coordinator=" + target).empty());
  EXPECT_TRUE(ProcessesMentioning("--out=" + dir + "/run").empty());
}

std::vector<std::string> Lines(const std::string& text) {
  return absl::StrSplit(text, '\n', absl::SkipEmpty());
}

// kill -9 of a worker: the launcher stops the rest, and the coordinator,
// stopped by SIGTERM, still leaves every metrics row up to the failure and a
// summary that says it failed.
TEST(Faults, AKilledWorkerLeavesTheRunFolderWritten) {
  const std::string dir = TempDir("runfolder");
  const std::string out = dir + "/run";
  Subprocess launch =
      Start({Bin("onebit-launch"), "--workers=2", "--servers=1", "--dim=4000", "--steps=100000000",
             "--block_size=32", "--chunk_elems=512", "--out=" + out},
            dir + "/launch.log");
  ASSERT_TRUE(WaitForText(dir + "/launch.log", "steps/s", absl::Seconds(20)))
      << ReadFile(dir + "/launch.log");
  // The rows are on disk while the job runs.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline && Lines(ReadFile(out + "/metrics.csv")).size() < 20) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  const size_t before = Lines(ReadFile(out + "/metrics.csv")).size();
  EXPECT_GE(before, 20u);
  const std::string log = ReadFile(dir + "/launch.log");
  const size_t at = log.find("coordinator at 127.0.0.1:");
  ASSERT_NE(at, std::string::npos) << log;
  const std::string target = log.substr(at + 15, log.find(' ', at + 15) - at - 15);
  std::vector<int> w1;
  for (int pid : ProcessesMentioning("--coordinator=" + target)) {
    std::string cmd = ReadFile(absl::StrCat("/proc/", pid, "/cmdline"));
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    if (cmd.find("onebit-worker") != std::string::npos &&
        cmd.find("--rank=1") != std::string::npos) {
      w1.push_back(pid);
    }
  }
  ASSERT_EQ(w1.size(), 1u);
  kill(w1[0], SIGKILL);
  auto code = launch.Wait(absl::Seconds(15));
  ASSERT_TRUE(code.has_value()) << "hung: " << ReadFile(dir + "/launch.log");
  EXPECT_NE(*code, 0);
  const std::vector<std::string> lines = Lines(ReadFile(out + "/metrics.csv"));
  ASSERT_GE(lines.size(), before);
  EXPECT_EQ(lines[0].rfind("step,phase,loss,", 0), 0u);
  for (size_t i = 1; i < lines.size(); ++i) {
    EXPECT_EQ(lines[i].rfind(absl::StrCat(i - 1, ","), 0), 0u) << "row " << i << ": " << lines[i];
  }
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_THAT(summary,
              HasSubstr("\"status\": \"failed: stopped by onebit-launch, as worker1 failed "
                        "(signal 9 (Killed))\""));
  EXPECT_THAT(summary, HasSubstr("\"replicas_equal\": false"));
}

// A loss beyond fp32's range (in which metrics travel) is not finite: the
// job fails naming the rank, the step and the value, where it used to end
// "ok" with inf in metrics.csv; the steps before it keep their rows.
TEST(Faults, ALossBeyondFp32FailsTheJobNamingRankStepAndValue) {
  const std::string out = TempDir("huge_loss") + "/run";
  RunResult r = RunCommand({Bin("onebit-launch"), "--workers=2", "--servers=1", "--steps=20",
                            "--dim=1000", "--noise=3e38", "--out=" + out},
                           absl::Seconds(30));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, ::testing::ContainsRegex(
                            "worker [01]: loss is not finite \\([0-9.]+e\\+[0-9]+, beyond "
                            "fp32's range\\) at rank [01] step 1"));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_THAT(Field(summary, "status"), HasSubstr("loss is not finite ("));
  const std::vector<std::string> lines = Lines(ReadFile(out + "/metrics.csv"));
  ASSERT_EQ(lines.size(), 2u);  // the header and step 0
  EXPECT_EQ(lines[1].rfind("0,warmup,0.334", 0), 0u) << lines[1];
}

// A run whose loss grows by orders of magnitude but stays finite is "ok"
// but marked, and the coordinator warns once; one that learns is not.
TEST(Faults, ADivergingRunIsMarkedAndWarnedButNotFailed) {
  const std::string out = TempDir("diverged") + "/run";
  RunResult r = RunCommand({Bin("onebit-launch"), "--workers=2", "--servers=1", "--steps=20",
                            "--dim=1000", "--optimizer=onebit-adam", "--lr=1e6", "--out=" + out},
                           absl::Seconds(30));
  ASSERT_EQ(r.code, 0) << r.output;
  // Measured: step 0's loss 0.334, steps 1-5 around 3.5e12.
  EXPECT_THAT(r.output, ::testing::ContainsRegex(
                            "coordinator: warning: the loss diverged: its median over steps 1-5 "
                            "is [0-9.]+e\\+1[0-9], more than 100x step 0's 0.3344"));
  const std::string summary = ReadFile(out + "/summary.json");
  EXPECT_EQ(Field(summary, "diverged"), "true") << summary;
  EXPECT_EQ(Field(summary, "status"), "\"ok\"");
  EXPECT_EQ(Field(summary, "lr"), "1e+06");

  const std::string calm = TempDir("calm") + "/run";
  r = RunCommand({Bin("onebit-launch"), "--workers=2", "--servers=1", "--steps=20", "--dim=1000",
                  "--optimizer=onebit-adam", "--lr=2e-3", "--out=" + calm},
                 absl::Seconds(30));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("warning")));
  EXPECT_EQ(Field(ReadFile(calm + "/summary.json"), "diverged"), "false");
}

TEST(Faults, AFinishedRunFolderIsNotOverwritten) {
  const std::string out = TempDir("finished") + "/run";
  const std::vector<std::string> job = {Bin("onebit-launch"), "--workers=1", "--servers=1",
                                        "--dim=256",          "--steps=3",   "--block_size=32",
                                        "--chunk_elems=64",   "--out=" + out};
  RunResult first = RunCommand(job, absl::Seconds(30));
  ASSERT_EQ(first.code, 0) << first.output;
  const std::string summary = ReadFile(out + "/summary.json");
  const std::string metrics = ReadFile(out + "/metrics.csv");
  RunResult again = RunCommand(job, absl::Seconds(30));
  EXPECT_NE(again.code, 0);
  EXPECT_THAT(again.output, HasSubstr(out + "/summary.json is a finished job's (status ok)"));
  EXPECT_EQ(ReadFile(out + "/summary.json"), summary);
  EXPECT_EQ(ReadFile(out + "/metrics.csv"), metrics);
}

// Holds a listening TCP port on 127.0.0.1 for the test's lifetime.
class BusyPort {
 public:
  BusyPort() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    EXPECT_EQ(listen(fd_, 1), 0);
    socklen_t len = sizeof(a);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~BusyPort() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(Faults, PortInUseIsAClearErrorAtStart) {
  BusyPort busy;
  const std::string p = absl::StrCat(busy.port());
  RunResult s = RunCommand({Bin("onebit-server"), SecretFlag(), "--coordinator=127.0.0.1:1",
                            "--bind_host=127.0.0.1", "--data_port=" + p},
                           absl::Seconds(10));
  EXPECT_EQ(s.code, 1) << s.output;
  EXPECT_THAT(s.output, HasSubstr("cannot bind the data port tcp://127.0.0.1:" + p));
  EXPECT_THAT(s.output, HasSubstr("Address already in use"));

  RunResult c =
      RunCommand({Bin("onebit-coordinator"), SecretFlag(), "--bind_host=127.0.0.1", "--port=" + p},
                 absl::Seconds(10));
  EXPECT_EQ(c.code, 1) << c.output;
  EXPECT_THAT(c.output, HasSubstr("cannot listen on 127.0.0.1:" + p));
  RunResult ch = RunCommand({Bin("onebit-coordinator"), SecretFlag(), "--bind_host=127.0.0.1",
                             "--port=0", "--health_port=" + p},
                            absl::Seconds(10));
  EXPECT_EQ(ch.code, 1) << ch.output;
  EXPECT_THAT(ch.output, HasSubstr("cannot listen for health checks on 127.0.0.1:" + p));

  RunResult w = RunCommand({Bin("onebit-worker"), SecretFlag(), "--coordinator=127.0.0.1:1",
                            "--bind_host=127.0.0.1", "--health_port=" + p},
                           absl::Seconds(10));
  EXPECT_EQ(w.code, 1) << w.output;
  EXPECT_THAT(w.output, HasSubstr("cannot listen for health checks on 127.0.0.1:" + p));
}

TEST(Faults, RegistrationTimeoutNamesTheMissing) {
  RunResult r = RunCommand({Bin("onebit-coordinator"), SecretFlag(), "--bind_host=127.0.0.1",
                            "--port=0", "--workers=2", "--servers=1", "--register_timeout=500ms"},
                           absl::Seconds(10));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("still waiting for server 0, worker 0, worker 1"));
}

TEST(Faults, UnreachableCoordinatorIsNamed) {
  RunResult r = RunCommand({Bin("onebit-worker"), SecretFlag(), "--coordinator=127.0.0.1:1",
                            "--bind_host=127.0.0.1", "--register_timeout=500ms"},
                           absl::Seconds(10));
  EXPECT_EQ(r.code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("coordinator at 127.0.0.1:1"));
}

TEST(LaunchFlags, UnknownFlagOrBadValueExitsTwoNamingTheFlag) {
  struct C {
    std::vector<std::string> argv;
    std::string text;
  };
  const std::vector<C> cases = {
      {{Bin("onebit-launch"), "--bogus=1"}, "--bogus: unknown flag"},
      {{Bin("onebit-coordinator"), "--no-such-flag"}, "--no_such_flag: unknown flag"},
      {{Bin("onebit-server"), "--data-port=http"}, "--data_port: invalid value 'http'"},
      {{Bin("onebit-worker"), "--rank", "x"}, "--rank: invalid value 'x'"},
      {{Bin("onebit-launch"), "--workers=0"}, "--workers: must be in [1, 4096]"},
      {{Bin("onebit-launch"), "--dim=-5"}, "--dim: invalid value '-5'"},
      {{Bin("onebit-launch"), "--chunk_elems=100"},
       "--chunk_elems: must be 0 (auto) or a positive multiple"},
      {{Bin("onebit-launch"), "--optimizer=lamb"},
       "--optimizer: invalid value 'lamb': want one of sgd | adam | onebit-adam | "
       "naive-onebit-adam | ef-sgd | zero-one-adam | onebit-lamb"},
      {{Bin("onebit-launch"), "--worker-codec=zip"},
       "--worker_codec: invalid value 'zip': want one of fp32 | fp16 | onebit"},
      {{Bin("onebit-launch"), "--step-timeout=soon"}, "--step_timeout: invalid value 'soon'"},
      {{Bin("onebit-worker")}, "--coordinator: required"},
      {{Bin("onebit-server"), "stray"}, "unexpected argument 'stray'"},
  };
  for (const C& c : cases) {
    RunResult r = RunCommand(c.argv, absl::Seconds(10));
    EXPECT_EQ(r.code, 2) << c.argv[0] << " " << (c.argv.size() > 1 ? c.argv[1] : "") << ": "
                         << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.text));
  }
}

TEST(LaunchFlags, ConfigJsonFileAndCommandLineOverride) {
  const std::string dir = TempDir("json");
  {
    std::ofstream(dir + "/job.json") << R"({"workers": 2, "servers": 1, "dim": 700,
        "steps": 3, "optimizer": "adam", "block-size": 32, "chunk_elems": 64})";
  }
  RunResult r = RunCommand(
      {Bin("onebit-launch"), "--config=" + dir + "/job.json", "--steps=4", "--out=" + dir + "/run"},
      absl::Seconds(30));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string s = ReadFile(dir + "/run/summary.json");
  EXPECT_THAT(s, HasSubstr("\"optimizer\": \"adam\""));
  EXPECT_THAT(s, HasSubstr("\"workers\": 2"));
  EXPECT_THAT(s, HasSubstr("\"params\": 700"));
  EXPECT_THAT(s, HasSubstr("\"steps\": 4"));  // the command line wins
  EXPECT_THAT(s, HasSubstr("\"replicas_equal\": true"));

  { std::ofstream(dir + "/bad.json") << R"({"wokers": 2})"; }
  RunResult b =
      RunCommand({Bin("onebit-launch"), "--config=" + dir + "/bad.json"}, absl::Seconds(10));
  EXPECT_EQ(b.code, 2);
  EXPECT_THAT(b.output, HasSubstr("unknown key 'wokers'"));
}

}  // namespace
}  // namespace onebit::testing
