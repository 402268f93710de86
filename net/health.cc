#include "net/health.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "grpcpp/health_check_service_interface.h"
#include "net/control.h"
#include "proto/health.grpc.pb.h"

namespace onebit {

void EnableHealthService() { grpc::EnableDefaultHealthCheckService(true); }

void ConfigureExclusivePort(grpc::ServerBuilder* builder) {
  builder->AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

namespace {

// gRPC's built-in health service only runs synchronously next to another
// synchronous service; a server with nothing else to serve needs its own.
// Always SERVING while the process is up.
class AlwaysServing final : public grpc::health::v1::Health::Service {
  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest* req,
                     grpc::health::v1::HealthCheckResponse* resp) override {
    if (!req->service().empty()) {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service");
    }
    resp->set_status(grpc::health::v1::HealthCheckResponse::SERVING);
    return grpc::Status::OK;
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<grpc::Server>> StartHealthServer(const std::string& bind_host,
                                                                int port, int* selected_port) {
  static AlwaysServing* const service = new AlwaysServing;
  grpc::ServerBuilder builder;
  builder.RegisterService(service);
  // This server's health service is its own: without this, once
  // EnableHealthService() has run in the process (the coordinator's main
  // port), gRPC would add its default one too and log a duplicate
  // registration of /grpc.health.v1.Health/Check.
  builder.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
  ConfigureExclusivePort(&builder);
  const std::string addr = absl::StrCat(bind_host, ":", port);
  builder.AddListeningPort(addr, grpc::InsecureServerCredentials(), selected_port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *selected_port == 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen for health checks on ", addr, " (port in use?)"));
  }
  return server;
}

absl::Status CheckHealth(const std::string& target, absl::Duration timeout,
                         const Security* security) {
  auto stub = grpc::health::v1::Health::NewStub(security != nullptr ? MakeChannel(target, *security)
                                                                    : MakeHealthChannel(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  ctx.set_wait_for_ready(true);
  grpc::health::v1::HealthCheckRequest req;
  grpc::health::v1::HealthCheckResponse resp;
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return RpcError(absl::StrCat("health check of ", target), s);
  if (resp.status() != grpc::health::v1::HealthCheckResponse::SERVING) {
    return absl::UnavailableError(absl::StrCat(target, " is not serving"));
  }
  return absl::OkStatus();
}

}  // namespace onebit
