#include "security/curve.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iterator>
#include <optional>
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

ZapHandler::ZapHandler(zmq::context_t* ctx, std::string who, absl::Duration wait)
    : socket_(*ctx, zmq::socket_type::router), who_(std::move(who)), wait_(wait) {}

absl::StatusOr<std::unique_ptr<ZapHandler>> ZapHandler::Start(zmq::context_t* ctx, std::string who,
                                                              absl::Duration wait) {
  std::unique_ptr<ZapHandler> h(new ZapHandler(ctx, std::move(who), wait));
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

void ZapHandler::AllowPasswords(std::map<std::string, std::string> passwords) {
  absl::MutexLock l(&mu_);
  passwords_ = std::move(passwords);
}

void ZapHandler::Answer(Pending& p, const std::string* user_id) {
  if (user_id == nullptr) refused_.fetch_add(1);
  std::vector<zmq::message_t> reply;
  for (zmq::message_t& m : p.envelope) reply.push_back(std::move(m));
  reply.emplace_back(std::string(user_id != nullptr ? "200" : "400"));
  reply.emplace_back(std::string(user_id != nullptr ? "OK" : "not a key or password of this job"));
  reply.emplace_back(user_id != nullptr ? *user_id : std::string());
  reply.emplace_back();  // no metadata
  try {
    zmq::send_multipart(socket_, reply, zmq::send_flags::dontwait);
  } catch (const zmq::error_t&) {
    // The context is closing.
  }
}

void ZapHandler::AnswerPending(absl::Time now) {
  std::vector<Pending> waiting;
  for (Pending& p : pending_) {
    std::optional<std::string> user_id;
    {
      absl::MutexLock l(&mu_);
      const std::map<std::string, std::string>& known = p.plain ? passwords_ : clients_;
      auto it = known.find(p.key);
      if (it != known.end()) user_id = it->second;
    }
    if (user_id) {
      Answer(p, &*user_id);
    } else if (now >= p.until) {
      Answer(p, nullptr);
    } else {
      waiting.push_back(std::move(p));
    }
  }
  pending_ = std::move(waiting);
}

void ZapHandler::Loop() {
  // Refusals are counted and said every few seconds, not once each: a
  // flood of handshakes must not become a flood of log lines.
  uint64_t said = 0;
  absl::Time last_said = absl::InfinitePast();
  while (!stop_) {
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, std::chrono::milliseconds(pending_.empty() ? 100 : 20));
    } catch (const zmq::error_t&) {
      continue;  // EINTR
    }
    const absl::Time now = absl::Now();
    const uint64_t refused = refused_.load();
    if (refused > said && now - last_said > absl::Seconds(5)) {
      std::fprintf(
          stderr,
          "%s: refused %llu data-plane connection(s) without a key or password of this job%s\n",
          who_.c_str(), static_cast<unsigned long long>(refused - said),
          said == 0 ? "" : " since the last report");
      said = refused;
      last_said = now;
    }
    if (item.revents & ZMQ_POLLIN) {
      std::vector<zmq::message_t> req;
      if (zmq::recv_multipart(socket_, std::back_inserter(req), zmq::recv_flags::dontwait)) {
        // routing id, "", version, request id, domain, address, identity,
        // mechanism, credentials... (CURVE: the key; PLAIN: user, password)
        Pending p;
        const bool v1 = req.size() >= 9 && req[2].to_string() == "1.0";
        const bool curve = v1 && req[7].to_string() == "CURVE";
        p.plain = v1 && req.size() >= 10 && req[7].to_string() == "PLAIN";
        for (size_t i = 0; i < std::min<size_t>(req.size(), 4); ++i) {
          p.envelope.push_back(std::move(req[i]));
        }
        while (p.envelope.size() < 4) p.envelope.emplace_back();
        if (curve) p.key = req[8].to_string();
        if (p.plain) p.key = req[9].to_string();
        p.until = now + wait_;
        if (!(curve || p.plain) || pending_.size() >= kZapPending) {
          Answer(p, nullptr);
        } else {
          pending_.push_back(std::move(p));
        }
      }
    }
    AnswerPending(now);
  }
}

}  // namespace onebit
