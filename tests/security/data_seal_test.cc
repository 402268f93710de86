// The sealed data plane's pieces (security/data_seal.h): key agreement,
// sealing and opening, and PLAIN handshakes checked by the ZAP handler.
#include "security/data_seal.h"

#include <openssl/evp.h>

#include <chrono>
#include <cstring>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "security/curve.h"
#include "zmq.hpp"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

using ::testing::HasSubstr;

struct Pair {
  CurveKeys worker = NewCurveKeys(), server = NewCurveKeys();
  PairSecret OfWorker(uint64_t id = 7, uint32_t w = 1, uint32_t s = 2) const {
    return PairSecret::Agree(worker, server.public_key, worker.public_key, server.public_key, id, w,
                             s)
        .value();
  }
  PairSecret OfServer(uint64_t id = 7, uint32_t w = 1, uint32_t s = 2) const {
    return PairSecret::Agree(server, worker.public_key, worker.public_key, server.public_key, id, w,
                             s)
        .value();
  }
};

TEST(PairSecret, BothEndsAgreeAndEveryInputChangesTheKeys) {
  const Pair p;
  const PairSecret w = p.OfWorker(), s = p.OfServer();
  EXPECT_EQ(w.Password(), s.Password());
  EXPECT_EQ(w.Password().size(), 64u);
  EXPECT_EQ(w.ConnectionKey(0), s.ConnectionKey(0));
  EXPECT_EQ(w.ConnectionKey(0).size(), 32u);
  EXPECT_NE(w.ConnectionKey(0), w.ConnectionKey(1));
  EXPECT_NE(absl::BytesToHexString(w.ConnectionKey(0)), w.Password());
  // Another incarnation, rank, shard, or pair: other keys.
  EXPECT_NE(p.OfWorker(8).ConnectionKey(0), w.ConnectionKey(0));
  EXPECT_NE(p.OfWorker(7, 0).ConnectionKey(0), w.ConnectionKey(0));
  EXPECT_NE(p.OfWorker(7, 1, 3).ConnectionKey(0), w.ConnectionKey(0));
  EXPECT_NE(Pair().OfWorker().ConnectionKey(0), w.ConnectionKey(0));
  // A third party's key agrees on nothing with either.
  const CurveKeys outsider = NewCurveKeys();
  auto o = PairSecret::Agree(outsider, p.server.public_key, p.worker.public_key,
                             p.server.public_key, 7, 1, 2);
  ASSERT_TRUE(o.ok());
  EXPECT_NE(o->ConnectionKey(0), w.ConnectionKey(0));
}

TEST(PairSecret, ABadPeerKeyIsRefusedByName) {
  const Pair p;
  auto short_key = PairSecret::Agree(p.worker, "abc", p.worker.public_key, "abc", 1, 0, 0);
  EXPECT_THAT(short_key.status().message(), HasSubstr("3 bytes"));
  const std::string zero(32, '\0');  // the identity point: every secret gives 0
  auto degenerate = PairSecret::Agree(p.worker, zero, p.worker.public_key, zero, 1, 0, 0);
  EXPECT_THAT(degenerate.status().message(), HasSubstr("degenerate"));
}

zmq::message_t Bytes(const std::string& s) { return zmq::message_t(s.data(), s.size()); }

std::string Text(const zmq::message_t& m) { return m.to_string(); }

// AES-256-GCM straight from OpenSSL, to hold the seal to the standard.
std::string ReferenceGcm(const std::string& key, const unsigned char nonce[12],
                         const std::string& aad, const std::string& plain, std::string* tag) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                     reinterpret_cast<const unsigned char*>(key.data()), nonce);
  int len = 0;
  EVP_EncryptUpdate(ctx, nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                    static_cast<int>(aad.size()));
  std::string out(plain.size(), '\0');
  EVP_EncryptUpdate(ctx, reinterpret_cast<unsigned char*>(out.data()), &len,
                    reinterpret_cast<const unsigned char*>(plain.data()),
                    static_cast<int>(plain.size()));
  unsigned char rest[16];
  EVP_EncryptFinal_ex(ctx, rest, &len);
  tag->resize(16);
  EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, 16, tag->data());
  EVP_CIPHER_CTX_free(ctx);
  return out;
}

TEST(ConnectionSeal, IsAes256GcmWithTheDirectionAndCounterAsNonce) {
  const std::string key = Pair().OfWorker().ConnectionKey(0);
  ConnectionSeal worker(key, SealDirection::kToServer);
  const std::string header = "header bytes", plain = "payload of a push, 37 bytes long....";
  zmq::message_t payload = Bytes(plain);
  auto seal = worker.Seal(Bytes(header), &payload);
  ASSERT_TRUE(seal.ok()) << seal.status();
  ASSERT_EQ(seal->size(), kSealBytes);
  uint64_t counter = 0;
  std::memcpy(&counter, seal->data(), 8);  // little-endian on this machine
  unsigned char nonce[12] = {1, 0, 0, 0};  // kToServer
  std::memcpy(nonce + 4, &counter, 8);
  std::string tag;
  EXPECT_EQ(Text(payload), ReferenceGcm(key, nonce, header, plain, &tag));
  EXPECT_EQ(std::string(static_cast<const char*>(seal->data()) + 8, 16), tag);
  EXPECT_NE(Text(payload), plain);
}

TEST(ConnectionSeal, TheOtherEndOpensWhatOneSealsEachWayAndNothingElse) {
  const std::string key = Pair().OfWorker().ConnectionKey(0);
  ConnectionSeal worker(key, SealDirection::kToServer), server(key, SealDirection::kToWorker);
  for (const std::string plain : {std::string(), std::string("x"), std::string(100003, 'q')}) {
    zmq::message_t payload = Bytes(plain);
    auto seal = worker.Seal(Bytes("h1"), &payload);
    ASSERT_TRUE(seal.ok());
    ASSERT_TRUE(server.Open(Bytes("h1"), &payload, *seal).ok());
    EXPECT_EQ(Text(payload), plain);
    zmq::message_t reply = Bytes(plain + "r");
    auto rseal = server.Seal(Bytes("h2"), &reply);
    ASSERT_TRUE(rseal.ok());
    ASSERT_TRUE(worker.Open(Bytes("h2"), &reply, *rseal).ok());
    EXPECT_EQ(Text(reply), plain + "r");
  }
  // A message reflected back to its sender: the direction differs.
  zmq::message_t payload = Bytes("to the server");
  auto seal = worker.Seal(Bytes("h"), &payload);
  ConnectionSeal another_worker(key, SealDirection::kToServer);
  EXPECT_THAT(another_worker.Open(Bytes("h"), &payload, *seal).message(),
              HasSubstr("does not verify"));
}

TEST(ConnectionSeal, AlteredForgedAndReplayedMessagesAreRefusedByName) {
  const std::string key = Pair().OfWorker().ConnectionKey(0);
  ConnectionSeal worker(key, SealDirection::kToServer), server(key, SealDirection::kToWorker);
  auto sealed = [&](const std::string& header, const std::string& plain) {
    zmq::message_t payload = Bytes(plain);
    zmq::message_t seal = *worker.Seal(Bytes(header), &payload);
    return std::make_pair(Text(payload), Text(seal));
  };
  const auto [cipher, seal] = sealed("header", "a payload");
  auto open = [&](const std::string& header, std::string payload, const std::string& s) {
    zmq::message_t p = Bytes(payload);
    return server.Open(Bytes(header), &p, Bytes(s));
  };
  // Another header (e.g. another step or rank), a flipped payload bit, a
  // flipped tag bit, another key, a short seal.
  EXPECT_THAT(open("Header", cipher, seal).message(), HasSubstr("does not verify"));
  std::string flipped = cipher;
  flipped[3] ^= 1;
  EXPECT_THAT(open("header", flipped, seal).message(), HasSubstr("does not verify"));
  std::string bad_tag = seal;
  bad_tag[20] ^= 0x80;
  EXPECT_THAT(open("header", cipher, bad_tag).message(), HasSubstr("does not verify"));
  ConnectionSeal stranger(Pair().OfWorker().ConnectionKey(0), SealDirection::kToWorker);
  zmq::message_t p = Bytes(cipher);
  EXPECT_THAT(stranger.Open(Bytes("header"), &p, Bytes(seal)).message(),
              HasSubstr("does not verify"));
  EXPECT_THAT(open("header", cipher, seal.substr(0, 23)).message(), HasSubstr("23 bytes"));
  EXPECT_EQ(server.last_opened(), 0u);  // none of those counted
  // The genuine one opens once; the same again is a replay, and so is an
  // older one that arrives after a newer.
  const auto [cipher2, seal2] = sealed("header", "the next one");
  ASSERT_TRUE(open("header", cipher2, seal2).ok());
  EXPECT_THAT(open("header", cipher2, seal2).message(), HasSubstr("replayed"));
  EXPECT_THAT(open("header", cipher, seal).message(), HasSubstr("replayed"));
}

// A PLAIN server whose ZAP handler knows some passwords, on loopback.
class Plain : public ::testing::Test {
 protected:
  void SetUp() override {
    auto zap = ZapHandler::Start(&ctx_, "test", absl::Milliseconds(300));
    ASSERT_TRUE(zap.ok()) << zap.status();
    zap_ = *std::move(zap);
    MakePlainServer(&server_);
    server_.set(zmq::sockopt::linger, 0);
    server_.bind("tcp://127.0.0.1:*");
    endpoint_ = server_.get(zmq::sockopt::last_endpoint);
  }
  void TearDown() override { server_.close(); }

  // Sends "hello" with `password` (none: no PLAIN at all); the User-Id the
  // server saw, or nullopt when nothing arrived within 1 s.
  std::optional<std::string> Exchange(const std::optional<std::string>& password) {
    zmq::socket_t c(ctx_, zmq::socket_type::dealer);
    c.set(zmq::sockopt::linger, 0);
    if (password) MakePlainClient(&c, "w", *password);
    c.connect(endpoint_);
    (void)c.send(zmq::str_buffer("hello"), zmq::send_flags::dontwait);
    zmq::pollitem_t item{server_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(1000));
    if (!(item.revents & ZMQ_POLLIN)) return std::nullopt;
    std::vector<zmq::message_t> frames;
    (void)zmq::recv_multipart(server_, std::back_inserter(frames));
    return PeerUserId(frames.back());
  }

  zmq::context_t ctx_{1};
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t server_{ctx_, zmq::socket_type::router};
  std::string endpoint_;
};

TEST_F(Plain, OnlyAllowedPasswordsGetThroughAndACurveKeyIsNoPassword) {
  const Pair p;
  const CurveKeys curve_worker = NewCurveKeys();
  zap_->Allow({{curve_worker.public_key, "worker 3"}});
  zap_->AllowPasswords({{p.OfServer().Password(), "worker 1"}});
  EXPECT_EQ(Exchange(p.OfWorker().Password()), "worker 1");
  EXPECT_EQ(Exchange(Pair().OfWorker().Password()), std::nullopt);
  EXPECT_EQ(Exchange(curve_worker.public_key), std::nullopt);
  EXPECT_EQ(Exchange(std::nullopt), std::nullopt);  // NULL mechanism
  EXPECT_GE(zap_->refused(), 2u);
}

}  // namespace
}  // namespace onebit
