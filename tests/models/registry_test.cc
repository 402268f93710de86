// The model registry (models/registry.h): every entry's d and epoch agree
// with the model it builds, unknown names and undeclared options are refused
// naming them, and the defaults are filled in.
#include "models/registry.h"

#include <sys/stat.h>

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "models/dataset.h"

namespace onebit {
namespace {

using ::testing::HasSubstr;

bool HaveFashionMnist() {
  struct stat st;
  return stat((std::string(kDefaultFashionMnistDir) + "/train-images-idx3-ubyte.gz").c_str(),
              &st) == 0;
}

// A small job of `model`: the data-set models on slices of Fashion-MNIST.
control::TrainingConfig SmallJob(const std::string& model) {
  control::TrainingConfig c;
  c.mutable_model()->set_name(model);
  c.mutable_cluster()->set_workers(3);
  c.mutable_model()->set_seed(5);
  c.mutable_model()->set_dim(1001);  // synthetic
  c.mutable_model()->set_layers("784-16-10");
  c.mutable_model()->set_batch(16);
  c.mutable_model()->set_data_dir(kDefaultFashionMnistDir);
  c.mutable_model()->set_max_train(500);
  c.mutable_model()->set_max_test(50);
  c.mutable_model()->set_blas_threads(1);
  if (model == "softmax") {
    (*c.mutable_model()->mutable_options())["batch"] = "20";
    (*c.mutable_model()->mutable_options())["max_train"] = "700";
    (*c.mutable_model()->mutable_options())["max_test"] = "40";
  }
  return c;
}

TEST(Registry, NamesAndOptionsAreUniqueAndTheEntriesComplete) {
  std::set<std::string> names;
  for (const ModelEntry* m : RegisteredModels()) {
    EXPECT_TRUE(names.insert(m->name).second) << m->name;
    EXPECT_NE(std::string(m->name), kExternalModel);
    EXPECT_EQ(FindModel(m->name), m);
    EXPECT_NE(std::string(m->help), "") << m->name;
    EXPECT_NE(m->num_params, nullptr) << m->name;
    EXPECT_NE(m->make, nullptr) << m->name;
    std::set<std::string> options;
    for (const ModelOption& o : m->options) {
      EXPECT_TRUE(options.insert(o.name).second) << m->name << " " << o.name;
      EXPECT_NE(std::string(o.help), "") << m->name << " " << o.name;
    }
  }
  EXPECT_THAT(names, ::testing::IsSupersetOf({"synthetic", "mlp", "softmax"}));
  EXPECT_EQ(FindModel(kExternalModel), nullptr);
  EXPECT_EQ(FindModel("nope"), nullptr);
}

TEST(Registry, EveryModelsParamCountAndEpochAreThoseOfTheModelItBuilds) {
  if (!HaveFashionMnist()) GTEST_SKIP() << "no Fashion-MNIST in " << kDefaultFashionMnistDir;
  for (const ModelEntry* m : RegisteredModels()) {
    control::TrainingConfig c = SmallJob(m->name);
    ASSERT_TRUE(ResolveModelOptions(&c).ok()) << m->name;
    ASSERT_TRUE(ValidateModelConfig(c).ok()) << m->name << ": " << ValidateModelConfig(c);
    absl::StatusOr<uint64_t> d = m->num_params(c);
    ASSERT_TRUE(d.ok()) << m->name << ": " << d.status();
    absl::StatusOr<std::unique_ptr<Model>> model = NewModel(c);
    ASSERT_TRUE(model.ok()) << m->name << ": " << model.status();
    EXPECT_EQ((*model)->num_params(), *d) << m->name;
    if (m->epoch_steps == nullptr) {
      EXPECT_EQ((*model)->steps_per_epoch(), 0u) << m->name;
    } else {
      absl::StatusOr<uint64_t> steps = m->epoch_steps(c);
      ASSERT_TRUE(steps.ok()) << m->name << ": " << steps.status();
      EXPECT_EQ((*model)->steps_per_epoch(), *steps) << m->name;
    }
  }
  // The figures themselves, for the record.
  control::TrainingConfig s = SmallJob("softmax");
  EXPECT_EQ(*FindModel("softmax")->num_params(s), 7850u);  // 784·10 + 10
  EXPECT_EQ(*FindModel("softmax")->epoch_steps(s), 11u);   // 700 / (3 × 20)
  EXPECT_EQ(*FindModel("mlp")->num_params(SmallJob("mlp")), 12730u);
  EXPECT_EQ(*FindModel("synthetic")->num_params(SmallJob("synthetic")), 1001u);
}

TEST(Registry, AnUnknownModelIsRefusedListingTheRegisteredOnes) {
  control::TrainingConfig c = SmallJob("resnet");
  for (const absl::Status& st : {ValidateModelConfig(c), NewModel(c).status()}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    const std::string m(st.message());
    EXPECT_THAT(m, HasSubstr("--model: unknown model 'resnet'"));
    for (const ModelEntry* e : RegisteredModels()) EXPECT_THAT(m, HasSubstr(e->name));
    EXPECT_THAT(m, HasSubstr(kExternalModel));
  }
  // Resolution leaves it to validation.
  EXPECT_TRUE(ResolveModelOptions(&c).ok());
}

TEST(Registry, AnUndeclaredOptionIsRefusedNamingItAndTheModel) {
  control::TrainingConfig c = SmallJob("softmax");
  (*c.mutable_model()->mutable_options())["colour"] = "red";
  for (const absl::Status& st : {ResolveModelOptions(&c), ValidateModelConfig(c)}) {
    EXPECT_THAT(std::string(st.message()),
                HasSubstr("--model_options: model softmax has no option 'colour'"));
    EXPECT_THAT(std::string(st.message()), HasSubstr("batch, data_dir, max_train, max_test"));
  }
  // mlp's settings are flags of their own, not options.
  control::TrainingConfig m = SmallJob("mlp");
  (*m.mutable_model()->mutable_options())["batch"] = "8";
  EXPECT_THAT(std::string(ValidateModelConfig(m).message()),
              HasSubstr("--model_options: model mlp has no option 'batch' (its options: none)"));
  control::TrainingConfig e = SmallJob(kExternalModel);
  EXPECT_TRUE(ValidateModelConfig(e).ok());
  (*e.mutable_model()->mutable_options())["x"] = "1";
  EXPECT_THAT(std::string(ValidateModelConfig(e).message()),
              HasSubstr("model external has no option 'x'"));
}

TEST(Registry, ResolvingFillsInTheDefaultsAndKeepsWhatWasGiven) {
  control::TrainingConfig c = SmallJob("softmax");
  c.mutable_model()->mutable_options()->erase("max_test");
  ASSERT_TRUE(ResolveModelOptions(&c).ok());
  const auto& o = c.model().options();
  ASSERT_EQ(o.size(), FindModel("softmax")->options.size());
  EXPECT_EQ(o.at("batch"), "20");
  EXPECT_EQ(o.at("max_train"), "700");
  EXPECT_EQ(o.at("max_test"), "0");
  EXPECT_EQ(o.at("data_dir"), kDefaultFashionMnistDir);
  const control::TrainingConfig once = c;
  ASSERT_TRUE(ResolveModelOptions(&c).ok());  // idempotent
  EXPECT_EQ(c.model().options().size(), once.model().options().size());
  // An option read before resolution gives its default.
  control::TrainingConfig bare;
  bare.mutable_model()->set_name("softmax");
  EXPECT_EQ(ModelOptionValue(bare, "batch"), "64");
  // Models without options get none.
  control::TrainingConfig s = SmallJob("synthetic");
  ASSERT_TRUE(ResolveModelOptions(&s).ok());
  EXPECT_TRUE(s.model().options().empty());
}

TEST(Registry, BadOptionValuesAreNamed) {
  struct Case {
    const char* option;
    const char* value;
    const char* expect;
  };
  for (const Case& k : {Case{"batch", "0", "--model_options: softmax: batch: '0' is not"},
                        Case{"batch", "many", "--model_options: softmax: batch: 'many'"},
                        Case{"max_train", "-1", "--model_options: softmax: max_train:"},
                        Case{"max_test", "x", "--model_options: softmax: max_test:"},
                        Case{"data_dir", "", "--model_options: softmax: data_dir: empty"},
                        Case{"batch", "300", "3 workers x batch 300 exceed the 700"}}) {
    control::TrainingConfig c = SmallJob("softmax");
    (*c.mutable_model()->mutable_options())[k.option] = k.value;
    EXPECT_THAT(std::string(ValidateModelConfig(c).message()), HasSubstr(k.expect))
        << k.option << "=" << k.value;
  }
  control::TrainingConfig m = SmallJob("mlp");
  m.mutable_model()->set_layers("784");
  EXPECT_THAT(std::string(ValidateModelConfig(m).message()), HasSubstr("--layers: "));
  control::TrainingConfig s = SmallJob("synthetic");
  s.mutable_model()->set_noise(-1);
  EXPECT_THAT(std::string(ValidateModelConfig(s).message()), HasSubstr("--noise: "));
}

}  // namespace
}  // namespace onebit
