#include "models/mlp_model.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <thread>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/rng.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

// Random 3x4 images with labels, for nets small enough to check by hand.
std::shared_ptr<const ImageDataset> TinyData(uint32_t n_train, uint32_t n_test, uint64_t seed) {
  SplitMix64 rng(seed);
  auto make = [&](uint32_t n, IdxImages* im, std::vector<uint8_t>* y) {
    im->count = n;
    im->rows = 3;
    im->cols = 4;
    im->pixels.resize(n * 12);
    for (uint8_t& p : im->pixels) p = static_cast<uint8_t>(rng.Uniform(256));
    y->resize(n);
    for (uint8_t& l : *y) l = static_cast<uint8_t>(rng.Uniform(10));
  };
  IdxImages train, test;
  std::vector<uint8_t> ytrain, ytest;
  make(n_train, &train, &ytrain);
  make(n_test, &test, &ytest);
  absl::StatusOr<std::shared_ptr<const ImageDataset>> d =
      ImageDataset::Create(train, ytrain, test, ytest, "tiny");
  EXPECT_TRUE(d.ok()) << d.status();
  return *d;
}

MlpOptions TinyOptions() {
  MlpOptions o;
  o.layers = {12, 7, 5, 10};
  o.batch = 6;
  o.workers = 3;
  o.seed = 5;
  return o;
}

// An independent double-precision forward pass: mean cross-entropy of the
// given examples, and (optionally) how many are classified right.
double ReferenceLoss(const MlpModel& m, const std::vector<double>& x, const float* in,
                     const uint8_t* y, size_t rows, size_t* correct = nullptr) {
  const std::vector<uint32_t>& w = m.options().layers;
  double total = 0;
  if (correct != nullptr) *correct = 0;
  for (size_t i = 0; i < rows; ++i) {
    std::vector<double> a(in + i * w[0], in + (i + 1) * w[0]);
    for (size_t l = 0; l + 1 < w.size(); ++l) {
      std::vector<double> z(w[l + 1]);
      for (uint32_t o = 0; o < w[l + 1]; ++o) {
        double s = x[m.bias_offset(l) + o];
        for (uint32_t k = 0; k < w[l]; ++k) s += x[m.weight_offset(l) + o * w[l] + k] * a[k];
        z[o] = (l + 2 < w.size()) ? std::max(s, 0.0) : s;
      }
      a = std::move(z);
    }
    double mx = a[0];
    size_t arg = 0;
    for (size_t k = 1; k < a.size(); ++k) {
      if (a[k] > mx) mx = a[k], arg = k;
    }
    double sum = 0;
    for (double v : a) sum += std::exp(v - mx);
    total += mx + std::log(sum) - a[y[i]];
    if (correct != nullptr) *correct += arg == y[i];
  }
  return total / rows;
}

TEST(MlpModelTest, LayoutOfTheDefaultNet) {
  IdxImages im;
  im.count = 64;
  im.rows = im.cols = 28;
  im.pixels.assign(64 * 784, 0);
  auto d = ImageDataset::Create(im, std::vector<uint8_t>(64, 1), im, std::vector<uint8_t>(64, 2));
  ASSERT_TRUE(d.ok());
  absl::StatusOr<std::unique_ptr<MlpModel>> m = MlpModel::Create(MlpOptions(), *d);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->num_params(), 784u * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10);
  EXPECT_EQ((*m)->num_layers(), 3u);
  EXPECT_EQ((*m)->weight_offset(0), 0u);
  EXPECT_EQ((*m)->bias_offset(0), 784u * 256);
  EXPECT_EQ((*m)->weight_offset(1), 784u * 256 + 256);
  EXPECT_EQ((*m)->bias_offset(2), (*m)->num_params() - 10);
  EXPECT_EQ((*m)->steps_per_epoch(), 1u);
}

TEST(MlpModelTest, InitIsSeededHeUniformWithZeroBias) {
  auto data = TinyData(40, 10, 1);
  MlpOptions o = TinyOptions();
  o.layers = {12, 300, 10};
  auto a = MlpModel::Create(o, data);
  auto b = MlpModel::Create(o, data);
  o.seed = 6;
  auto c = MlpModel::Create(o, data);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  const size_t d = (*a)->num_params();
  std::vector<float> xa(d), xb(d), xc(d);
  (*a)->Init(xa.data());
  (*b)->Init(xb.data());
  (*c)->Init(xc.data());
  EXPECT_EQ(xa, xb);
  EXPECT_NE(xa, xc);
  for (size_t l = 0; l < 2; ++l) {
    const double fan_in = o.layers[l];
    const double bound = std::sqrt(6.0 / fan_in);
    const size_t nw = o.layers[l] * o.layers[l + 1];
    double sum = 0, sq = 0;
    for (size_t j = 0; j < nw; ++j) {
      const double w = xa[(*a)->weight_offset(l) + j];
      ASSERT_LE(std::abs(w), bound);
      sum += w;
      sq += w * w;
    }
    // U(-a, a) has variance a²/3 = 2/fan_in (He).
    EXPECT_NEAR(sum / nw, 0.0, 0.1 * bound);
    EXPECT_NEAR(sq / nw, 2.0 / fan_in, 0.1 * 2.0 / fan_in);
    for (uint32_t k = 0; k < o.layers[l + 1]; ++k) EXPECT_EQ(xa[(*a)->bias_offset(l) + k], 0.0f);
  }
}

// Central differences of the double reference loss against the model's fp32
// gradient, on a few coordinates of every W and b. Tolerance: 2e-4 absolute
// plus 1e-3 relative (fp32 accumulation over a 6-example batch, while the
// double differences are accurate to ~1e-9).
TEST(MlpModelTest, GradientMatchesFiniteDifferences) {
  auto data = TinyData(40, 10, 2);
  const MlpOptions o = TinyOptions();
  auto m = MlpModel::Create(o, data);
  ASSERT_TRUE(m.ok()) << m.status();
  const MlpModel& model = **m;
  const size_t d = model.num_params();
  std::vector<float> x(d), g(d);
  model.Init(x.data());
  SplitMix64 rng(77);
  for (float& v : x) v += static_cast<float>(0.2 * (rng.UniformDouble() - 0.5));  // nonzero biases
  for (uint32_t rank : {0u, 2u}) {
    const uint64_t step = 4;  // epoch 1 of 2 steps each
    absl::StatusOr<double> loss = model.Gradient(x.data(), rank, step, g.data());
    ASSERT_TRUE(loss.ok()) << loss.status();

    std::vector<uint32_t> idx(o.batch);
    ASSERT_TRUE(model.sampler().BatchIndices(rank, step, idx.data()).ok());
    std::vector<float> in(o.batch * 12);
    std::vector<uint8_t> y(o.batch);
    model.dataset().GatherTrain(idx.data(), o.batch, in.data(), y.data());
    std::vector<double> xd(x.begin(), x.end());
    EXPECT_NEAR(*loss, ReferenceLoss(model, xd, in.data(), y.data(), o.batch), 1e-5);

    int checked = 0;
    for (size_t l = 0; l < model.num_layers(); ++l) {
      const uint64_t nw = uint64_t{o.layers[l]} * o.layers[l + 1];
      for (int t = 0; t < 6; ++t) {
        const bool bias = t % 2 == 1;
        const uint64_t j = bias ? model.bias_offset(l) + rng.Uniform(o.layers[l + 1])
                                : model.weight_offset(l) + rng.Uniform(nw);
        const double h = 1e-5;
        std::vector<double> xp = xd, xm = xd;
        xp[j] += h;
        xm[j] -= h;
        const double fd = (ReferenceLoss(model, xp, in.data(), y.data(), o.batch) -
                           ReferenceLoss(model, xm, in.data(), y.data(), o.batch)) /
                          (2 * h);
        EXPECT_NEAR(g[j], fd, 2e-4 + 1e-3 * std::abs(fd))
            << "rank " << rank << " layer " << l << (bias ? " b" : " W") << " index " << j;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 18);
  }
}

TEST(MlpModelTest, GradientIsDeterministicPerRankAndStep) {
  auto data = TinyData(40, 10, 3);
  auto a = MlpModel::Create(TinyOptions(), data);
  auto b = MlpModel::Create(TinyOptions(), data);
  ASSERT_TRUE(a.ok() && b.ok());
  const size_t d = (*a)->num_params();
  std::vector<float> x(d), g1(d), g2(d), g3(d);
  (*a)->Init(x.data());
  ASSERT_TRUE((*a)->Gradient(x.data(), 1, 9, g1.data()).ok());
  ASSERT_TRUE((*b)->Gradient(x.data(), 1, 9, g2.data()).ok());
  EXPECT_EQ(g1, g2);
  ASSERT_TRUE((*a)->Gradient(x.data(), 2, 9, g3.data()).ok());
  EXPECT_NE(g1, g3);
  ASSERT_TRUE((*a)->Gradient(x.data(), 1, 9, g3.data()).ok());
  EXPECT_EQ(g1, g3);
}

// The layer-by-layer release: the same gradient and loss as Gradient, bit
// for bit; each layer's W and b released once, from the output layer down,
// already holding their final values.
TEST(MlpModelTest, GradientInPartsReleasesEachLayerLastFirstWithItsFinalValues) {
  auto data = TinyData(40, 10, 3);
  auto m = MlpModel::Create(TinyOptions(), data);
  ASSERT_TRUE(m.ok());
  const size_t d = (*m)->num_params();
  std::vector<float> x(d), whole(d), parts(d, -7.0f);
  (*m)->Init(x.data());
  absl::StatusOr<double> loss = (*m)->Gradient(x.data(), 2, 4, whole.data());
  ASSERT_TRUE(loss.ok());
  std::vector<std::pair<uint64_t, uint64_t>> released;
  std::vector<std::vector<float>> at_release;
  absl::StatusOr<double> loss2 =
      (*m)->GradientInParts(x.data(), 2, 4, parts.data(), [&](uint64_t b, uint64_t e) {
        released.emplace_back(b, e);
        at_release.emplace_back(parts.begin() + b, parts.begin() + e);
        return absl::OkStatus();
      });
  ASSERT_TRUE(loss2.ok()) << loss2.status();
  EXPECT_EQ(*loss, *loss2);
  EXPECT_EQ(whole, parts);
  // 12-7-5-10: W0 84 + b0 7, W1 35 + b1 5, W2 50 + b2 10; the last layer first.
  const std::vector<std::pair<uint64_t, uint64_t>> want = {{131, 191}, {91, 131}, {0, 91}};
  EXPECT_EQ(released, want);
  ASSERT_EQ(at_release.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(at_release[i],
              std::vector<float>(whole.begin() + want[i].first, whole.begin() + want[i].second))
        << "range " << i;
  }
}

TEST(MlpModelTest, AFailedReleaseStopsTheBackwardWithItsError) {
  auto data = TinyData(40, 10, 3);
  auto m = MlpModel::Create(TinyOptions(), data);
  ASSERT_TRUE(m.ok());
  const size_t d = (*m)->num_params();
  std::vector<float> x(d), g(d);
  (*m)->Init(x.data());
  int calls = 0;
  absl::StatusOr<double> loss =
      (*m)->GradientInParts(x.data(), 0, 0, g.data(), [&](uint64_t, uint64_t) {
        ++calls;
        return absl::UnavailableError("server 1 went away");
      });
  EXPECT_EQ(calls, 1);
  ASSERT_FALSE(loss.ok());
  EXPECT_EQ(loss.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(loss.status().message(), HasSubstr("server 1 went away"));
}

// A non-finite parameter shows in the loss, which is checked before the
// first release: nothing non-finite goes out.
TEST(MlpModelTest, ANonFiniteLossReleasesNothing) {
  auto data = TinyData(40, 10, 7);
  auto m = MlpModel::Create(TinyOptions(), data);
  ASSERT_TRUE(m.ok());
  std::vector<float> x((*m)->num_params()), g(x.size());
  (*m)->Init(x.data());
  x[(*m)->bias_offset(1)] = std::nanf("");
  int calls = 0;
  absl::StatusOr<double> loss =
      (*m)->GradientInParts(x.data(), 1, 3, g.data(), [&](uint64_t, uint64_t) {
        ++calls;
        return absl::OkStatus();
      });
  ASSERT_FALSE(loss.ok());
  EXPECT_THAT(loss.status().message(), HasSubstr("not finite"));
  EXPECT_THAT(loss.status().message(), HasSubstr("rank 1 step 3"));
  EXPECT_EQ(calls, 0);
}

TEST(MlpModelTest, ConcurrentCallsGiveTheSequentialResults) {
  auto data = TinyData(90, 25, 4);
  MlpOptions o = TinyOptions();
  o.eval_batch = 7;
  auto m = MlpModel::Create(o, data);
  ASSERT_TRUE(m.ok());
  const MlpModel& model = **m;
  const size_t d = model.num_params();
  std::vector<float> x(d);
  model.Init(x.data());
  std::vector<std::vector<float>> want(8, std::vector<float>(d)), got = want;
  for (int s = 0; s < 8; ++s) ASSERT_TRUE(model.Gradient(x.data(), s % 3, s, want[s].data()).ok());
  const absl::StatusOr<EvalResult> eval = model.Evaluate(x.data());
  ASSERT_TRUE(eval.ok());
  std::vector<std::thread> threads;
  std::vector<int> ok(8, 0);
  for (int s = 0; s < 8; ++s) {
    threads.emplace_back([&, s] {
      for (int rep = 0; rep < 20; ++rep) {
        ok[s] += model.Gradient(x.data(), s % 3, s, got[s].data()).ok();
        absl::StatusOr<EvalResult> e = model.Evaluate(x.data());
        ok[s] += e.ok() && e->loss == eval->loss;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(ok, std::vector<int>(8, 40));
  EXPECT_EQ(got, want);
}

TEST(MlpModelTest, EvaluateMatchesTheReference) {
  auto data = TinyData(40, 23, 5);
  MlpOptions o = TinyOptions();
  o.eval_batch = 7;  // does not divide 23
  auto m = MlpModel::Create(o, data);
  ASSERT_TRUE(m.ok());
  std::vector<float> x((*m)->num_params());
  (*m)->Init(x.data());
  absl::StatusOr<EvalResult> r = (*m)->Evaluate(x.data());
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<float> in(23 * 12);
  std::vector<uint8_t> y(23);
  data->GatherTest(0, 23, in.data(), y.data());
  size_t correct = 0;
  const double loss = ReferenceLoss(**m, std::vector<double>(x.begin(), x.end()), in.data(),
                                    y.data(), 23, &correct);
  EXPECT_EQ(r->examples, 23u);
  EXPECT_NEAR(r->loss, loss, 1e-5);
  EXPECT_DOUBLE_EQ(r->accuracy, correct / 23.0);
}

TEST(MlpModelTest, HugeLogitsStayFinite) {
  // log-sum-exp: logits of 1e4 would overflow a naive exp.
  auto data = TinyData(40, 10, 6);
  auto m = MlpModel::Create(TinyOptions(), data);
  ASSERT_TRUE(m.ok());
  std::vector<float> x((*m)->num_params()), g(x.size());
  (*m)->Init(x.data());
  const uint64_t b2 = (*m)->bias_offset(2);
  x[b2 + 3] = 1e4f;
  absl::StatusOr<double> loss = (*m)->Gradient(x.data(), 0, 0, g.data());
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_GT(*loss, 1e3);  // unless every label is 3
  EXPECT_TRUE(std::isfinite(*loss));
}

TEST(MlpModelTest, NonFiniteParametersAreAnError) {
  auto data = TinyData(40, 10, 7);
  auto m = MlpModel::Create(TinyOptions(), data);
  ASSERT_TRUE(m.ok());
  std::vector<float> x((*m)->num_params()), g(x.size());
  (*m)->Init(x.data());
  x[(*m)->bias_offset(1)] = std::nanf("");
  absl::StatusOr<double> loss = (*m)->Gradient(x.data(), 1, 3, g.data());
  ASSERT_FALSE(loss.ok());
  EXPECT_THAT(loss.status().message(), HasSubstr("not finite"));
  EXPECT_THAT(loss.status().message(), HasSubstr("rank 1 step 3"));
  EXPECT_FALSE((*m)->Evaluate(x.data()).ok());
}

TEST(MlpModelTest, RejectsBadOptions) {
  auto data = TinyData(40, 10, 8);
  MlpOptions o = TinyOptions();
  o.layers = {13, 5, 10};
  auto m = MlpModel::Create(o, data);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("images have 12 pixels"));
  o.layers = {12, 5, 9};
  EXPECT_THAT(MlpModel::Create(o, data).status().message(), HasSubstr("10 classes"));
  o.layers = {12};
  EXPECT_FALSE(MlpModel::Create(o, data).ok());
  o.layers = {12, 0, 10};
  EXPECT_THAT(MlpModel::Create(o, data).status().message(), HasSubstr("zero width"));
  o = TinyOptions();
  o.workers = 7;  // 7 * 6 > 40
  EXPECT_THAT(MlpModel::Create(o, data).status().message(), HasSubstr("exceed"));
  o = TinyOptions();
  m = MlpModel::Create(o, data);
  ASSERT_TRUE(m.ok());
  std::vector<float> x((*m)->num_params()), g(x.size());
  EXPECT_THAT((*m)->Gradient(x.data(), 3, 0, g.data()).status().message(),
              HasSubstr("rank 3 is not below the 3 workers"));
}

TEST(MlpModelTest, ParsesLayerSpecs) {
  EXPECT_THAT(ParseLayers("784-256-128-10").value(), ::testing::ElementsAre(784, 256, 128, 10));
  EXPECT_THAT(ParseLayers("12,10").value(), ::testing::ElementsAre(12, 10));
  for (const char* bad : {"", "784", "784--10", "784-0-10", "784-a-10", "784-256-", "-1-10"}) {
    absl::StatusOr<std::vector<uint32_t>> l = ParseLayers(bad);
    EXPECT_FALSE(l.ok()) << bad;
    EXPECT_THAT(l.status().message(), HasSubstr(std::string("'") + bad + "'")) << bad;
  }
}

TEST(MlpModelTest, MissingDataDirectoryIsNamed) {
  MlpOptions o;
  o.data_dir = "/nonexistent/onebit-fmnist";
  absl::StatusOr<std::unique_ptr<MlpModel>> m = NewMlpModel(o);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(m.status().message(), HasSubstr("/nonexistent/onebit-fmnist"));
}

// The default 784-256-128-10 net, trained with Adam (written here) on the
// first 2000 training images, must clearly beat chance on 1000 test images.
// Also times one gradient step at batch 64 on one BLAS thread.
TEST(MlpModelTest, TrainsOnARealSubset) {
  MlpOptions o;
  o.max_train = 2000;
  o.max_test = 1000;
  o.batch = 64;
  o.workers = 1;
  o.seed = 3;
  absl::StatusOr<std::unique_ptr<MlpModel>> m = NewMlpModel(o);
  ASSERT_TRUE(m.ok()) << m.status();
  const MlpModel& model = **m;
  ASSERT_EQ(model.steps_per_epoch(), 31u);
  const size_t d = model.num_params();
  std::vector<float> x(d), g(d), mom(d, 0.0f), var(d, 0.0f);
  model.Init(x.data());
  absl::StatusOr<EvalResult> before = model.Evaluate(x.data());
  ASSERT_TRUE(before.ok());

  const int steps = 300;
  const float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  double first = 0, last = 0, grad_s = 0;
  for (int t = 0; t < steps; ++t) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<double> loss = model.Gradient(x.data(), 0, t, g.data());
    grad_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ASSERT_TRUE(loss.ok()) << loss.status();
    if (t < 20) first += *loss / 20;
    if (t >= steps - 20) last += *loss / 20;
    const float c1 = 1.0f - std::pow(b1, t + 1), c2 = 1.0f - std::pow(b2, t + 1);
    for (size_t j = 0; j < d; ++j) {
      mom[j] = b1 * mom[j] + (1 - b1) * g[j];
      var[j] = b2 * var[j] + (1 - b2) * g[j] * g[j];
      x[j] -= lr * (mom[j] / c1) / (std::sqrt(var[j] / c2) + eps);
    }
  }
  absl::StatusOr<EvalResult> after = model.Evaluate(x.data());
  ASSERT_TRUE(after.ok());
  std::printf(
      "mlp 784-256-128-10, 2000 train images, %d Adam steps at batch 64: train loss %.3f -> "
      "%.3f; test (1000) loss %.3f -> %.3f, accuracy %.3f -> %.3f; gradient step %.3f ms\n",
      steps, first, last, before->loss, after->loss, before->accuracy, after->accuracy,
      1e3 * grad_s / steps);
  EXPECT_LT(last, 0.5 * first);
  EXPECT_LT(after->loss, 0.6 * before->loss);
  EXPECT_GT(after->accuracy, 0.7);  // chance is 0.1
}

}  // namespace
}  // namespace onebit
