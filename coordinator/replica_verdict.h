// The end of a job: whether every worker's replica of each shard equals
// that shard's master (under --server_reply delta, the server's mirror of
// the replica), from the checksums the processes sent with Done.
//
// A pure function: thread-safe.
#ifndef ONEBIT_COORDINATOR_REPLICA_VERDICT_H_
#define ONEBIT_COORDINATOR_REPLICA_VERDICT_H_

#include <cstdint>
#include <optional>
#include <vector>

#include "coordinator/membership.h"

namespace onebit {

struct ReplicaVerdict {
  bool replicas_equal = false;             // every replica and mirror equals its master
  bool workers_agree = false;              // every replica equals every other
  std::optional<double> max_replica_diff;  // the largest mirror-master difference
  uint64_t floored = 0;                    // v entries floored, over the shards
};

// From server k's checksum of its shard k and every worker's of each shard;
// a replica that differs is named on stderr. A server without its own
// checksum makes the replicas unequal.
ReplicaVerdict CompareReplicas(const std::vector<Membership::Process>& servers,
                               const std::vector<Membership::Process>& workers);

}  // namespace onebit

#endif  // ONEBIT_COORDINATOR_REPLICA_VERDICT_H_
