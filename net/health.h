// grpc.health.v1 on every process (docs/design.md §2): gRPC's built-in health
// service, on its own small gRPC server for servers and workers.
#ifndef ONEBIT_NET_HEALTH_H_
#define ONEBIT_NET_HEALTH_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "security/job_secret.h"

namespace onebit {

// Call before building any grpc::Server so it gets the health service.
void EnableHealthService();

// Disables SO_REUSEPORT so that a port in use is an error, not a silent
// second listener.
void ConfigureExclusivePort(grpc::ServerBuilder* builder);

// Starts a gRPC server serving only health (always SERVING) on bind_host:port (port 0: any
// free port). *selected_port gets the bound port.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& bind_host,
                                                                int port, int* selected_port);

// SERVING within `timeout`, else an error naming the target. `security`:
// the target is a coordinator's main port (TLS unless --insecure); null: a
// plaintext health port.
absl::Status CheckHealth(const std::string& target, absl::Duration timeout,
                         const Security* security = nullptr);

}  // namespace onebit

#endif  // ONEBIT_NET_HEALTH_H_
