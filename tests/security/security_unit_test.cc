#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "security/curve.h"
#include "security/job_secret.h"
#include "security/tls.h"
#include "tests/common/scratch.h"
#include "zmq.hpp"
#include "zmq_addon.hpp"

namespace onebit {
namespace {

using ::testing::HasSubstr;

// A file in a folder of its own, which goes with the test.
std::string Scratch(const std::string& name) { return ScratchDir("onebit-sec", name) + "/file"; }

TEST(JobSecret, WrittenOwnerOnlyAndReadBackTheSame) {
  const std::string path = Scratch("secret");
  const JobSecret s = JobSecret::Generate();
  EXPECT_EQ(s.text().size(), 64u);
  ASSERT_TRUE(s.WriteFile(path).ok());
  struct stat st;
  ASSERT_EQ(stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  auto back = JobSecret::ReadFile(path);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->text(), s.text());  // the newline written after it is not part of it
  EXPECT_NE(JobSecret::Generate().text(), s.text());
}

TEST(JobSecret, BadFilesAreNamed) {
  auto missing = JobSecret::ReadFile("/nonexistent/secret");
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/secret: cannot read it"));
  const std::string path = Scratch("short");
  std::ofstream(path) << "  too short  \n";
  auto short_one = JobSecret::ReadFile(path);
  EXPECT_THAT(short_one.status().message(), HasSubstr("holds 9 bytes"));
}

TEST(JobSecret, DerivedKeysDependOnTheSecretAndThePurpose) {
  const std::string path = Scratch("derive");
  std::ofstream(path) << std::string(64, 'a') << "\n";
  auto a = JobSecret::ReadFile(path);
  ASSERT_TRUE(a.ok());
  std::ofstream(path) << std::string(63, 'a') << "b\n";
  auto b = JobSecret::ReadFile(path);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(a->Derive("x").size(), 32u);
  EXPECT_EQ(a->Derive("x"), a->Derive("x"));
  EXPECT_NE(a->Derive("x"), a->Derive("y"));
  EXPECT_NE(a->Derive("x"), b->Derive("x"));
  // HMAC-SHA256("aaa...a" (64), "x"), computed independently (Python's hmac).
  EXPECT_EQ(a->Derive("x").substr(0, 4), std::string("\xb6\x5c\xa3\xa3", 4));
}

TEST(ResolveSecurity, ExactlyOneOfASecretAndInsecure) {
  unsetenv(kSecretFileEnv);
  auto none = ResolveSecurity("", false, "--secret_file");
  EXPECT_THAT(none.status().message(), HasSubstr("no job secret: give --secret_file"));
  auto insecure = ResolveSecurity("", true, "--secret_file");
  ASSERT_TRUE(insecure.ok());
  EXPECT_TRUE(insecure->insecure());
  const std::string path = Scratch("resolve");
  ASSERT_TRUE(JobSecret::Generate().WriteFile(path).ok());
  EXPECT_THAT(ResolveSecurity(path, true, "--secret_file").status().message(),
              HasSubstr("both given"));
  setenv(kSecretFileEnv, path.c_str(), 1);
  auto from_env = ResolveSecurity("", false, "--secret_file");
  ASSERT_TRUE(from_env.ok());
  EXPECT_EQ(from_env->secret_file, path);
  // An explicit --insecure wins over the environment's secret.
  EXPECT_TRUE(ResolveSecurity("", true, "--secret_file")->insecure());
  unsetenv(kSecretFileEnv);
}

TEST(SameBytes, ComparesWholeStrings) {
  EXPECT_TRUE(SameBytes("abc", "abc"));
  EXPECT_FALSE(SameBytes("abc", "abd"));
  EXPECT_FALSE(SameBytes("abc", "ab"));
  EXPECT_TRUE(SameBytes("", ""));
}

TEST(ControlCertificate, EveryProcessDerivesTheSameAndAnotherSecretAnother) {
  const JobSecret s = JobSecret::Generate();
  const ControlCertificate a = ControlCertificateOf(s), b = ControlCertificateOf(s);
  EXPECT_EQ(a.cert_pem, b.cert_pem);
  EXPECT_EQ(a.key_pem, b.key_pem);
  EXPECT_THAT(a.cert_pem, HasSubstr("-----BEGIN CERTIFICATE-----"));
  EXPECT_NE(ControlCertificateOf(JobSecret::Generate()).cert_pem, a.cert_pem);
}

// A CURVE server with a ZAP handler on loopback, and clients.
class Curve : public ::testing::Test {
 protected:
  void SetUp() override {
    auto zap = ZapHandler::Start(&ctx_, "test", absl::Milliseconds(300));
    ASSERT_TRUE(zap.ok()) << zap.status();
    zap_ = *std::move(zap);
    MakeCurveServer(&server_, server_keys_);
    server_.set(zmq::sockopt::linger, 0);
    server_.bind("tcp://127.0.0.1:*");
    endpoint_ = server_.get(zmq::sockopt::last_endpoint);
  }
  void TearDown() override { server_.close(); }

  // Sends "hello" from a client with `keys`; the User-Id the server saw, or
  // nullopt when nothing arrived within 1 s.
  std::optional<std::string> Exchange(const CurveKeys& keys, const std::string& server_key) {
    zmq::socket_t c(ctx_, zmq::socket_type::dealer);
    c.set(zmq::sockopt::linger, 0);
    MakeCurveClient(&c, keys, server_key);
    c.connect(endpoint_);
    (void)c.send(zmq::str_buffer("hello"), zmq::send_flags::dontwait);
    zmq::pollitem_t item{server_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(1000));
    if (!(item.revents & ZMQ_POLLIN)) return std::nullopt;
    std::vector<zmq::message_t> frames;
    (void)zmq::recv_multipart(server_, std::back_inserter(frames));
    EXPECT_EQ(frames.size(), 2u);
    EXPECT_EQ(frames.back().to_string(), "hello");
    return PeerUserId(frames.back());
  }

  zmq::context_t ctx_{1};
  std::unique_ptr<ZapHandler> zap_;
  CurveKeys server_keys_ = NewCurveKeys();
  zmq::socket_t server_{ctx_, zmq::socket_type::router};
  std::string endpoint_;
};

TEST_F(Curve, OnlyAllowedKeysGetThroughEachNamedAsGiven) {
  const CurveKeys w0 = NewCurveKeys(), w1 = NewCurveKeys(), outsider = NewCurveKeys();
  zap_->Allow({{w0.public_key, "worker 0"}, {w1.public_key, "worker 1"}});
  EXPECT_EQ(Exchange(w0, server_keys_.public_key), "worker 0");
  EXPECT_EQ(Exchange(w1, server_keys_.public_key), "worker 1");
  EXPECT_EQ(Exchange(outsider, server_keys_.public_key), std::nullopt);
  // A client that expects another server's key never talks to this one.
  EXPECT_EQ(Exchange(w0, NewCurveKeys().public_key), std::nullopt);
  EXPECT_EQ(zap_->refused(), 1u);  // the outsider, once its wait was over
}

// A worker may connect before its server has heard the cluster's keys: its
// handshake waits for them rather than failing for good.
TEST_F(Curve, AKeyAllowedWhileItsHandshakeWaitsGetsThrough) {
  const CurveKeys w0 = NewCurveKeys();
  zmq::socket_t c(ctx_, zmq::socket_type::dealer);
  c.set(zmq::sockopt::linger, 0);
  MakeCurveClient(&c, w0, server_keys_.public_key);
  c.connect(endpoint_);
  (void)c.send(zmq::str_buffer("early"), zmq::send_flags::dontwait);
  absl::SleepFor(absl::Milliseconds(100));
  zap_->Allow({{w0.public_key, "worker 0"}});
  zmq::pollitem_t item{server_.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(2000));
  ASSERT_TRUE(item.revents & ZMQ_POLLIN);
  std::vector<zmq::message_t> frames;
  (void)zmq::recv_multipart(server_, std::back_inserter(frames));
  EXPECT_EQ(frames.back().to_string(), "early");
  EXPECT_EQ(PeerUserId(frames.back()), "worker 0");
  EXPECT_EQ(zap_->refused(), 0u);
}

TEST_F(Curve, AClientWithoutCurveGetsNothingThrough) {
  zap_->Allow({});
  zmq::socket_t c(ctx_, zmq::socket_type::dealer);
  c.set(zmq::sockopt::linger, 0);
  c.connect(endpoint_);
  (void)c.send(zmq::str_buffer("hello"), zmq::send_flags::dontwait);
  zmq::pollitem_t item{server_.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(500));
  EXPECT_FALSE(item.revents & ZMQ_POLLIN);
}

}  // namespace
}  // namespace onebit
