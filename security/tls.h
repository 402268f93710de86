// The control plane's protection, all made from the job secret
// (security/job_secret.h): the coordinator serves TLS with a certificate
// whose Ed25519 key is derived from the secret (only a holder of the secret
// can pose as the coordinator; clients pin that certificate), and every call
// carries a credential derived from the secret, which each handler checks
// (CheckCallCredential). Under --insecure: plaintext, no checks.
//
// Thread-safe; the certificate is derived once per secret.
#ifndef ONEBIT_SECURITY_TLS_H_
#define ONEBIT_SECURITY_TLS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "security/job_secret.h"

namespace onebit {

// Credentials for the coordinator's listening port. A call without this
// job's credential is refused (UNAUTHENTICATED) as its headers arrive,
// before its request is read or a handler runs (gRPC's
// AuthMetadataProcessor): what a client without the secret sends is never
// buffered. `refused`, when given, hears each such call's method ("Status")
// from gRPC's threads. Under --insecure: plaintext, nothing checked.
std::shared_ptr<grpc::ServerCredentials> ControlServerCredentials(
    const Security& security, std::function<void(absl::string_view method)> refused = nullptr);

// TLS handshakes that failed in this process since it started (a peer
// without the job's certificate, a port scan, plaintext to a TLS port), as
// gRPC reports them. Thread-safe.
uint64_t FailedTlsHandshakes();

// A channel to the coordinator at `target` ("host:port"), with `args`.
std::shared_ptr<grpc::Channel> ControlChannel(const std::string& target, const Security& security,
                                              grpc::ChannelArguments args);

// OK when the call carries this job's credential (always under
// --insecure); else UNAUTHENTICATED, saying nothing about the job.
grpc::Status CheckCallCredential(const grpc::ServerContext& ctx, const Security& security);

// The name the coordinator's certificate is issued to, whatever address a
// client dials.
inline constexpr char kControlServerName[] = "coordinator.onebit-ps";

// The certificate and key the coordinator serves (PEM), for tests.
struct ControlCertificate {
  std::string cert_pem;
  std::string key_pem;
};
ControlCertificate ControlCertificateOf(const JobSecret& secret);

}  // namespace onebit

#endif  // ONEBIT_SECURITY_TLS_H_
