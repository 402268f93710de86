// The local group (local/local_group.h): a leader and its followers in
// threads of this process, over the real socket and shared memory.
#include "local/local_group.h"

#include <sys/wait.h>
#include <unistd.h>

#include <future>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

// A name no other test (or run) uses.
std::string Name(const std::string& test) {
  return absl::StrCat("onebit-ps-test/", getpid(), "/", test);
}

struct Group {
  std::unique_ptr<LocalLeader> leader;
  std::vector<std::unique_ptr<LocalFollower>> followers;
};

// K ranks of d parameters, joined.
Group Join(const std::string& name, uint32_t k, uint64_t d, const std::string& hello = "job") {
  std::vector<std::future<absl::StatusOr<std::unique_ptr<LocalFollower>>>> joining;
  for (uint32_t r = 1; r < k; ++r) {
    joining.push_back(std::async(std::launch::async, [=] {
      return LocalFollower::Connect(name, r, r == 1 ? d : 0, absl::Seconds(10));
    }));
  }
  Group g;
  auto leader = LocalLeader::Start(name, k, d, hello, 17, absl::Seconds(10));
  EXPECT_TRUE(leader.ok()) << leader.status();
  if (leader.ok()) g.leader = std::move(*leader);
  for (auto& j : joining) {
    auto f = j.get();
    EXPECT_TRUE(f.ok()) << f.status();
    if (f.ok()) g.followers.push_back(std::move(*f));
  }
  return g;
}

TEST(LocalGroup, GradientsGoToTheLeaderAndParametersComeBack) {
  constexpr uint64_t d = 5000;
  Group g = Join(Name("roundtrip"), 3, d, std::string(10000, 'h'));
  ASSERT_EQ(g.followers.size(), 2u);
  for (auto& f : g.followers) {
    EXPECT_EQ(f->local_ranks(), 3u);
    EXPECT_EQ(f->num_params(), d);
    EXPECT_EQ(f->hello(), std::string(10000, 'h'));
    EXPECT_EQ(f->steps_done_at_join(), 17u);
  }
  std::vector<std::future<absl::StatusOr<LocalAnswer>>> calls;
  for (auto& f : g.followers) {
    LocalFollower* fp = f.get();
    for (uint64_t i = 0; i < d; ++i) fp->gradient()[i] = 1000.0f * fp->local_rank() + i;
    calls.push_back(std::async(std::launch::async, [fp] {
      LocalRequest r;
      r.call = LocalCall::kStep;
      r.step = 7;
      r.loss = 0.5 * fp->local_rank();
      r.has_loss = true;
      r.has_lr = fp->local_rank() == 2;
      r.lr = 0.25f;
      return fp->Call(r, absl::Seconds(10));
    }));
  }
  auto got = g.leader->Gather(LocalCall::kStep, 7, absl::Seconds(10));
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), 2u);
  for (uint32_t k = 1; k <= 2; ++k) {
    const LocalRequest& r = (*got)[k - 1];
    EXPECT_EQ(r.local_rank, k);
    EXPECT_EQ(r.loss, 0.5 * k);
    EXPECT_TRUE(r.has_loss);
    EXPECT_EQ(r.has_lr, k == 2);
    EXPECT_EQ(g.leader->gradient(k)[0], 1000.0f * k);
    EXPECT_EQ(g.leader->gradient(k)[d - 1], 1000.0f * k + (d - 1));
  }
  for (uint64_t i = 0; i < d; ++i) g.leader->params()[i] = -static_cast<float>(i);
  LocalAnswer a;
  a.code = static_cast<int32_t>(absl::StatusCode::kAborted);
  a.message = "rolled back";
  a.rolled_back = true;
  a.failed = true;
  a.steps_done = 4;
  a.bytes_up = 123;
  a.step_s = 0.5;
  ASSERT_TRUE(g.leader->Answer(a).ok());
  for (size_t i = 0; i < calls.size(); ++i) {
    auto r = calls[i].get();
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->code, a.code);
    EXPECT_EQ(r->message, "rolled back");
    EXPECT_TRUE(r->rolled_back);
    EXPECT_TRUE(r->failed);
    EXPECT_EQ(r->steps_done, 4u);
    EXPECT_EQ(r->bytes_up, 123u);
    EXPECT_EQ(r->step_s, 0.5);
    EXPECT_EQ(g.followers[i]->params()[d - 1], -static_cast<float>(d - 1));
  }
}

TEST(LocalGroup, AFollowerThatLeavesIsNamed) {
  Group g = Join(Name("leaves"), 3, 64);
  ASSERT_EQ(g.followers.size(), 2u);
  g.followers[1].reset();
  auto got = g.leader->Gather(LocalCall::kStep, 0, absl::Seconds(1));
  // Rank 1 is silent: the wait for it ends first, naming it.
  EXPECT_THAT(got.status().message(), HasSubstr("local rank 1 of this host did not call Step"));
  auto after = g.leader->Gather(LocalCall::kStep, 0, absl::Milliseconds(100));
  EXPECT_FALSE(after.ok());
  Group h = Join(Name("leaves2"), 2, 64);
  h.followers[0].reset();
  auto gone = h.leader->Gather(LocalCall::kStep, 0, absl::Seconds(10));
  EXPECT_THAT(gone.status().message(),
              HasSubstr("local rank 1 of this host left (its connection closed): presumed dead"));
}

TEST(LocalGroup, DifferentCallsAreAnError) {
  Group g = Join(Name("calls"), 2, 64);
  auto call = std::async(std::launch::async, [&] {
    LocalRequest r;
    r.call = LocalCall::kFinish;
    r.step = 3;
    return g.followers[0]->Call(r, absl::Seconds(2));
  });
  auto got = g.leader->Gather(LocalCall::kStep, 3, absl::Seconds(10));
  EXPECT_THAT(got.status().message(),
              HasSubstr("local rank 1 of this host called Finish after 3 steps while local rank 0 "
                        "called Step after 3"));
  g.leader.reset();  // the follower's wait ends: its leader is gone
  EXPECT_THAT(call.get().status().message(), HasSubstr("is gone: its connection closed"));
}

TEST(LocalGroup, AnAbortCarriesItsReason) {
  Group g = Join(Name("abort"), 2, 64);
  g.followers[0]->Abort("out of memory in the backward");
  auto got = g.leader->Gather(LocalCall::kStep, 0, absl::Seconds(10));
  EXPECT_THAT(got.status().message(),
              HasSubstr("local rank 1 of this host aborted: out of memory in the backward"));
}

TEST(LocalGroup, JoiningErrorsNameTheProblem) {
  // No leader: the follower gives up when its time is up.
  auto alone = LocalFollower::Connect(Name("none"), 1, 0, absl::Milliseconds(200));
  EXPECT_THAT(alone.status().message(), HasSubstr("no local rank 0 listened on"));
  // A rank out of range is refused, and fails the leader too.
  const std::string name = Name("range");
  auto bad = std::async(std::launch::async,
                        [&] { return LocalFollower::Connect(name, 5, 0, absl::Seconds(10)); });
  auto leader = LocalLeader::Start(name, 3, 64, "", 0, absl::Seconds(10));
  EXPECT_THAT(leader.status().message(), HasSubstr("local rank 5 is not in [1, 3)"));
  EXPECT_THAT(bad.get().status().message(),
              HasSubstr("local rank 0 refused local rank 5: local rank 5 is not in [1, 3)"));
  // A different d.
  const std::string named = Name("d");
  auto other = std::async(std::launch::async,
                          [&] { return LocalFollower::Connect(named, 1, 65, absl::Seconds(10)); });
  auto l2 = LocalLeader::Start(named, 2, 64, "", 0, absl::Seconds(10));
  EXPECT_THAT(l2.status().message(), HasSubstr("local rank 1 declared d = 65"));
  EXPECT_FALSE(other.get().ok());
  // Missing ranks are listed when the time is up.
  const std::string namem = Name("missing");
  auto one = std::async(std::launch::async,
                        [&] { return LocalFollower::Connect(namem, 2, 0, absl::Seconds(10)); });
  auto l3 = LocalLeader::Start(namem, 4, 64, "", 0, absl::Milliseconds(500));
  EXPECT_THAT(l3.status().message(), HasSubstr("local ranks 1, 3 of this host did not join"));
  // Rank 2 had joined: its first call finds the leader gone.
  auto joined = one.get();
  ASSERT_TRUE(joined.ok()) << joined.status();
  EXPECT_THAT((*joined)->Call(LocalRequest(), absl::Seconds(10)).status().message(),
              HasSubstr("is gone"));
}

TEST(LocalGroup, TwoLeadersOfOneWorkerCannotListen) {
  const std::string name = Name("twice");
  auto f = std::async(std::launch::async,
                      [&] { return LocalFollower::Connect(name, 1, 0, absl::Seconds(10)); });
  auto first = LocalLeader::Start(name, 2, 8, "", 0, absl::Seconds(10));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(f.get().ok());
  // The first closed its listening socket once its group was complete;
  // hold the name with a second group still forming.
  const std::string busy = Name("busy");
  auto forming = std::async(
      std::launch::async, [&] { return LocalLeader::Start(busy, 2, 8, "", 0, absl::Seconds(2)); });
  absl::SleepFor(absl::Milliseconds(300));
  auto second = LocalLeader::Start(busy, 2, 8, "", 0, absl::Seconds(1));
  EXPECT_THAT(second.status().message(),
              HasSubstr("another local rank 0 of this worker runs on this host"));
  EXPECT_FALSE(forming.get().ok());
}

// The abstract socket has no permissions of its own: a process of another
// user is turned away before its hello, and the group waits on for its
// own ranks.
TEST(LocalGroup, AnotherUsersProcessCannotJoin) {
  if (getuid() != 0) GTEST_SKIP() << "needs root to start a process as another user";
  const std::string name = Name("other_user");
  const pid_t child = fork();
  if (child == 0) {
    if (setuid(65534) != 0) _exit(3);  // nobody
    auto f = LocalFollower::Connect(name, 1, 0, absl::Seconds(10));
    // Turned away: the leader closed the connection before or after its
    // hello went out.
    const bool refused =
        !f.ok() && (absl::StrContains(f.status().message(), "closed the connection") ||
                    absl::StrContains(f.status().message(), "is gone"));
    _exit(refused ? 0 : 1);
  }
  ASSERT_GT(child, 0);
  auto leader = LocalLeader::Start(name, 2, 8, "", 0, absl::Seconds(2));
  EXPECT_THAT(leader.status().message(), HasSubstr("local rank 1 of this host did not join"));
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
}

}  // namespace
}  // namespace onebit
