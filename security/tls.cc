#include "security/tls.h"

#include <grpc/support/log.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace onebit {
namespace {

constexpr const char* kServerName = kControlServerName;
constexpr char kCredentialKey[] = "onebit-job-credential";

std::string JobCredential(const JobSecret& secret) {
  return absl::BytesToHexString(secret.Derive("onebit-ps control call credential v1"));
}

std::string ToPem(int (*write)(BIO*, void*), void* what) {
  BIO* bio = BIO_new(BIO_s_mem());
  write(bio, what);
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  std::string out(data, static_cast<size_t>(n));
  BIO_free(bio);
  return out;
}

}  // namespace

ControlCertificate ControlCertificateOf(const JobSecret& secret) {
  // Ed25519 keys and signatures are deterministic: every process derives the
  // same certificate, so the clients can pin it without being sent it.
  const std::string seed = secret.Derive("onebit-ps control tls key v1");
  EVP_PKEY* key = EVP_PKEY_new_raw_private_key(
      EVP_PKEY_ED25519, nullptr, reinterpret_cast<const unsigned char*>(seed.data()), seed.size());
  X509* x = X509_new();
  if (key == nullptr || x == nullptr) std::abort();  // out of memory
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
  ASN1_TIME_set_string(X509_getm_notBefore(x), "20000101000000Z");
  ASN1_TIME_set_string(X509_getm_notAfter(x), "99991231235959Z");
  X509_set_pubkey(x, key);
  X509_NAME* name = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(kServerName), -1, -1, 0);
  X509_set_issuer_name(x, name);
  X509V3_CTX v3;
  X509V3_set_ctx_nodb(&v3);
  X509V3_set_ctx(&v3, x, x, nullptr, nullptr, 0);
  const std::string san = std::string("DNS:") + kServerName;
  for (auto [nid, value] : {std::pair{NID_subject_alt_name, san.c_str()},
                            {NID_basic_constraints, "critical,CA:TRUE"},
                            {NID_key_usage, "critical,digitalSignature,keyCertSign"}}) {
    X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &v3, nid, value);
    X509_add_ext(x, ext, -1);
    X509_EXTENSION_free(ext);
  }
  X509_sign(x, key, nullptr);  // Ed25519 hashes by itself
  ControlCertificate out;
  out.cert_pem =
      ToPem([](BIO* b, void* c) { return PEM_write_bio_X509(b, static_cast<X509*>(c)); }, x);
  out.key_pem = ToPem(
      [](BIO* b, void* k) {
        return PEM_write_bio_PrivateKey(b, static_cast<EVP_PKEY*>(k), nullptr, nullptr, 0, nullptr,
                                        nullptr);
      },
      key);
  X509_free(x);
  EVP_PKEY_free(key);
  return out;
}

namespace {

// Adds the job credential to every call on a channel.
class CredentialPlugin final : public grpc::MetadataCredentialsPlugin {
 public:
  explicit CredentialPlugin(std::string credential) : credential_(std::move(credential)) {}
  bool IsBlocking() const override { return false; }
  grpc::Status GetMetadata(grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
                           std::multimap<std::string, std::string>* metadata) override {
    metadata->emplace(kCredentialKey, credential_);
    return grpc::Status::OK;
  }

 private:
  const std::string credential_;
};

// gRPC logs every failed TLS handshake (a client without the job's
// certificate, a port scan, plaintext to the TLS port) as an error line: a
// flood of connections would be a flood of lines. Those are counted and
// said every few seconds; other lines pass as they were.
std::atomic<uint64_t> failed_handshakes{0};

void LogGrpc(gpr_log_func_args* a) {
  const char* file = std::strrchr(a->file, '/');
  file = file != nullptr ? file + 1 : a->file;
  const bool handshake = std::strstr(a->message, "andshake") != nullptr ||
                         std::strncmp(file, "ssl_transport_security", 22) == 0;
  if (!handshake) {
    std::fprintf(stderr, "grpc %s %s:%d] %s\n", gpr_log_severity_string(a->severity), file, a->line,
                 a->message);
    return;
  }
  failed_handshakes.fetch_add(1, std::memory_order_relaxed);
  static absl::Mutex mu(absl::kConstInit);
  static uint64_t unsaid ABSL_GUARDED_BY(mu) = 0;
  static absl::Time said_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  absl::MutexLock l(&mu);
  const absl::Time now = absl::Now();
  ++unsaid;
  if (now - said_at < absl::Seconds(5)) return;
  std::fprintf(stderr,
               "grpc: %llu TLS handshake(s) failed (a peer without this job's secret?); the "
               "last: %s\n",
               static_cast<unsigned long long>(unsaid), a->message);
  unsaid = 0;
  said_at = now;
}

void QuietHandshakeLogs() {
  static std::once_flag once;
  std::call_once(once, [] { gpr_set_log_function(LogGrpc); });
}

}  // namespace

namespace {

// Refuses a call without the job credential from its headers, so that its
// request is never read: gRPC cancels the stream before the message
// arrives, where a handler would see it only once read in full.
class CredentialCheck final : public grpc::AuthMetadataProcessor {
 public:
  CredentialCheck(std::string credential, std::function<void(absl::string_view)> refused)
      : credential_(std::move(credential)), refused_(std::move(refused)) {}

  bool IsBlocking() const override { return false; }  // a constant-time compare

  grpc::Status Process(const InputMetadata& md, grpc::AuthContext*, OutputMetadata*,
                       OutputMetadata*) override {
    auto it = md.find(kCredentialKey);
    if (it != md.end() &&
        SameBytes(absl::string_view(it->second.data(), it->second.size()), credential_)) {
      return grpc::Status::OK;
    }
    if (refused_) {
      // ":path" is "/onebit.control.Coordinator/Status".
      absl::string_view method = "call";
      if (auto path = md.find(":path"); path != md.end()) {
        method = absl::string_view(path->second.data(), path->second.size());
        method = method.substr(method.rfind('/') + 1);
      }
      refused_(method);
    }
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "no valid job credential: this call needs the job's secret");
  }

 private:
  const std::string credential_;
  const std::function<void(absl::string_view)> refused_;
};

}  // namespace

uint64_t FailedTlsHandshakes() { return failed_handshakes.load(std::memory_order_relaxed); }

std::shared_ptr<grpc::ServerCredentials> ControlServerCredentials(
    const Security& security, std::function<void(absl::string_view method)> refused) {
  if (security.insecure()) return grpc::InsecureServerCredentials();
  QuietHandshakeLogs();
  const ControlCertificate cert = ControlCertificateOf(*security.secret);
  // Clients present the same certificate: a peer without the secret never
  // completes the handshake, so it holds no connection (and sends no call)
  // past it.
  grpc::SslServerCredentialsOptions o(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  o.pem_root_certs = cert.cert_pem;
  o.pem_key_cert_pairs.push_back({cert.key_pem, cert.cert_pem});
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::SslServerCredentials(o);
  creds->SetAuthMetadataProcessor(
      std::make_shared<CredentialCheck>(JobCredential(*security.secret), std::move(refused)));
  return creds;
}

std::shared_ptr<grpc::Channel> ControlChannel(const std::string& target, const Security& security,
                                              grpc::ChannelArguments args) {
  if (security.insecure()) {
    return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  }
  QuietHandshakeLogs();
  const ControlCertificate cert = ControlCertificateOf(*security.secret);
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = cert.cert_pem;
  o.pem_private_key = cert.key_pem;  // the coordinator requires it of clients
  o.pem_cert_chain = cert.cert_pem;
  args.SetSslTargetNameOverride(kServerName);
  auto creds = grpc::CompositeChannelCredentials(
      grpc::SslCredentials(o),
      grpc::MetadataCredentialsFromPlugin(
          std::make_unique<CredentialPlugin>(JobCredential(*security.secret))));
  return grpc::CreateCustomChannel(target, creds, args);
}

grpc::Status CheckCallCredential(const grpc::ServerContext& ctx, const Security& security) {
  if (security.insecure()) return grpc::Status::OK;
  const std::string want = JobCredential(*security.secret);
  const auto& md = ctx.client_metadata();
  auto it = md.find(kCredentialKey);
  if (it != md.end() && SameBytes(absl::string_view(it->second.data(), it->second.size()), want)) {
    return grpc::Status::OK;
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                      "no valid job credential: this call needs the job's secret");
}

}  // namespace onebit
