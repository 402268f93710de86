#include "security/curve.h"

#include <chrono>
#include <cstdio>
#include <iterator>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "zmq_addon.hpp"

namespace onebit {

CurveKeys NewCurveKeys() {
  char pub[41], sec[41];
  if (zmq_curve_keypair(pub, sec) != 0) {
    throw zmq::error_t();  // libzmq without CURVE: Debian's has it
  }
  CurveKeys k;
  k.public_key.resize(32);
  k.secret_key.resize(32);
  zmq_z85_decode(reinterpret_cast<uint8_t*>(k.public_key.data()), pub);
  zmq_z85_decode(reinterpret_cast<uint8_t*>(k.secret_key.data()), sec);
  return k;
}

void MakeCurveServer(zmq::socket_t* s, const CurveKeys& keys) {
  s->set(zmq::sockopt::curve_server, 1);
  s->set(zmq::sockopt::curve_secretkey, zmq::buffer(keys.secret_key));
  s->set(zmq::sockopt::zap_domain, "onebit");
}

void MakeCurveClient(zmq::socket_t* s, const CurveKeys& keys,
                     const std::string& server_public_key) {
  s->set(zmq::sockopt::curve_serverkey, zmq::buffer(server_public_key));
  s->set(zmq::sockopt::curve_publickey, zmq::buffer(keys.public_key));
  s->set(zmq::sockopt::curve_secretkey, zmq::buffer(keys.secret_key));
}

std::string PeerUserId(const zmq::message_t& msg) {
  const char* v = zmq_msg_gets(const_cast<zmq_msg_t*>(msg.handle()), "User-Id");
  return v == nullptr ? std::string() : std::string(v);
}

ZapHandler::ZapHandler(zmq::context_t* ctx, std::string who)
    : socket_(*ctx, zmq::socket_type::rep), who_(std::move(who)) {}

absl::StatusOr<std::unique_ptr<ZapHandler>> ZapHandler::Start(zmq::context_t* ctx,
                                                              std::string who) {
  std::unique_ptr<ZapHandler> h(new ZapHandler(ctx, std::move(who)));
  h->socket_.set(zmq::sockopt::linger, 0);
  try {
    h->socket_.bind("inproc://zeromq.zap.01");
  } catch (const zmq::error_t& e) {
    return absl::InternalError(absl::StrCat("cannot start the ZAP handler: ", e.what()));
  }
  h->thread_ = std::thread([p = h.get()] { p->Loop(); });
  return h;
}

ZapHandler::~ZapHandler() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void ZapHandler::Allow(std::map<std::string, std::string> clients) {
  absl::MutexLock l(&mu_);
  clients_ = std::move(clients);
}

void ZapHandler::Loop() {
  // Refusals are counted and said every few seconds, not once each: a
  // flood of handshakes must not become a flood of log lines.
  uint64_t said = 0;
  absl::Time last_said = absl::InfinitePast();
  while (!stop_) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(100));
    } catch (const zmq::error_t&) {
      continue;  // EINTR
    }
    const uint64_t refused = refused_.load();
    if (refused > said && absl::Now() - last_said > absl::Seconds(5)) {
      std::fprintf(stderr,
                   "%s: refused %llu data-plane connection(s) without a key of this job%s\n",
                   who_.c_str(), static_cast<unsigned long long>(refused - said),
                   said == 0 ? "" : " since the last report");
      said = refused;
      last_said = absl::Now();
    }
    if (!(item.revents & ZMQ_POLLIN)) continue;
    std::vector<zmq::message_t> req;
    if (!zmq::recv_multipart(socket_, std::back_inserter(req), zmq::recv_flags::dontwait)) {
      continue;
    }
    // version, request id, domain, address, routing id, mechanism, credentials...
    std::string user_id;
    bool ok = false;
    if (req.size() >= 7 && req[0].to_string() == "1.0" && req[5].to_string() == "CURVE") {
      absl::MutexLock l(&mu_);
      auto it = clients_.find(req[6].to_string());
      if (it != clients_.end()) {
        ok = true;
        user_id = it->second;
      }
    }
    if (!ok) refused_.fetch_add(1);
    std::vector<zmq::message_t> reply;
    reply.emplace_back(std::string("1.0"));
    reply.push_back(req.size() >= 2 ? zmq::message_t(req[1].data(), req[1].size())
                                    : zmq::message_t());
    reply.emplace_back(std::string(ok ? "200" : "400"));
    reply.emplace_back(std::string(ok ? "OK" : "not a key of this job"));
    reply.emplace_back(user_id);
    reply.emplace_back();  // no metadata
    try {
      zmq::send_multipart(socket_, reply);
    } catch (const zmq::error_t&) {
      // The context is closing.
    }
  }
}

}  // namespace onebit
