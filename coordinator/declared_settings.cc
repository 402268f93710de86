#include "coordinator/declared_settings.h"

#include <algorithm>
#include <utility>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "job/config.h"
#include "models/registry.h"
#include "net/control.h"

namespace onebit {
namespace {

// Bitwise: every replica must apply the same float.
template <typename Range, typename Value>
bool SameRanges(const std::vector<Range>& a, const std::vector<Range>& b, Value value) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].begin != b[i].begin || a[i].end != b[i].end ||
        absl::bit_cast<uint32_t>(value(a[i])) != absl::bit_cast<uint32_t>(value(b[i]))) {
      return false;
    }
  }
  return true;
}

std::string SettingsTextOf(const std::map<std::string, std::string>& settings) {
  if (settings.empty()) return "none";
  std::vector<std::string> parts;
  for (const auto& [k, v] : settings) parts.push_back(absl::StrCat("--", k, "=", v));
  return absl::StrJoin(parts, " ");
}

}  // namespace

std::string DeclaredSettings::SettingsText() const { return SettingsTextOf(settings_); }

absl::Status DeclaredSettings::Check(uint32_t rank, const control::RegisterRequest& req,
                                     bool formed, const std::set<std::string>& given,
                                     control::TrainingConfig* config) {
  absl::Status st = CheckParams(rank, req.num_params(), config);
  if (st.ok()) st = CheckRanges(rank, req);
  if (st.ok()) st = CheckLayers(rank, req);
  if (st.ok()) st = CheckSettings(rank, req, formed, given, *config);
  if (st.ok()) st = CheckLocalState(rank, req);
  return st;
}

absl::Status DeclaredSettings::CheckParams(uint32_t rank, uint64_t d,
                                           control::TrainingConfig* config) {
  const bool external = config->model().name() == kExternalModel;
  if (d == 0) {
    if (!external) return absl::OkStatus();  // the job's built-in model decides
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank,
                     " declares no parameter count; a --model external job takes d from "
                     "its workers"));
  }
  if (d > kMaxParams) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank, " declares d = ", d, ", above the limit of ", kMaxParams));
  }
  if (!external) {
    if (d == config->model().dim()) return absl::OkStatus();
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank, " declares d = ", d, ", but the job's model (",
                     config->model().name(), ") has d = ", config->model().dim()));
  }
  if (!params_by_) {
    params_by_ = rank;
    config->mutable_model()->set_dim(d);
    return absl::OkStatus();
  }
  if (d == config->model().dim()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("worker ", rank, " declares d = ", d,
                                                 ", but worker ", *params_by_,
                                                 " declared d = ", config->model().dim()));
}

absl::Status DeclaredSettings::CheckRanges(uint32_t rank, const control::RegisterRequest& req) {
  if (!decay_by_) {
    decay_by_ = rank;
    decay_ = DecayRangesOf(req.weight_decay_ranges());
    lr_scale_ = LrScaleRangesOf(req.lr_scale_ranges());
    return absl::OkStatus();
  }
  const std::vector<DecayRange> mine = DecayRangesOf(req.weight_decay_ranges());
  if (!SameRanges(decay_, mine, [](const DecayRange& r) { return r.weight_decay; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank, " declares the weight-decay ranges ", DecayRangesText(mine),
                     ", but worker ", *decay_by_, " declared ", DecayRangesText(decay_)));
  }
  const std::vector<LrScaleRange> scales = LrScaleRangesOf(req.lr_scale_ranges());
  if (!SameRanges(lr_scale_, scales, [](const LrScaleRange& r) { return r.lr_scale; })) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", rank, " declares the lr-scale ranges ", LrScaleRangesText(scales),
                     ", but worker ", *decay_by_, " declared ", LrScaleRangesText(lr_scale_)));
  }
  return absl::OkStatus();
}

absl::Status DeclaredSettings::CheckLayers(uint32_t rank, const control::RegisterRequest& req) {
  const std::vector<uint64_t> mine(req.layer_ends().begin(), req.layer_ends().end());
  if (!layers_by_ || *layers_by_ == rank) {
    layers_by_ = rank;
    layers_ = mine;
    return absl::OkStatus();
  }
  if (mine == layers_) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", rank, " declares ", mine.size(), " tensors ending at [",
                   absl::StrJoin(mine, ", "), "], but worker ", *layers_by_, " declared ",
                   layers_.size(), " ending at [", absl::StrJoin(layers_, ", "), "]"));
}

absl::Status DeclaredSettings::CheckSettings(uint32_t rank, const control::RegisterRequest& req,
                                             bool formed, const std::set<std::string>& given,
                                             const control::TrainingConfig& config) {
  std::map<std::string, std::string> mine(req.settings().begin(), req.settings().end());
  // (After the job formed, the first worker too, registering again.)
  if (decay_by_ && (*decay_by_ != rank || formed)) {
    if (mine == settings_) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("worker ", rank, " declares the settings ",
                                                   SettingsTextOf(mine), ", but worker ",
                                                   *decay_by_, " declared ", SettingsText()));
  }
  // The first worker (CheckRanges has just recorded it).
  settings_ = std::move(mine);
  control::TrainingConfig trial = config;
  std::set<std::string> trial_given = given;
  if (absl::Status st = ApplyDeclaredSettings(settings_, &trial_given, &trial); !st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", rank, ": ", st.message()));
  }
  return absl::OkStatus();
}

absl::Status DeclaredSettings::CheckLocalState(uint32_t rank, const control::RegisterRequest& req) {
  const auto& mine = req.local_state();
  if (!local_state_by_ || *local_state_by_ == rank) {
    local_state_by_ = rank;
    local_state_.assign(mine.begin(), mine.end());
    return absl::OkStatus();
  }
  const uint32_t first = *local_state_by_;
  bool same_names = static_cast<size_t>(mine.size()) == local_state_.size();
  const size_t n = std::min<size_t>(mine.size(), local_state_.size());
  for (size_t i = 0; i < n; ++i) {
    const control::LocalTensor& a = local_state_[i];
    const control::LocalTensor& b = mine[static_cast<int>(i)];
    if (a.name() != b.name()) {  // another model: said below
      same_names = false;
      break;
    }
    if (a.crc32() != b.crc32()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "worker ", rank, "'s ", b.name(), " differs from worker ", first, "'s (CRC-32 ",
          absl::Hex(b.crc32(), absl::kZeroPad8), " against ", absl::Hex(a.crc32(), absl::kZeroPad8),
          "): tensors the job does not train (buffers, frozen parameters) are not broadcast, so "
          "every rank must start them equal (seed torch alike before building the model, or "
          "load the same weights)"));
    }
  }
  if (same_names) return absl::OkStatus();
  auto names = [](auto begin, auto end) {
    std::vector<std::string> v;
    for (auto it = begin; it != end && v.size() < 8; ++it) v.push_back(it->name());
    return absl::StrCat("[", absl::StrJoin(v, ", "), end - begin > 8 ? ", ..." : "", "]");
  };
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", rank, " declares ", mine.size(), " tensors outside the optimizer ",
                   names(mine.begin(), mine.end()), ", but worker ", first, " declared ",
                   local_state_.size(), " ", names(local_state_.begin(), local_state_.end()),
                   ": every rank must build the same model"));
}

}  // namespace onebit
