// PsServer's two chunk grids (net/data_plane.h: the warm-up's, and the
// compressed steps' own), through a real ROUTER socket: pushes of a
// compressed step 0 that arrive before rank 0's INIT are held, and each
// chunk is answered exactly once all of x under it has arrived, whether the
// compressed grid is finer than the warm-up's or coarser.
#include <atomic>
#include <chrono>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "compress/codec.h"
#include "gtest/gtest.h"
#include "net/data_plane.h"
#include "server/ps_server.h"
#include "tests/server/request.h"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

constexpr uint64_t kJob = 0x5151;
constexpr uint64_t kElems = 256;  // one shard, blocks of 32
constexpr uint64_t kSlice = 128;  // the warm-up grid: INITs of [0, 128), [128, 256)

class PsServerGrid : public ::testing::TestWithParam<uint64_t> {
 protected:
  void SetUp() override {
    router_.bind("inproc://grid");
    PsServerOptions o;
    o.job.job_id = kJob;
    o.job.workers = 1;
    o.job.steps = 1;
    o.job.map = ShardMap::Create(kElems, 1, 32).value();
    o.job.chunk_elems = kSlice;
    o.job.compressed_chunk_elems = GetParam();
    o.shard = 0;
    // 1-bit pushes from step 0: the first step is a compressed one.
    o.optimizer.kind = OptimizerKind::kEfSgd;
    o.optimizer.worker_codec = "onebit";
    o.optimizer.server_codec = "onebit";
    o.optimizer.lr = 0.1f;
    auto s = PsServer::Create(o, &router_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    dealer_.set(zmq::sockopt::routing_id, WorkerIdentity(kJob, 0));
    dealer_.connect("inproc://grid");
    serving_ = std::thread(
        [this] { EXPECT_TRUE(server_->Serve([this] { return stop_.load(); }, [] {}).ok()); });
  }
  void TearDown() override {
    stop_ = true;
    if (serving_.joinable()) serving_.join();
  }

  void Send(data::Kind kind, uint64_t begin, uint64_t count, const Codec& codec,
            const std::vector<float>& values) {
    std::vector<uint8_t> payload(codec.EncodedSize(count));
    ASSERT_TRUE(codec.Encode(values.data() + begin, count, payload.data()).ok());
    const std::string header =
        testing::Request(kJob, kind, 0, begin, count, codec.name(), payload.size())
            .SerializeAsString();
    dealer_.send(zmq::buffer(header), zmq::send_flags::sndmore);
    dealer_.send(zmq::buffer(payload), zmq::send_flags::none);
  }
  // The begins of the REPLYs that come within `wait`; fails on anything else.
  std::set<uint64_t> Replies(std::chrono::milliseconds wait) {
    std::set<uint64_t> begins;
    zmq::pollitem_t item{dealer_.handle(), 0, ZMQ_POLLIN, 0};
    while (zmq::poll(&item, 1, wait) == 1) {
      std::vector<zmq::message_t> frames;
      EXPECT_TRUE(zmq::recv_multipart(dealer_, std::back_inserter(frames)));
      const data::Header h = ParseHeader(frames[0].data(), frames[0].size()).value();
      EXPECT_EQ(h.kind(), data::REPLY) << h.error();
      EXPECT_TRUE(begins.insert(h.begin()).second) << "two replies for " << h.begin();
    }
    return begins;
  }

  zmq::context_t ctx_{1};
  zmq::socket_t router_{ctx_, zmq::socket_type::router};
  zmq::socket_t dealer_{ctx_, zmq::socket_type::dealer};
  std::unique_ptr<PsServer> server_;
  std::atomic<bool> stop_{false};
  std::thread serving_;
};

TEST_P(PsServerGrid, PushesBeforeTheInitAreAnsweredOnceTheirXHasCome) {
  const uint64_t chunk = GetParam();
  auto onebit = NewCodec("onebit", CodecOptions{32}).value();
  auto fp32 = NewCodec("fp32", CodecOptions{32}).value();
  std::vector<float> x(kElems), g(kElems);
  for (uint64_t i = 0; i < kElems; ++i) {
    x[i] = 0.01f * static_cast<float>(i);
    g[i] = (i % 3 == 0 ? -1.0f : 1.0f) * (1.0f + 0.001f * static_cast<float>(i));
  }
  for (uint64_t b = 0; b < kElems; b += chunk) Send(data::PUSH, b, chunk, *onebit, g);
  EXPECT_TRUE(Replies(std::chrono::milliseconds(300)).empty()) << "answered before any x came";

  Send(data::INIT, 0, kSlice, *fp32, x);
  std::set<uint64_t> first = Replies(std::chrono::milliseconds(500));
  Send(data::INIT, kSlice, kSlice, *fp32, x);
  std::set<uint64_t> second = Replies(std::chrono::milliseconds(2000));
  if (chunk < kSlice) {
    // Finer: the chunks under the first slice go with its INIT, every one.
    EXPECT_EQ(first, (std::set<uint64_t>{0, 64}));
    EXPECT_EQ(second, (std::set<uint64_t>{128, 192}));
  } else {
    // One chunk over both slices: only once both have come.
    EXPECT_TRUE(first.empty());
    EXPECT_EQ(second, (std::set<uint64_t>{0}));
  }
}

INSTANTIATE_TEST_SUITE_P(Grids, PsServerGrid, ::testing::Values(uint64_t{64}, uint64_t{256}),
                         [](const ::testing::TestParamInfo<uint64_t>& i) {
                           return i.param < kSlice ? "Finer" : "Coarser";
                         });

}  // namespace
}  // namespace onebit
