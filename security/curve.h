// The data plane's protection: ZeroMQ CURVE (encryption and authentication
// of both ends), with a ZAP handler that admits only the clients whose
// public keys the coordinator handed out for this job, and tags each of
// their messages with who they are (the "User-Id" message property), so a
// server can tell which rank really sent a request.
//
// Every process makes its own key pair; public keys travel in the control
// plane (TLS, security/tls.h), secret keys never leave the process.
#ifndef ONEBIT_SECURITY_CURVE_H_
#define ONEBIT_SECURITY_CURVE_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "zmq.hpp"

namespace onebit {

// A CURVE key pair, 32 raw bytes each.
struct CurveKeys {
  std::string public_key;
  std::string secret_key;
};
CurveKeys NewCurveKeys();

// Before bind: `socket` accepts CURVE clients only, as the server of `keys`.
// A ZapHandler must be running in the socket's context first (without one,
// libzmq would admit every client that knows the server's public key).
void MakeCurveServer(zmq::socket_t* socket, const CurveKeys& keys);
// Before connect: `socket` talks only to the server of `server_public_key`,
// and authenticates with `keys`.
void MakeCurveClient(zmq::socket_t* socket, const CurveKeys& keys,
                     const std::string& server_public_key);

// The User-Id the ZAP handler gave the sender of a received message, "" when
// none (not a CURVE socket).
std::string PeerUserId(const zmq::message_t& msg);

// Answers the ZAP requests (RFC 27) of every socket in one context, from its
// own thread, until destroyed: CURVE's by the client's key, PLAIN's by its
// password. A key it does not know yet is not refused at
// once: its handshake waits (up to kZapWait, at most kZapPending at a time)
// for the next Allow(), because a worker may connect before its server has
// heard the cluster's keys. Thread-safe.
inline constexpr absl::Duration kZapWait =
    absl::Seconds(20);  // < a server's handshake timeout (30 s)
inline constexpr size_t kZapPending = 256;

class ZapHandler {
 public:
  // Binds inproc://zeromq.zap.01 in `ctx` (one handler per context; must
  // outlive the sockets that use it, and `ctx` must outlive this). `who`
  // names the process in its log lines ("server 1").
  // `wait`: how long an unknown key's handshake waits for Allow().
  static absl::StatusOr<std::unique_ptr<ZapHandler>> Start(zmq::context_t* ctx, std::string who,
                                                           absl::Duration wait = kZapWait);
  ~ZapHandler();

  // The CURVE clients admitted from now on: public key -> their User-Id.
  // Until the first call, none.
  void Allow(std::map<std::string, std::string> clients);
  // The PLAIN clients admitted from now on (a sealed data plane,
  // security/data_seal.h): password -> their User-Id. Until the first call,
  // none. A CURVE key is never taken as a password, nor the reverse.
  void AllowPasswords(std::map<std::string, std::string> passwords);

  // Handshakes refused so far.
  uint64_t refused() const { return refused_.load(); }

 private:
  struct Pending {
    std::vector<zmq::message_t> envelope;  // the requester's routing id, "", version, request id
    bool plain = false;                    // PLAIN's password, else CURVE's key
    std::string key;
    absl::Time until;
  };

  ZapHandler(zmq::context_t* ctx, std::string who, absl::Duration wait);
  void Loop();
  // Answers `p`: admitted as `user_id`, or refused when it is null.
  void Answer(Pending& p, const std::string* user_id);
  // Answers the pending requests whose key is now known or whose wait is over.
  void AnswerPending(absl::Time now);

  zmq::socket_t socket_;
  const std::string who_;
  const absl::Duration wait_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> refused_{0};
  absl::Mutex mu_;
  std::map<std::string, std::string> clients_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::string> passwords_ ABSL_GUARDED_BY(mu_);
  std::vector<Pending> pending_;  // the loop's own
  std::thread thread_;
};

}  // namespace onebit

#endif  // ONEBIT_SECURITY_CURVE_H_
