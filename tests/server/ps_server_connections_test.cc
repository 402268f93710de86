// A worker's several data connections to one server (--data_connections),
// through a real ROUTER socket: each connection's routing id is admitted,
// the reply to chunk i comes back on connection i mod C whichever connection
// pushed it, and a connection beyond the job's count is refused by name.
#include <atomic>
#include <chrono>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "compress/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "net/data_plane.h"
#include "server/ps_server.h"
#include "tests/server/request.h"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

constexpr uint64_t kJob = 0x7c7c;
constexpr uint64_t kElems = 256;  // one shard, blocks of 32
constexpr uint64_t kChunk = 64;   // four chunks
constexpr uint32_t kConnections = 3;

class PsServerConnections : public ::testing::Test {
 protected:
  void SetUp() override {
    router_.bind("inproc://connections");
    PsServerOptions o;
    o.job.job_id = kJob;
    o.job.workers = 1;
    o.job.steps = 1;
    o.job.map = ShardMap::Create(kElems, 1, 32).value();
    o.job.chunk_elems = kChunk;
    o.job.connections = kConnections;
    o.shard = 0;
    o.optimizer.kind = OptimizerKind::kSgd;  // fp32 pushes and replies
    o.optimizer.lr = 0.5f;
    auto s = PsServer::Create(o, &router_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    for (uint32_t c = 0; c <= kConnections; ++c) {
      dealers_.emplace_back(ctx_, zmq::socket_type::dealer);
      dealers_.back().set(zmq::sockopt::routing_id, WorkerIdentity(kJob, 0, c));
      dealers_.back().connect("inproc://connections");
    }
    serving_ = std::thread(
        [this] { EXPECT_TRUE(server_->Serve([this] { return stop_.load(); }, [] {}).ok()); });
  }
  void TearDown() override {
    stop_ = true;
    if (serving_.joinable()) serving_.join();
  }

  void Send(uint32_t connection, data::Kind kind, uint64_t begin, const std::vector<float>& v) {
    std::vector<uint8_t> payload(fp32_->EncodedSize(kChunk));
    ASSERT_TRUE(fp32_->Encode(v.data() + begin, kChunk, payload.data()).ok());
    const std::string header =
        testing::Request(kJob, kind, 0, begin, kChunk, fp32_->name(), payload.size())
            .SerializeAsString();
    dealers_[connection].send(zmq::buffer(header), zmq::send_flags::sndmore);
    dealers_[connection].send(zmq::buffer(payload), zmq::send_flags::none);
  }
  // What each connection receives within `wait`: its headers.
  std::map<uint32_t, std::vector<data::Header>> Receive(std::chrono::milliseconds wait) {
    std::map<uint32_t, std::vector<data::Header>> got;
    std::vector<zmq::pollitem_t> items;
    for (zmq::socket_t& d : dealers_) items.push_back({d.handle(), 0, ZMQ_POLLIN, 0});
    while (zmq::poll(items.data(), items.size(), wait) > 0) {
      for (uint32_t c = 0; c < items.size(); ++c) {
        if (!(items[c].revents & ZMQ_POLLIN)) continue;
        std::vector<zmq::message_t> frames;
        EXPECT_TRUE(zmq::recv_multipart(dealers_[c], std::back_inserter(frames)));
        got[c].push_back(ParseHeader(frames[0].data(), frames[0].size()).value());
      }
    }
    return got;
  }

  std::unique_ptr<const Codec> fp32_ = NewCodec("fp32", CodecOptions{32}).value();
  zmq::context_t ctx_{1};
  zmq::socket_t router_{ctx_, zmq::socket_type::router};
  std::vector<zmq::socket_t> dealers_;  // connections 0..kConnections (the last one too many)
  std::unique_ptr<PsServer> server_;
  std::atomic<bool> stop_{false};
  std::thread serving_;
};

TEST_F(PsServerConnections, EachChunksReplyComesBackOnItsOwnConnection) {
  std::vector<float> x(kElems), g(kElems);
  for (uint64_t i = 0; i < kElems; ++i) {
    x[i] = 0.25f * static_cast<float>(i);
    g[i] = 1.0f + static_cast<float>(i % 7);
  }
  // The INIT and the pushes each on a connection other than the chunk's own:
  // any of the worker's connections is taken, the replies still spread.
  for (uint64_t i = 0; i < kElems / kChunk; ++i) {
    Send(static_cast<uint32_t>((i + 1) % kConnections), data::INIT, i * kChunk, x);
  }
  for (uint64_t i = 0; i < kElems / kChunk; ++i) {
    Send(static_cast<uint32_t>((i + 2) % kConnections), data::PUSH, i * kChunk, g);
  }
  auto got = Receive(std::chrono::milliseconds(1500));
  std::map<uint32_t, std::vector<uint64_t>> begins;
  for (const auto& [c, headers] : got) {
    for (const data::Header& h : headers) {
      EXPECT_EQ(h.kind(), data::REPLY) << "connection " << c << ": " << h.error();
      begins[c].push_back(h.begin());
    }
  }
  // Chunks 0 and 3 on connection 0, 1 on 1, 2 on 2; none on the extra one.
  EXPECT_EQ(begins[0], (std::vector<uint64_t>{0, 3 * kChunk}));
  EXPECT_EQ(begins[1], (std::vector<uint64_t>{kChunk}));
  EXPECT_EQ(begins[2], (std::vector<uint64_t>{2 * kChunk}));
  EXPECT_TRUE(begins[kConnections].empty());
}

TEST_F(PsServerConnections, AConnectionBeyondTheJobsCountIsRefused) {
  std::vector<float> x(kElems, 1.0f);
  Send(kConnections, data::INIT, 0, x);
  auto got = Receive(std::chrono::milliseconds(1000));
  ASSERT_EQ(got[kConnections].size(), 1u);
  const data::Header& h = got[kConnections][0];
  EXPECT_EQ(h.kind(), data::ERROR);
  EXPECT_THAT(h.error(), ::testing::HasSubstr("claimed by a socket that is not that worker's"));
}

}  // namespace
}  // namespace onebit
