// The data plane's faster protection (--data_cipher aes-gcm): each message's
// payload encrypted, and its header authenticated, with AES-256-GCM under a
// key per connection, in the sending thread. CURVE (security/curve.h)
// encrypts with XSalsa20-Poly1305 at about 1.3 GB/s a core; AES-GCM runs
// 4+ GB/s where the CPU has AES-NI, which is what keeps a secured fp32
// warm-up near plaintext at 10 Gbit/s.
//
// The keys come from the CURVE key pairs the processes already exchange
// over TLS (no new distribution): an X25519 agreement between a worker's
// secret key and a server's public key (or the reverse), hashed with both
// public keys and the incarnation's data-plane id. The ZeroMQ connection
// itself uses the PLAIN mechanism with a password from the same pair key,
// which the server's ZAP handler checks (a peer without it is refused at its
// handshake and can queue nothing); then each message must carry a valid
// tag under its connection's key and a counter higher than the last one
// that connection opened, so a forged, altered or replayed message is
// refused. Unlike CURVE, an eavesdropper on the path sees the PLAIN
// password and can open connections that pass the handshake; every
// message it sends is still refused (it holds no key).
//
// Wire form of a sealed message: the frames [header][payload][seal], where
// the payload is ciphertext of the same length and the seal 24 bytes: the
// counter (8, little-endian) and the GCM tag (16). The nonce is the
// direction (4 bytes) and the counter, so the two directions of one key
// never share one; counters come from one per-process sequence, and a
// process's keys are its own (made at its start, mixed with the
// incarnation), so no nonce repeats under a key.
#ifndef ONEBIT_SECURITY_DATA_SEAL_H_
#define ONEBIT_SECURITY_DATA_SEAL_H_

#include <array>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "security/curve.h"
#include "zmq.hpp"

namespace onebit {

// The secret a worker and a server share in one incarnation. Immutable.
class PairSecret {
 public:
  // From this process's `mine` and the other's public key. `worker_public`
  // and `server_public` are the pair's public keys (one of them mine's);
  // `data_plane_id` the incarnation's (net/data_plane.h). Error: a peer key
  // that is not 32 bytes, or one of X25519's degenerate points.
  static absl::StatusOr<PairSecret> Agree(const CurveKeys& mine, const std::string& peer_public,
                                          const std::string& worker_public,
                                          const std::string& server_public, uint64_t data_plane_id,
                                          uint32_t worker, uint32_t server);

  // The PLAIN password the worker presents to the server (64 hex digits).
  std::string Password() const;
  // The AES-256 key (32 bytes) of the pair's connection `connection`.
  std::string ConnectionKey(uint32_t connection) const;

 private:
  explicit PairSecret(std::string key) : key_(std::move(key)) {}
  std::string key_;  // 32 bytes
};

// ZeroMQ PLAIN, as used under a sealed data plane (before bind / connect).
// The server's ZAP handler must be running (ZapHandler::AllowPasswords).
void MakePlainServer(zmq::socket_t* socket);
void MakePlainClient(zmq::socket_t* socket, const std::string& user, const std::string& password);

// Which way a connection's messages go; the nonce's first word.
enum class SealDirection : uint32_t { kToServer = 1, kToWorker = 2 };

// The seal frame's size: counter and tag.
inline constexpr size_t kSealBytes = 24;

// One connection's sealing of what it sends and opening of what it
// receives. Not thread-safe: one per connection, used by the thread that
// sends and receives on it (ZeroMQ's sockets are single-threaded anyway).
class ConnectionSeal {
 public:
  // `key`: ConnectionKey's 32 bytes; `outgoing`: the way this end sends.
  ConnectionSeal(const std::string& key, SealDirection outgoing);
  ~ConnectionSeal();
  ConnectionSeal(const ConnectionSeal&) = delete;
  ConnectionSeal& operator=(const ConnectionSeal&) = delete;

  // Replaces `*payload` with its ciphertext (a new message: a payload
  // shared with other messages stays as it was) and returns the seal frame
  // that authenticates it and `header`. Error: only OpenSSL's own failure.
  absl::StatusOr<zmq::message_t> Seal(const zmq::message_t& header, zmq::message_t* payload);

  // Checks `seal` against `header` and `*payload` and decrypts the payload
  // in place. All or nothing: on error the payload is not to be used and
  // nothing here changed. Errors name the problem: a seal of the wrong
  // size, a counter not above the last one opened (a replay), a tag that
  // does not verify (forged, altered, or another key's).
  absl::Status Open(const zmq::message_t& header, zmq::message_t* payload,
                    const zmq::message_t& seal);

  // The counter of the last message opened (0: none).
  uint64_t last_opened() const { return last_opened_; }

 private:
  void* enc_;  // EVP_CIPHER_CTX*, keyed once
  void* dec_;
  const SealDirection outgoing_;
  uint64_t last_opened_ = 0;
};

}  // namespace onebit

#endif  // ONEBIT_SECURITY_DATA_SEAL_H_
