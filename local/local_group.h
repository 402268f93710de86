// The ranks of one host that push as one worker (--local_ranks K,
// docs/design.md §1.9). Local rank 0, the leader, is the job's worker: it
// registers, pushes the host's gradient and applies the servers' replies.
// Local ranks 1..K-1, the followers, hand it their gradients and take the
// new parameters from it; they never talk to the coordinator or the servers.
//
// They meet on a Unix SEQPACKET socket in the abstract namespace: it
// disappears with the process that bound it (no stale names after a kill),
// belongs to a network namespace as a host does, and its end of file tells
// either side at once that the other is gone. The socket carries one small
// message per call; the arrays (x, and one gradient slot per follower) live
// in a memfd the leader makes and every rank maps. Only processes of the
// leader's user may join (SO_PEERCRED): an abstract socket has no file
// permissions of its own.
//
// Neither class is thread-safe: one thread at a time, as the Worker's calls.
// Every wait is bounded by the timeout given, and ends with an error naming
// the rank it waited for.
#ifndef ONEBIT_LOCAL_LOCAL_GROUP_H_
#define ONEBIT_LOCAL_LOCAL_GROUP_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace onebit {

// The calls every rank of a group makes together.
enum class LocalCall : uint32_t {
  kBroadcast = 1,  // BroadcastParameters
  kStep = 2,       // Step: the follower's gradient is in its slot
  kVote = 3,       // AgreeOnOverflow
  kFinish = 4,     // Finish
  kAbort = 5,      // the follower gives up (text: why); no answer comes
};
const char* LocalCallName(LocalCall call);

// A follower's side of a call.
struct LocalRequest {
  LocalCall call = LocalCall::kStep;
  uint32_t local_rank = 0;
  uint64_t step = 0;  // the follower's steps done when it called
  double loss = 0;    // kStep: the loss it reported
  bool has_loss = false;
  double epoch = 0;
  bool has_lr = false;  // kStep: the lr it set (Worker::SetLearningRate)
  float lr = 0;
  bool found_inf = false;  // kVote
  // kAbort: the reason; kStep: the handle of the follower's gradient on
  // its device, or empty (at most kMaxText bytes).
  std::string text;
};

// The leader's answer to a call, the same for every follower.
struct LocalAnswer {
  int32_t code = 0;  // absl::StatusCode; 0: OK
  std::string message;
  bool rolled_back = false;  // the status was IsRolledBack
  bool failed = false;       // the leader's worker has failed: the job is over
  bool compressing = false;
  bool vote = false;  // kVote: the group's (and the job's) answer
  // kStep: the leader added the followers' gradients on its device, from
  // the handles in their requests' text (Replica::ExportGrads); from then
  // on they need not copy them to their slots.
  bool device_grads = false;
  uint64_t steps_done = 0;
  // kStep: the step's figures (StepStats).
  uint64_t step = 0;
  bool compressed = false;
  uint64_t bytes_up = 0, bytes_down = 0, chunks = 0;
  double step_s = 0, push_s = 0, reply_s = 0;
};

inline constexpr size_t kMaxText = 2048;

// The socket's name for the group of worker `rank` of the job whose
// coordinator is `coordinator` (so that jobs sharing a host do not meet).
std::string LocalGroupName(absl::string_view coordinator, uint32_t rank);

class LocalLeader {
 public:
  // Listens on `name`, takes the hellos of the K - 1 followers within
  // `timeout` (each names a local rank in [1, K), each once, and d as
  // `num_params` or 0), and hands each the shared memory: `hello` (what a
  // follower learns of the job), x and its gradient slot; and
  // `steps_done`, where the job stands (a resumed job's checkpoint step).
  // K >= 2.
  static absl::StatusOr<std::unique_ptr<LocalLeader>> Start(
      absl::string_view name, uint32_t local_ranks, uint64_t num_params, absl::string_view hello,
      uint64_t steps_done, absl::Duration timeout);
  // Closes the socket: a follower's wait then ends with an error.
  ~LocalLeader();
  LocalLeader(const LocalLeader&) = delete;
  LocalLeader& operator=(const LocalLeader&) = delete;

  uint32_t local_ranks() const { return local_ranks_; }
  // Follower k's gradient as of its last kStep request; 1 <= k < K.
  const float* gradient(uint32_t local_rank) const;
  // x as the followers take it with an answer.
  float* params();

  // Every follower's request for `call` at `step`, by local rank (index
  // k - 1), waiting for each at most until `timeout` has passed. An error
  // names the follower that left, did not call within it, made another
  // call or was at another step, or aborted (with its reason).
  absl::StatusOr<std::vector<LocalRequest>> Gather(LocalCall call, uint64_t step,
                                                   absl::Duration timeout);
  // Sends every follower `answer` to the call they wait in (x in params()
  // first). An error names a follower that is gone.
  absl::Status Answer(const LocalAnswer& answer);

 private:
  LocalLeader() = default;
  uint32_t local_ranks_ = 0;
  uint64_t num_params_ = 0;
  int listen_fd_ = -1;
  std::vector<int> fds_;  // by local rank - 1
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  size_t x_offset_ = 0;
  std::string name_;
};

class LocalFollower {
 public:
  // Joins the group on `name` as `local_rank` (>= 1), retrying until the
  // leader listens, at most `timeout` in all; `num_params` 0 takes the
  // leader's d.
  static absl::StatusOr<std::unique_ptr<LocalFollower>> Connect(absl::string_view name,
                                                                uint32_t local_rank,
                                                                uint64_t num_params,
                                                                absl::Duration timeout);
  ~LocalFollower();
  LocalFollower(const LocalFollower&) = delete;
  LocalFollower& operator=(const LocalFollower&) = delete;

  uint32_t local_rank() const { return local_rank_; }
  uint32_t local_ranks() const { return local_ranks_; }
  uint64_t num_params() const { return num_params_; }
  // What the leader said of the job (LocalLeader::Start's `hello` and
  // `steps_done`).
  const std::string& hello() const { return hello_; }
  uint64_t steps_done_at_join() const { return steps_at_join_; }
  // Its gradient slot: write it before a kStep call.
  float* gradient();
  // x as of the last answer.
  const float* params() const;

  // Sends `request` and waits at most `timeout` for the answer; an error
  // when the leader is gone or silent.
  absl::StatusOr<LocalAnswer> Call(LocalRequest request, absl::Duration timeout);
  // Tells the leader that this rank gives up (the job fails with
  // `reason`); does not wait.
  void Abort(absl::string_view reason);

 private:
  LocalFollower() = default;
  uint32_t local_rank_ = 0;
  uint32_t local_ranks_ = 0;
  uint64_t num_params_ = 0;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  size_t x_offset_ = 0;
  size_t slot_offset_ = 0;
  std::string hello_;
  uint64_t steps_at_join_ = 0;
  std::string name_;
};

}  // namespace onebit

#endif  // ONEBIT_LOCAL_LOCAL_GROUP_H_
