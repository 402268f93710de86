#include "coordinator/stop_protocol.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"

namespace onebit {

void StopProtocol::Begin(std::string who, absl::Time deadline) {
  by_ = std::move(who);
  deadline_ = deadline;
}

bool StopProtocol::Decide(const std::vector<Membership::Process>& workers) {
  if (by_.empty() || step_) return false;
  std::optional<uint64_t> step;
  for (const Membership::Process& w : workers) {
    if (w.done) continue;  // finished: the job ends as it would have
    if (!w.stop_ack) return false;
    step = std::max(step.value_or(0), *w.stop_ack);
  }
  if (!step) return false;
  step_ = step;
  std::fprintf(stderr, "coordinator: every worker heard; the job stops after %llu steps\n",
               static_cast<unsigned long long>(*step));
  return true;
}

std::string StopProtocol::OverdueReason() const {
  return absl::StrCat("stopped by ", by_, ", but the checkpoint to stop at ",
                      step_ ? absl::StrCat("(step ", *step_, ") ")
                            : std::string("(none yet: not every worker answered) "),
                      "was not complete in time; resume from the previous one");
}

std::string StopProtocol::StoppedReason() const {
  return *step_ == 0 ? absl::StrCat(by_, " before the first step; nothing to save")
                     : absl::StrCat(by_, "; the checkpoint of step ", *step_,
                                    " is complete: run the job again to resume it");
}

}  // namespace onebit
