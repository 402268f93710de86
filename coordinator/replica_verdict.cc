#include "coordinator/replica_verdict.h"

#include <algorithm>
#include <cstdio>

namespace onebit {

ReplicaVerdict CompareReplicas(const std::vector<Membership::Process>& servers,
                               const std::vector<Membership::Process>& workers) {
  ReplicaVerdict v;
  bool equal = true, agree = true;
  for (uint32_t k = 0; k < servers.size(); ++k) {
    const control::ShardChecksum* master = nullptr;
    for (const auto& c : servers[k].checksums) {
      if (c.shard() == k) master = &c;
    }
    if (master == nullptr) {
      equal = agree = false;
      continue;
    }
    v.floored += master->floored();
    const uint32_t expect = master->has_replica() ? master->replica_crc32() : master->crc32();
    if (master->has_replica()) {
      v.max_replica_diff = std::max(v.max_replica_diff.value_or(0.0), master->max_abs_diff());
      equal &= master->replica_crc32() == master->crc32();
    }
    for (uint32_t w = 0; w < workers.size(); ++w) {
      bool match = false;
      for (const auto& c : workers[w].checksums) {
        match |= c.shard() == k && c.begin() == master->begin() && c.end() == master->end() &&
                 c.crc32() == expect;
      }
      if (!match) {
        std::fprintf(stderr, "coordinator: worker %u's replica of shard %u differs from the %s\n",
                     w, k, master->has_replica() ? "server's mirror of it" : "master");
      }
      agree &= match;
    }
  }
  equal &= agree;
  v.replicas_equal = equal;
  v.workers_agree = agree;
  return v;
}

}  // namespace onebit
