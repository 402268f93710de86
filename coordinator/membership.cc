#include "coordinator/membership.h"

#include <algorithm>
#include <chrono>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "security/job_secret.h"

namespace onebit {

uint64_t NewRandomId() {
  std::random_device rd;
  const uint64_t id =
      (uint64_t{rd()} << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return id == 0 ? 1 : id;
}

Membership::Membership(uint32_t servers, uint32_t workers) : servers_(servers), workers_(workers) {}

std::string Membership::Name(control::Role role, uint32_t rank) {
  return absl::StrCat(RoleName(role), " ", rank);
}

bool Membership::IsRegistered(control::Role role, uint32_t rank) const {
  const std::vector<Process>& group = Group(role);
  return (role == control::SERVER || role == control::WORKER) && rank < group.size() &&
         group[rank].registered;
}

bool Membership::IsOwner(control::Role role, uint32_t rank, const std::string& credential) const {
  return IsRegistered(role, rank) && SameBytes(credential, Group(role)[rank].credential);
}

bool Membership::AllRegistered() const {
  for (const auto* g : {&servers_, &workers_}) {
    for (const Process& p : *g) {
      if (!p.registered) return false;
    }
  }
  return true;
}

std::string Membership::Missing() const {
  std::vector<std::string> missing;
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (!servers_[i].registered) missing.push_back(absl::StrCat("server ", i));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    if (!workers_[i].registered) missing.push_back(absl::StrCat("worker ", i));
  }
  return absl::StrJoin(missing, ", ");
}

void Membership::SeenAllAt(absl::Time now) {
  for (auto* g : {&servers_, &workers_}) {
    for (Process& q : *g) q.last_seen = now;
  }
}

std::optional<uint32_t> Membership::FinishedWorker() const {
  for (uint32_t w = 0; w < workers_.size(); ++w) {
    if (workers_[w].done) return w;
  }
  return std::nullopt;
}

uint64_t Membership::FurthestWorkerStep(uint64_t step) const {
  for (const Process& p : workers_) step = std::max(step, p.step);
  return step;
}

void Membership::ExpectRejoin(uint64_t step) {
  for (auto* g : {&servers_, &workers_}) {
    for (Process& p : *g) {
      p.registered = false;
      p.told = false;
      p.done = false;
      p.stop_ack.reset();
      p.checksums.clear();
      p.step = step;
    }
  }
}

bool Membership::EveryoneTold() const {
  for (const Process& p : servers_) {
    if (p.registered && !p.told) return false;
  }
  for (const Process& p : workers_) {
    if (p.registered && !p.done && !p.told) return false;
  }
  return true;
}

bool Membership::WorkersSilent() const {
  for (const Process& p : workers_) {
    if (p.registered && !p.done && !p.reported_error && !p.lost) return false;
  }
  return true;
}

void Membership::NewIncarnation(std::string why) {
  incarnation_ = NewRandomId();
  rejoin_why_ = std::move(why);
}

}  // namespace onebit
