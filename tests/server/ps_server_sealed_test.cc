// A server of a sealed data plane (--data_cipher aes-gcm), through a real
// ROUTER socket: sealed requests are served and answered sealed; an
// unsealed, altered or replayed one is refused by name (the refusal itself
// sealed) and changes nothing.
#include <chrono>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "compress/codec.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "net/data_plane.h"
#include "security/data_seal.h"
#include "server/ps_server.h"
#include "tests/server/request.h"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kJob = 0x5ea1;
constexpr uint64_t kElems = 128;  // one shard, one chunk, blocks of 32

struct Reply {
  data::Header header;
  std::vector<float> values;  // decoded fp32 payload
};

class PsServerSealed : public ::testing::Test {
 protected:
  void SetUp() override {
    router_.bind("inproc://sealed");
    const CurveKeys worker = NewCurveKeys(), server = NewCurveKeys();
    PsServerOptions o;
    o.job.job_id = kJob;
    o.job.workers = 1;
    o.job.steps = 3;
    o.job.map = ShardMap::Create(kElems, 1, 32).value();
    o.job.chunk_elems = kElems;
    o.shard = 0;
    o.optimizer.kind = OptimizerKind::kSgd;  // x - lr g, fp32 both ways
    o.optimizer.lr = 0.5f;
    o.sealed.push_back(PairSecret::Agree(server, worker.public_key, worker.public_key,
                                         server.public_key, kJob, 0, 0)
                           .value());
    const PairSecret mine = PairSecret::Agree(worker, server.public_key, worker.public_key,
                                              server.public_key, kJob, 0, 0)
                                .value();
    seal_ = std::make_unique<ConnectionSeal>(mine.ConnectionKey(0), SealDirection::kToServer);
    auto s = PsServer::Create(o, &router_);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    dealer_.set(zmq::sockopt::routing_id, WorkerIdentity(kJob, 0));
    dealer_.connect("inproc://sealed");
    serving_ = std::thread(
        [this] { EXPECT_TRUE(server_->Serve([this] { return stop_.load(); }, [] {}).ok()); });
  }
  void TearDown() override {
    stop_ = true;
    if (serving_.joinable()) serving_.join();
  }

  // The frames of a request of `kind` at `step` carrying `v`, sealed
  // unless `sealed` is false.
  std::vector<zmq::message_t> Request(data::Kind kind, uint64_t step, const std::vector<float>& v,
                                      bool sealed = true) {
    std::vector<uint8_t> payload(fp32_->EncodedSize(kElems));
    EXPECT_TRUE(fp32_->Encode(v.data(), kElems, payload.data()).ok());
    const std::string header =
        testing::Request(kJob, kind, step, 0, kElems, fp32_->name(), payload.size())
            .SerializeAsString();
    std::vector<zmq::message_t> frames;
    frames.emplace_back(header.data(), header.size());
    frames.emplace_back(payload.data(), payload.size());
    if (sealed) frames.push_back(seal_->Seal(frames[0], &frames[1]).value());
    return frames;
  }
  void Send(std::vector<zmq::message_t>& frames) {
    std::vector<zmq::message_t> copy;
    for (zmq::message_t& f : frames) copy.emplace_back(f.data(), f.size());
    ASSERT_TRUE(zmq::send_multipart(dealer_, copy));
  }
  // The next message, opened with the worker's seal (which must open it).
  Reply Receive() {
    zmq::pollitem_t item{dealer_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(2000));
    Reply r;
    if (!(item.revents & ZMQ_POLLIN)) {
      ADD_FAILURE() << "no reply within 2 s";
      return r;
    }
    std::vector<zmq::message_t> frames;
    EXPECT_TRUE(zmq::recv_multipart(dealer_, std::back_inserter(frames)));
    if (frames.size() != 3) {
      ADD_FAILURE() << frames.size() << " frames: the reply is not sealed";
      return r;
    }
    absl::Status opened = seal_->Open(frames[0], &frames[1], frames[2]);
    EXPECT_TRUE(opened.ok()) << opened;
    r.header = ParseHeader(frames[0].data(), frames[0].size()).value();
    if (r.header.kind() == data::REPLY) {
      r.values.resize(kElems);
      EXPECT_TRUE(
          fp32_->Decode(static_cast<const uint8_t*>(frames[1].data()), kElems, r.values.data())
              .ok());
    }
    return r;
  }

  std::unique_ptr<const Codec> fp32_ = NewCodec("fp32", CodecOptions{32}).value();
  std::unique_ptr<ConnectionSeal> seal_;
  zmq::context_t ctx_{1};
  zmq::socket_t router_{ctx_, zmq::socket_type::router};
  zmq::socket_t dealer_{ctx_, zmq::socket_type::dealer};
  std::unique_ptr<PsServer> server_;
  std::atomic<bool> stop_{false};
  std::thread serving_;
};

TEST_F(PsServerSealed, SealedRequestsAreServedAndEveryOtherIsRefusedByNameChangingNothing) {
  std::vector<float> x(kElems), g(kElems, 2.0f), bad(kElems, 1000.0f);
  for (uint64_t i = 0; i < kElems; ++i) x[i] = static_cast<float>(i);
  auto init = Request(data::INIT, 0, x);
  Send(init);

  // An unsealed push, a sealed push whose payload was altered, and the
  // INIT again (a replay): each refused, each refusal sealed.
  auto plain = Request(data::PUSH, 0, bad, /*sealed=*/false);
  Send(plain);
  Reply r = Receive();
  EXPECT_EQ(r.header.kind(), data::ERROR);
  EXPECT_THAT(r.header.error(), HasSubstr("an unsealed message"));
  auto altered = Request(data::PUSH, 0, bad);
  static_cast<uint8_t*>(altered[1].data())[5] ^= 1;
  Send(altered);
  r = Receive();
  EXPECT_EQ(r.header.kind(), data::ERROR);
  EXPECT_THAT(r.header.error(), HasSubstr("does not verify"));
  Send(init);
  r = Receive();
  EXPECT_EQ(r.header.kind(), data::ERROR);
  EXPECT_THAT(r.header.error(), HasSubstr("replayed"));

  // The genuine push: sgd's reply is the update -0.5 * 2 = -1 (had a
  // refused push of 1000s been taken, it would be -500, and this one a
  // duplicate).
  auto push = Request(data::PUSH, 0, g);
  Send(push);
  r = Receive();
  ASSERT_EQ(r.header.kind(), data::REPLY) << r.header.error();
  ASSERT_EQ(r.values.size(), kElems);
  for (uint64_t i = 0; i < kElems; ++i) EXPECT_EQ(r.values[i], -1.0f) << i;
  // The genuine push again, now a replay: refused.
  Send(push);
  r = Receive();
  EXPECT_EQ(r.header.kind(), data::ERROR);
  EXPECT_THAT(r.header.error(), HasSubstr("replayed"));
}

}  // namespace
}  // namespace onebit
