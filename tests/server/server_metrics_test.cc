// PsServer's metrics (server/server_metrics.h) from real messages over an
// inproc socket: bytes taken and replied by phase as the bytes on the wire,
// refusals by reason, steps and update times.
#include "server/server_metrics.h"

#include <atomic>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "metrics/endpoint.h"
#include "net/data_plane.h"
#include "prometheus/metric_family.h"
#include "server/ps_server.h"
#include "tests/server/request.h"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

constexpr uint64_t kJob = 0x1234;

// The value of series `name` whose labels include `labels` (a histogram:
// its sample count); -1 when there is none.
double Value(MetricsEndpoint& e, const std::string& name,
             const std::map<std::string, std::string>& labels = {}) {
  for (const prometheus::MetricFamily& f : e.registry().Collect()) {
    if (f.name != name) continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      bool all = true;
      for (const auto& [k, v] : labels) {
        bool has = false;
        for (const prometheus::ClientMetric::Label& l : m.label) has |= l.name == k && l.value == v;
        all &= has;
      }
      if (!all) continue;
      if (f.type == prometheus::MetricType::Counter) return m.counter.value;
      if (f.type == prometheus::MetricType::Gauge) return m.gauge.value;
      if (f.type == prometheus::MetricType::Histogram) {
        return static_cast<double>(m.histogram.sample_count);
      }
    }
  }
  return -1;
}

class ServerMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = MetricsEndpoint::Start("127.0.0.1", 0, {{"role", "server"}});
    ASSERT_TRUE(e.ok()) << e.status();
    endpoint_ = *std::move(e);
    metrics_ = std::make_unique<ServerMetrics>(endpoint_.get(), 0);
    router_.bind("inproc://server");
    PsServerOptions o;
    o.job.job_id = kJob;
    o.job.workers = 1;
    o.job.steps = 2;
    o.job.map = ShardMap::Create(kElems, 1, 32).value();
    o.job.chunk_elems = kElems;
    o.shard = 0;
    o.optimizer.kind = OptimizerKind::kSgd;  // fp32 pushes and replies
    o.metrics = metrics_.get();
    auto s = PsServer::Create(o, &router_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    dealer_.set(zmq::sockopt::routing_id, WorkerIdentity(kJob, 0));
    dealer_.connect("inproc://server");
    serving_ = std::thread(
        [this] { ASSERT_TRUE(server_->Serve([this] { return stop_.load(); }, [] {}).ok()); });
  }
  void TearDown() override {
    stop_ = true;
    if (serving_.joinable()) serving_.join();
  }

  data::Header Request(data::Kind kind, uint64_t step, const std::string& codec, size_t bytes) {
    return testing::Request(kJob, kind, step, 0, kElems, codec, bytes);
  }
  // Sends header and payload; returns the bytes sent.
  size_t Send(const std::string& header, const std::vector<uint8_t>& payload) {
    dealer_.send(zmq::buffer(header), zmq::send_flags::sndmore);
    dealer_.send(zmq::buffer(payload), zmq::send_flags::none);
    return header.size() + payload.size();
  }
  // The next message's header and its bytes (header and payload).
  data::Header Receive(size_t* bytes) {
    std::vector<zmq::message_t> frames;
    zmq::pollitem_t item{dealer_.handle(), 0, ZMQ_POLLIN, 0};
    EXPECT_EQ(zmq::poll(&item, 1, std::chrono::seconds(10)), 1);
    EXPECT_TRUE(zmq::recv_multipart(dealer_, std::back_inserter(frames)));
    *bytes = 0;
    for (const zmq::message_t& f : frames) *bytes += f.size();
    return ParseHeader(frames[0].data(), frames[0].size()).value();
  }
  // Waits until the server has counted what it was sent (it runs on its
  // own thread).
  void WaitFor(const std::string& name, const std::map<std::string, std::string>& labels,
               double want) {
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (Value(*endpoint_, name, labels) != want && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    EXPECT_EQ(Value(*endpoint_, name, labels), want) << name;
  }

  static constexpr uint64_t kElems = 64;
  zmq::context_t ctx_{1};
  zmq::socket_t router_{ctx_, zmq::socket_type::router};
  zmq::socket_t dealer_{ctx_, zmq::socket_type::dealer};
  std::unique_ptr<MetricsEndpoint> endpoint_;
  std::unique_ptr<ServerMetrics> metrics_;
  std::unique_ptr<PsServer> server_;
  std::atomic<bool> stop_{false};
  std::thread serving_;
};

TEST_F(ServerMetricsTest, CountsTheBytesOnTheWireAndEachRefusalByItsReason) {
  const std::vector<uint8_t> fp32(kElems * 4, 0);
  size_t got = 0;
  // Refused: a header that does not parse, another job's id, a step the
  // shard is not at; each answered with an ERROR.
  Send("not a header", fp32);
  EXPECT_EQ(Receive(&got).kind(), data::ERROR);
  data::Header other = Request(data::PUSH, 0, "fp32", fp32.size());
  other.set_job_id(kJob + 1);
  Send(other.SerializeAsString(), fp32);
  EXPECT_EQ(Receive(&got).kind(), data::ERROR);
  // Neither is a request of this job's worker: no connection counted. The
  // next one is (of a step the shard is not at, but the worker's own).
  EXPECT_EQ(Value(*endpoint_, "onebit_server_data_connections"), 0);
  Send(Request(data::PUSH, 1, "fp32", fp32.size()).SerializeAsString(), fp32);
  EXPECT_EQ(Receive(&got).kind(), data::ERROR);
  WaitFor("onebit_server_refused_requests_total", {{"reason", "wrong_step"}}, 1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_refused_requests_total", {{"reason", "malformed"}}),
            1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_refused_requests_total", {{"reason", "wrong_job"}}),
            1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_refused_requests_total", {{"reason", "duplicate"}}),
            0);
  // Nothing taken yet.
  EXPECT_EQ(Value(*endpoint_, "onebit_server_received_bytes_total", {{"phase", "warmup"}}), 0);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_steps"), 0);

  // Step 0: INIT (not a push: not counted), then the push, and its reply.
  Send(Request(data::INIT, 0, "fp32", fp32.size()).SerializeAsString(), fp32);
  const size_t pushed = Send(Request(data::PUSH, 0, "fp32", fp32.size()).SerializeAsString(), fp32);
  size_t replied = 0;
  const data::Header reply = Receive(&replied);
  ASSERT_EQ(reply.kind(), data::REPLY) << reply.error();
  WaitFor("onebit_server_steps", {}, 1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_received_bytes_total", {{"phase", "warmup"}}),
            static_cast<double>(pushed));
  EXPECT_EQ(Value(*endpoint_, "onebit_server_sent_bytes_total", {{"phase", "warmup"}}),
            static_cast<double>(replied));
  EXPECT_EQ(Value(*endpoint_, "onebit_server_received_bytes_total", {{"phase", "compress"}}), 0);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_apply_seconds", {{"shard", "0"}}), 1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_step_seconds"), 1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_pending_pushes"), 0);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_data_connections"), 1);  // the one dealer

  // The same push again is of a step the shard has done.
  Send(Request(data::PUSH, 0, "fp32", fp32.size()).SerializeAsString(), fp32);
  EXPECT_EQ(Receive(&got).kind(), data::ERROR);
  WaitFor("onebit_server_refused_requests_total", {{"reason", "wrong_step"}}, 2);
  // A corrupt fp32 payload (a NaN) does not decode.
  std::vector<uint8_t> nan = fp32;
  const float bad = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(nan.data(), &bad, sizeof(bad));
  Send(Request(data::PUSH, 1, "fp32", nan.size()).SerializeAsString(), nan);
  EXPECT_EQ(Receive(&got).kind(), data::ERROR);
  WaitFor("onebit_server_refused_requests_total", {{"reason", "bad_payload"}}, 1);
  EXPECT_EQ(Value(*endpoint_, "onebit_server_steps"), 1);
}

TEST(ServerMetrics, AdvancesTheHandshakeRefusalsToTheHandlersCountNeverBack) {
  auto e = MetricsEndpoint::Start("127.0.0.1", 0, {{"role", "server"}});
  ASSERT_TRUE(e.ok()) << e.status();
  ServerMetrics m(e->get(), 3);
  m.SetHandshakesRefused(4);
  m.SetHandshakesRefused(2);
  EXPECT_EQ(Value(**e, "onebit_server_refused_requests_total",
                  {{"reason", "handshake"}, {"shard", "3"}, {"role", "server"}}),
            4);
  m.checkpoints().Written(true, 1000, 0.5);
  m.checkpoints().Written(false, 0, 0);
  EXPECT_EQ(Value(**e, "onebit_server_checkpoint_written_bytes_total"), 1000);
  EXPECT_EQ(Value(**e, "onebit_server_checkpoint_writes_total"), 1);
  EXPECT_EQ(Value(**e, "onebit_server_checkpoint_errors_total"), 1);
  EXPECT_EQ(Value(**e, "onebit_server_checkpoint_write_seconds"), 1);
}

}  // namespace
}  // namespace onebit
