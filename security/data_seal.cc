#include "security/data_seal.h"

#include <openssl/evp.h>
#include <sodium.h>

#include <atomic>
#include <climits>
#include <cstring>

#include "absl/base/internal/endian.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace onebit {
namespace {

constexpr size_t kKeyBytes = 32;
constexpr size_t kTagBytes = 16;
constexpr size_t kNonceBytes = 12;

// Keyed BLAKE2b-256 of `parts` under `key`.
std::string Hash(const std::string& key, std::initializer_list<absl::string_view> parts) {
  crypto_generichash_state st;
  crypto_generichash_init(&st, reinterpret_cast<const unsigned char*>(key.data()), key.size(),
                          kKeyBytes);
  for (absl::string_view p : parts) {
    crypto_generichash_update(&st, reinterpret_cast<const unsigned char*>(p.data()), p.size());
  }
  std::string out(kKeyBytes, '\0');
  crypto_generichash_final(&st, reinterpret_cast<unsigned char*>(out.data()), out.size());
  return out;
}

std::string Le64(uint64_t v) {
  std::string s(8, '\0');
  absl::little_endian::Store64(s.data(), v);
  return s;
}

std::string Le32(uint32_t v) {
  std::string s(4, '\0');
  absl::little_endian::Store32(s.data(), v);
  return s;
}

// One sequence per process: no two messages it seals share a counter, so
// no nonce repeats under any of its keys, whatever its connections do.
std::atomic<uint64_t> next_counter{1};

void Nonce(SealDirection d, uint64_t counter, unsigned char out[kNonceBytes]) {
  absl::little_endian::Store32(out, static_cast<uint32_t>(d));
  absl::little_endian::Store64(out + 4, counter);
}

EVP_CIPHER_CTX* Keyed(const std::string& key, bool encrypt) {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  const auto* k = reinterpret_cast<const unsigned char*>(key.data());
  const int ok = encrypt ? EVP_EncryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, k, nullptr)
                         : EVP_DecryptInit_ex(ctx, EVP_aes_256_gcm(), nullptr, k, nullptr);
  if (ok != 1) {
    EVP_CIPHER_CTX_free(ctx);
    return nullptr;
  }
  return ctx;
}

// Runs the cipher over [in, in + n) into out (the same or disjoint), in
// pieces EVP's int lengths take.
bool Update(EVP_CIPHER_CTX* ctx, bool encrypt, const unsigned char* in, unsigned char* out,
            size_t n) {
  while (n > 0) {
    const int piece = static_cast<int>(std::min<size_t>(n, size_t{1} << 30));
    int len = 0;
    const int ok = encrypt ? EVP_EncryptUpdate(ctx, out, &len, in, piece)
                           : EVP_DecryptUpdate(ctx, out, &len, in, piece);
    if (ok != 1 || len != piece) return false;
    in += piece;
    out += piece;
    n -= piece;
  }
  return true;
}

bool AddHeader(EVP_CIPHER_CTX* ctx, bool encrypt, const zmq::message_t& header) {
  if (header.size() == 0) return true;
  if (header.size() > INT_MAX) return false;
  int len = 0;
  const auto* h = static_cast<const unsigned char*>(header.data());
  const int n = static_cast<int>(header.size());
  return (encrypt ? EVP_EncryptUpdate(ctx, nullptr, &len, h, n)
                  : EVP_DecryptUpdate(ctx, nullptr, &len, h, n)) == 1;
}

}  // namespace

absl::StatusOr<PairSecret> PairSecret::Agree(const CurveKeys& mine, const std::string& peer_public,
                                             const std::string& worker_public,
                                             const std::string& server_public,
                                             uint64_t data_plane_id, uint32_t worker,
                                             uint32_t server) {
  if (sodium_init() < 0) return absl::InternalError("libsodium failed to initialise");
  if (peer_public.size() != crypto_scalarmult_BYTES ||
      mine.secret_key.size() != crypto_scalarmult_SCALARBYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("a data-plane public key of ", peer_public.size(), " bytes (want 32)"));
  }
  std::string shared(crypto_scalarmult_BYTES, '\0');
  if (crypto_scalarmult(reinterpret_cast<unsigned char*>(shared.data()),
                        reinterpret_cast<const unsigned char*>(mine.secret_key.data()),
                        reinterpret_cast<const unsigned char*>(peer_public.data())) != 0) {
    return absl::InvalidArgumentError(
        "a data-plane public key that is not a usable X25519 key (a degenerate point)");
  }
  // Both public keys bind the agreement to this pair (as crypto_kx does);
  // the incarnation and ranks, to this job's use of it.
  std::string key = Hash(shared, {"onebit data-plane pair v1", worker_public, server_public,
                                  Le64(data_plane_id), Le32(worker), Le32(server)});
  sodium_memzero(shared.data(), shared.size());
  return PairSecret(std::move(key));
}

std::string PairSecret::Password() const {
  return absl::BytesToHexString(Hash(key_, {"zap plain password"}));
}

std::string PairSecret::ConnectionKey(uint32_t connection) const {
  return Hash(key_, {"aes-256-gcm connection", Le32(connection)});
}

void MakePlainServer(zmq::socket_t* s) {
  s->set(zmq::sockopt::plain_server, 1);
  s->set(zmq::sockopt::zap_domain, "onebit");
}

void MakePlainClient(zmq::socket_t* s, const std::string& user, const std::string& password) {
  s->set(zmq::sockopt::plain_username, user);
  s->set(zmq::sockopt::plain_password, password);
}

ConnectionSeal::ConnectionSeal(const std::string& key, SealDirection outgoing)
    : enc_(Keyed(key, true)), dec_(Keyed(key, false)), outgoing_(outgoing) {}

ConnectionSeal::~ConnectionSeal() {
  EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(enc_));
  EVP_CIPHER_CTX_free(static_cast<EVP_CIPHER_CTX*>(dec_));
}

absl::StatusOr<zmq::message_t> ConnectionSeal::Seal(const zmq::message_t& header,
                                                    zmq::message_t* payload) {
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(enc_);
  const uint64_t counter = next_counter.fetch_add(1, std::memory_order_relaxed);
  unsigned char nonce[kNonceBytes];
  Nonce(outgoing_, counter, nonce);
  zmq::message_t cipher(payload->size());
  unsigned char tag[kTagBytes], none[16];
  int len = 0;
  if (ctx == nullptr || EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, nonce) != 1 ||
      !AddHeader(ctx, true, header) ||
      !Update(ctx, true, static_cast<const unsigned char*>(payload->data()),
              static_cast<unsigned char*>(cipher.data()), payload->size()) ||
      EVP_EncryptFinal_ex(ctx, none, &len) != 1 ||
      EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, kTagBytes, tag) != 1) {
    return absl::InternalError("OpenSSL's AES-256-GCM failed to seal a message");
  }
  *payload = std::move(cipher);
  zmq::message_t seal(kSealBytes);
  auto* s = static_cast<unsigned char*>(seal.data());
  absl::little_endian::Store64(s, counter);
  std::memcpy(s + 8, tag, kTagBytes);
  return seal;
}

absl::Status ConnectionSeal::Open(const zmq::message_t& header, zmq::message_t* payload,
                                  const zmq::message_t& seal) {
  if (seal.size() != kSealBytes) {
    return absl::PermissionDeniedError(
        absl::StrCat("a seal of ", seal.size(), " bytes (want ", kSealBytes, ")"));
  }
  const auto* s = static_cast<const unsigned char*>(seal.data());
  const uint64_t counter = absl::little_endian::Load64(s);
  if (counter <= last_opened_) {
    return absl::PermissionDeniedError(absl::StrCat("a replayed message (counter ", counter,
                                                    " after ", last_opened_, " was opened)"));
  }
  const SealDirection incoming =
      outgoing_ == SealDirection::kToServer ? SealDirection::kToWorker : SealDirection::kToServer;
  unsigned char nonce[kNonceBytes];
  Nonce(incoming, counter, nonce);
  unsigned char tag[kTagBytes];
  std::memcpy(tag, s + 8, kTagBytes);
  auto* ctx = static_cast<EVP_CIPHER_CTX*>(dec_);
  auto* p = static_cast<unsigned char*>(payload->data());
  unsigned char none[16];
  int len = 0;
  const bool ok = ctx != nullptr &&
                  EVP_DecryptInit_ex(ctx, nullptr, nullptr, nullptr, nonce) == 1 &&
                  AddHeader(ctx, false, header) && Update(ctx, false, p, p, payload->size()) &&
                  EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_SET_TAG, kTagBytes, tag) == 1 &&
                  EVP_DecryptFinal_ex(ctx, none, &len) == 1;
  if (!ok) {
    return absl::PermissionDeniedError(
        "a message whose seal does not verify (forged, altered, or under another key)");
  }
  last_opened_ = counter;
  return absl::OkStatus();
}

}  // namespace onebit
