// A worker's request header as the server tests send it: rank 0 of job
// `job`, one shard (0), codec blocks of 32 elements.
#ifndef ONEBIT_TESTS_SERVER_REQUEST_H_
#define ONEBIT_TESTS_SERVER_REQUEST_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "net/data_plane.h"
#include "proto/data.pb.h"

namespace onebit::testing {

inline data::Header Request(uint64_t job, data::Kind kind, uint64_t step, uint64_t begin,
                            uint64_t count, const std::string& codec, size_t payload_bytes) {
  data::Header h;
  h.set_version(kProtocolVersion);
  h.set_job_id(job);
  h.set_kind(kind);
  h.set_rank(0);
  h.set_step(step);
  h.set_shard(0);
  h.set_begin(begin);
  h.set_count(count);
  h.set_codec(codec);
  h.set_block_size(32);
  h.set_payload_bytes(payload_bytes);
  return h;
}

}  // namespace onebit::testing

#endif  // ONEBIT_TESTS_SERVER_REQUEST_H_
