// Tuner tables: keyed by GPU, compute capability, SM count and config list; driver, runtime and
// fp4moe versions are provenance (reported, never a reason to skip); configs missing from the build are
// skipped with a note; the older fp4moe-tune/1 format is still read; the shipped H200 tables serve an
// H200 whatever its driver and runtime (CPU only).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "fp4moe/config.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/tile_config.hpp"
#include "fp4moe/tuner.hpp"

namespace fp4moe {
namespace {

bool has_note(const TuneLookup& l, const std::string& text) {
  for (const auto& n : l.notes)
    if (n.find(text) != std::string::npos) return true;
  return false;
}

class TuneTables : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("fp4moe_tune_test_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
    key_.gpu = "Test GPU";
    key_.cc = "9.0";
    key_.sms = 132;
    key_.cuda_runtime = 13000;
    key_.cuda_driver = 13000;
    problem_.experts = 256;
    problem_.top_k = 8;
    problem_.n = 4096;
    problem_.k = 6144;
    problem_.epilogue = GemmEpilogue::kSwiGLU;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& name, const std::string& text) {
    const auto p = dir_ / name;
    std::ofstream(p) << text;
    return p.string();
  }
  // Buckets 1, 32, 512 whose winners are kGemmConfigs[0], [1], [2]; each bucket also times [3] and [4].
  nlohmann::json valid_doc(const TuneKey& key) {
    nlohmann::json doc;
    doc["format"] = "fp4moe-tune/2";
    doc["key"] = key.key_json();
    doc["provenance"] = key.provenance_json();
    nlohmann::json entry;
    entry["problem_key"] = problem_.key();
    entry["buckets"] = nlohmann::json::array();
    const TileConfig picks[] = {kGemmConfigs[0], kGemmConfigs[1], kGemmConfigs[2]};
    const int64_t tokens[] = {1, 32, 512};
    for (int i = 0; i < 3; ++i) {
      nlohmann::json timings = nlohmann::json::array();
      timings.push_back({{"config", picks[i].name()}, {"cfg", tile_config_to_json(picks[i])}, {"median_us", 10.0}});
      timings.push_back({{"config", kGemmConfigs[4].name()}, {"cfg", tile_config_to_json(kGemmConfigs[4])},
                         {"median_us", 12.0}});
      timings.push_back({{"config", kGemmConfigs[3].name()}, {"cfg", tile_config_to_json(kGemmConfigs[3])},
                         {"median_us", 11.0}});
      entry["buckets"].push_back({{"tokens", tokens[i]}, {"best", tile_config_to_json(picks[i])}, {"timings", timings}});
    }
    doc["entries"] = nlohmann::json::array({entry});
    return doc;
  }
  std::filesystem::path dir_;
  TuneKey key_;
  TuneProblem problem_;
};

TEST_F(TuneTables, ConfigListIdNamesTheBuildsList) {
  const std::string id = gemm_config_list_id();
  EXPECT_EQ(id.rfind(std::to_string(kNumGemmConfigs) + ":", 0), 0u) << id;
  EXPECT_EQ(id.size(), std::to_string(kNumGemmConfigs).size() + 1 + 16) << id;
  EXPECT_EQ(TuneKey{}.config_list, id);
}

TEST_F(TuneTables, ValidTableGivesTheTunedConfigPerBucket) {
  const std::string path = write("t.json", valid_doc(key_).dump());
  const TuneLookup l = lookup_tuned_config(problem_, 100, key_, path);
  ASSERT_TRUE(l.config.has_value()) << l.reason;
  EXPECT_EQ(*l.config, kGemmConfigs[1]);  // 100 runs at point 96, nearer 32 than 512 on a log scale
  EXPECT_EQ(l.bucket, 32);
  EXPECT_NE(l.reason.find("nearest"), std::string::npos) << l.reason;
  // 200 runs at point 192: 192 / 32 = 6 > 512 / 192, so the T = 512 bucket serves it
  EXPECT_EQ(lookup_tuned_config(problem_, 200, key_, path).bucket, 512);
  EXPECT_EQ(l.table, path);
  EXPECT_EQ(l.source, "tuned table " + path);
  EXPECT_TRUE(l.notes.empty()) << l.reason;
  EXPECT_EQ(*lookup_tuned_config(problem_, 4096, key_, path).config, kGemmConfigs[2]);
  EXPECT_EQ(*lookup_tuned_config(problem_, 1, key_, path).config, kGemmConfigs[0]);
  // Another problem is not in the table.
  TuneProblem other = problem_;
  other.k = 2048;
  testing::internal::CaptureStderr();
  EXPECT_FALSE(lookup_tuned_config(other, 32, key_, path).config.has_value());
  testing::internal::GetCapturedStderr();
}

TEST_F(TuneTables, ProvenanceDiffersTheTableIsStillUsedAndSaysHow) {
  TuneKey table = key_;
  table.cuda_driver = 12080;
  table.cuda_runtime = 12080;
  table.fp4moe_version = "0.0.9";
  const std::string path = write("older.json", valid_doc(table).dump());
  const TuneLookup l = lookup_tuned_config(problem_, 32, key_, path);
  ASSERT_TRUE(l.config.has_value()) << l.reason;
  EXPECT_EQ(*l.config, kGemmConfigs[1]);
  EXPECT_TRUE(has_note(l, "provenance differs")) << l.reason;
  EXPECT_TRUE(has_note(l, "CUDA runtime 12080 (this process 13000)")) << l.reason;
  EXPECT_TRUE(has_note(l, "driver 12080 (this process 13000)")) << l.reason;
  EXPECT_TRUE(has_note(l, "fp4moe 0.0.9 (this process " FP4MOE_VERSION ")")) << l.reason;
  EXPECT_NE(l.reason.find("provenance differs"), std::string::npos) << l.reason;
}

TEST_F(TuneTables, AnotherGpuCcOrSmCountIsNotUsed) {
  struct Case {
    TuneKey k;
    const char* why;
  } cases[] = {{key_, "measured on Other GPU"}, {key_, "cc 10.0"}, {key_, "measured on 114 SMs"}};
  cases[0].k.gpu = "Other GPU";
  cases[1].k.cc = "10.0";
  cases[2].k.sms = 114;
  for (const Case& c : cases) {
    const std::string path = write("foreign.json", valid_doc(c.k).dump());
    testing::internal::CaptureStderr();
    const TuneLookup l = lookup_tuned_config(problem_, 32, key_, path);
    testing::internal::GetCapturedStderr();
    EXPECT_FALSE(l.config.has_value()) << c.why;
    EXPECT_EQ(l.source, "heuristic");
    EXPECT_NE(l.reason.find(c.why), std::string::npos) << l.reason;
  }
}

TEST_F(TuneTables, AnotherConfigListServesWithANoteAndTheBuildsListIsPreferred) {
  TuneKey older = key_;
  older.config_list = "3:0123456789abcdef";
  nlohmann::json old_doc = valid_doc(older);
  old_doc["entries"][0]["buckets"][1]["best"] = tile_config_to_json(kGemmConfigs[3]);
  const std::string old_path = write("a-older-list.json", old_doc.dump());
  const TuneLookup l = lookup_tuned_config(problem_, 32, key_, old_path);
  ASSERT_TRUE(l.config.has_value()) << l.reason;
  EXPECT_EQ(*l.config, kGemmConfigs[3]);
  EXPECT_TRUE(has_note(l, "measured over config list 3:0123456789abcdef")) << l.reason;
  // In a directory, the table of this build's list wins although it sorts later.
  write("b-this-list.json", valid_doc(key_).dump());
  const TuneLookup d = lookup_tuned_config(problem_, 32, key_, dir_.string());
  ASSERT_TRUE(d.config.has_value()) << d.reason;
  EXPECT_EQ(*d.config, kGemmConfigs[1]);
  EXPECT_NE(d.table.find("b-this-list.json"), std::string::npos) << d.table;
}

TEST_F(TuneTables, DirectoryOfTablesForManyGpus) {
  TuneKey other = key_;
  other.gpu = "Another GPU";
  write("another.json", valid_doc(other).dump());
  write("broken.json", "{\"format\": \"fp4moe-tune/2\", \"key\": {}, \"entries\": []}");
  write("ours.json", valid_doc(key_).dump());
  testing::internal::CaptureStderr();
  const TuneLookup l = lookup_tuned_config(problem_, 40, key_, dir_.string());
  testing::internal::GetCapturedStderr();
  ASSERT_TRUE(l.config.has_value()) << l.reason;
  EXPECT_EQ(*l.config, kGemmConfigs[1]);
  EXPECT_NE(l.table.find("ours.json"), std::string::npos);
}

TEST_F(TuneTables, ConfigNotInTheBuildIsSkippedForTheFastestMeasuredOneThatIs) {
  nlohmann::json doc = valid_doc(key_);
  const TileConfig gone{128, 48, 128, 3, 8};
  doc["entries"][0]["buckets"][1]["best"] = tile_config_to_json(gone);
  doc["entries"][0]["buckets"][1]["timings"][0] = {{"config", gone.name()}, {"cfg", tile_config_to_json(gone)},
                                                   {"median_us", 9.0}};
  const std::string path = write("uncompiled.json", doc.dump());
  const TuneLookup l = lookup_tuned_config(problem_, 32, key_, path);
  ASSERT_TRUE(l.config.has_value()) << l.reason;
  EXPECT_EQ(*l.config, kGemmConfigs[3]);  // 11 us, faster than kGemmConfigs[4]'s 12 us
  EXPECT_TRUE(has_note(l, "skipped " + gone.name() + " (not in this build)")) << l.reason;
  // Nothing measured is in the build: no config from the table, a note, the heuristic.
  doc["entries"][0]["buckets"][1]["timings"] = nlohmann::json::array(
      {{{"config", gone.name()}, {"cfg", tile_config_to_json(gone)}, {"median_us", 9.0}}});
  const std::string path2 = write("uncompiled2.json", doc.dump());
  testing::internal::CaptureStderr();
  const TuneLookup n = lookup_tuned_config(problem_, 32, key_, path2);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(n.config.has_value());
  EXPECT_NE(n.reason.find("which this build does not contain"), std::string::npos) << n.reason;
  EXPECT_NE(err.find("does not contain"), std::string::npos) << err;
}

TEST_F(TuneTables, FirstFormatIsStillRead) {
  // fp4moe-tune/1 kept the versions in the key and recorded no SM count or config list.
  nlohmann::json doc = valid_doc(key_);
  doc["format"] = "fp4moe-tune/1";
  doc["key"] = {{"gpu", key_.gpu}, {"cc", key_.cc}, {"cuda_runtime", 12080}, {"cuda_driver", 12080},
                {"fp4moe_version", "0.0.1"}};
  doc.erase("provenance");
  const std::string path = write("v1.json", doc.dump());
  const TuneLookup l = lookup_tuned_config(problem_, 32, key_, path);
  ASSERT_TRUE(l.config.has_value()) << l.reason;
  EXPECT_EQ(*l.config, kGemmConfigs[1]);
  EXPECT_TRUE(has_note(l, "does not record its SM count")) << l.reason;
  EXPECT_TRUE(has_note(l, "does not record its config list")) << l.reason;
  EXPECT_TRUE(has_note(l, "driver 12080")) << l.reason;
  const TuneKey k = tune_key_from_json(doc);
  EXPECT_EQ(k.sms, 0);
  EXPECT_EQ(k.cuda_driver, 12080);
  nlohmann::json bad = doc;
  bad["format"] = "fp4moe-tune/9";
  EXPECT_THROW(tune_key_from_json(bad), Error);
}

TEST_F(TuneTables, CorruptJsonWarnsOnceAndFallsBack) {
  const std::string path = write("bad.json", "{\"format\": \"fp4moe-tune/2\", \"key\": [1, 2");
  testing::internal::CaptureStderr();
  const TuneLookup a = lookup_tuned_config(problem_, 32, key_, path);
  const TuneLookup b = lookup_tuned_config(problem_, 64, key_, path);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(a.config.has_value());
  EXPECT_FALSE(b.config.has_value());
  EXPECT_EQ(a.source, "heuristic");
  EXPECT_NE(a.reason.find("corrupt"), std::string::npos) << a.reason;
  EXPECT_NE(err.find("warning"), std::string::npos) << err;
  EXPECT_EQ(err.find("warning"), err.rfind("warning")) << "warned more than once:\n" << err;
  // Valid JSON of the wrong shape is corrupt too, not a crash.
  nlohmann::json shape = valid_doc(key_);
  shape["entries"] = nlohmann::json::array({{{"problem_key", 5}}});
  const std::string sp = write("shape.json", shape.dump());
  testing::internal::CaptureStderr();
  EXPECT_FALSE(lookup_tuned_config(problem_, 32, key_, sp).config.has_value());
  EXPECT_NE(testing::internal::GetCapturedStderr().find("corrupt"), std::string::npos);
}

TEST_F(TuneTables, MissingTableFallsBack) {
  testing::internal::CaptureStderr();
  const TuneLookup l = lookup_tuned_config(problem_, 32, key_, (dir_ / "nope.json").string());
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(l.config.has_value());
  EXPECT_NE(l.reason.find("does not exist"), std::string::npos) << l.reason;
  EXPECT_NE(err.find("does not exist"), std::string::npos);
}

TEST_F(TuneTables, MergeReplacesAndAddsBucketsAndTakesTheNewProvenance) {
  nlohmann::json a = valid_doc(key_);  // buckets 1, 32, 512
  TuneKey newer = key_;
  newer.cuda_driver = 13020;
  nlohmann::json b = valid_doc(newer);
  // a run of two buckets: 8 is new, 32 replaces the old one
  b["entries"][0]["buckets"] = nlohmann::json::array({{{"tokens", 32}, {"best", tile_config_to_json(kGemmConfigs[4])}},
                                                      {{"tokens", 8}, {"best", tile_config_to_json(kGemmConfigs[3])}}});
  const nlohmann::json m = merge_tune_cache(a, b);
  ASSERT_EQ(m["entries"].size(), 1u);
  const nlohmann::json& bk = m["entries"][0]["buckets"];
  ASSERT_EQ(bk.size(), 4u);
  const int64_t want_t[] = {1, 8, 32, 512};
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(bk[i]["tokens"].get<int64_t>(), want_t[i]);
  EXPECT_EQ(bk[1]["best"], tile_config_to_json(kGemmConfigs[3]));
  EXPECT_EQ(bk[2]["best"], tile_config_to_json(kGemmConfigs[4]));  // replaced
  EXPECT_EQ(bk[0]["best"], a["entries"][0]["buckets"][0]["best"]);  // kept
  EXPECT_EQ(m["provenance"]["cuda_driver"], 13020);
  // The merged table serves the new bucket, and the kept ones.
  const std::string path = write("merged.json", m.dump());
  EXPECT_EQ(*lookup_tuned_config(problem_, 8, newer, path).config, kGemmConfigs[3]);
  EXPECT_EQ(*lookup_tuned_config(problem_, 600, newer, path).config, kGemmConfigs[2]);
  // A new problem is added beside the old one.
  nlohmann::json c = valid_doc(newer);
  c["entries"][0]["problem_key"] = "E8_N64_K64_nvfp4_bf16_plain";
  EXPECT_EQ(merge_tune_cache(m, c)["entries"].size(), 2u);
  TuneKey other = key_;
  other.gpu = "Other";
  EXPECT_EQ(merge_tune_cache(valid_doc(other), b), b);
}

// Where the layer resolves its configs, and which tuned bucket serves a token count.
TEST(TuneBuckets, ResolutionPointsArePowersOfTwoAndOneAndAHalfTimesThemThenQuarterSteps) {
  const int64_t points[] = {1,   2,   3,   4,   6,   8,   12,   16,   24,   32,   48,   64,   96,  128,
                            192, 256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560};
  for (size_t i = 0; i + 1 < std::size(points); ++i) {
    EXPECT_EQ(next_layer_resolution_point(points[i]), points[i + 1]) << points[i];
    for (int64_t t = points[i]; t < points[i + 1]; ++t) EXPECT_EQ(layer_resolution_point(t), points[i]) << t;
  }
  EXPECT_EQ(layer_resolution_points(2560), std::vector<int64_t>(std::begin(points), std::end(points)));
  EXPECT_EQ(layer_resolution_points(16384).size(), 38u);
  EXPECT_EQ(layer_resolution_points(16384).back(), 16384);
  EXPECT_EQ(layer_resolution_point(0), 1);
  EXPECT_EQ(layer_resolution_point(16383), 14336);
  EXPECT_EQ(layer_resolution_point(16384), 16384);
}

TEST(TuneBuckets, TheBucketNearestOnALogScaleServesTiesToTheSmaller) {
  const std::vector<int64_t> b{128, 1, 8, 32, 256, 2};  // any order
  EXPECT_EQ(serving_bucket(b, 1), 1);
  EXPECT_EQ(serving_bucket(b, 3), 2);      // point 3: 3 / 2 < 8 / 3
  EXPECT_EQ(serving_bucket(b, 4), 2);      // 4 x 4 = 2 x 8: the tie goes to the smaller
  EXPECT_EQ(serving_bucket(b, 7), 8);      // point 6: 36 > 16
  EXPECT_EQ(serving_bucket(b, 16), 8);     // 16 x 16 = 8 x 32
  EXPECT_EQ(serving_bucket(b, 24), 32);
  EXPECT_EQ(serving_bucket(b, 191), 128);  // point 128 itself
  EXPECT_EQ(serving_bucket(b, 192), 256);  // point 192: 192 x 192 > 128 x 256
  EXPECT_EQ(serving_bucket(b, 100000), 256);
  EXPECT_EQ(serving_bucket({512}, 1), 512);  // below every bucket: the smallest
  EXPECT_EQ(serving_bucket({}, 8), -1);
}

TEST(TuneBuckets, AQuarterPointUsesItsOwnBucketElseTheCoarsePointBelowIt) {
  // A table without quarter buckets is read as on the coarse grid: T = 640..767 on the 512 bucket,
  // 896..1023 on the 768 bucket, as before the quarter points existed.
  const std::vector<int64_t> coarse{256, 512, 768, 1024, 2048, 4096};
  EXPECT_EQ(serving_bucket(coarse, 639), 512);
  EXPECT_EQ(serving_bucket(coarse, 700), 512);
  EXPECT_EQ(serving_bucket(coarse, 1023), 768);
  EXPECT_EQ(serving_bucket(coarse, 1300), 1024);
  EXPECT_EQ(serving_bucket(coarse, 1600), 2048);  // coarse point 1536: 1536^2 > 1024 x 2048
  EXPECT_EQ(serving_bucket(coarse, 2600), 2048);  // quarter point 2560 has no bucket: coarse 2048
  EXPECT_EQ(serving_bucket(coarse, 3100), 4096);  // coarse point 3072
  // With quarter buckets each quarter point takes its own.
  const std::vector<int64_t> quarter{512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 3072};
  EXPECT_EQ(serving_bucket(quarter, 700), 640);
  EXPECT_EQ(serving_bucket(quarter, 895), 768);
  EXPECT_EQ(serving_bucket(quarter, 1023), 896);
  EXPECT_EQ(serving_bucket(quarter, 1279), 1024);
  EXPECT_EQ(serving_bucket(quarter, 2047), 1792);
  EXPECT_EQ(serving_bucket(quarter, 3071), 2048);  // quarter point 2560 has none: coarse 2048
  // Only some quarter buckets: a missing one falls back to its coarse point.
  EXPECT_EQ(serving_bucket({512, 896, 1024}, 700), 512);
  EXPECT_EQ(serving_bucket({512, 896, 1024}, 1000), 896);
}

// The in-layer mode's two decisions (bench/layer_tune.cpp times the layer; these choose).
TEST(TuneInLayer, CandidatesAreTheFastestConfigsTheTunerMayPick) {
  // Two stream configs and a tma config, timed at 0.5 rows per expert with a fused shared expert: the
  // tma config is the fastest but not eligible there (tuner_may_pick); it is when nothing is fused.
  std::vector<TileConfig> streams;
  for (const TileConfig& c : kGemmConfigs)
    if (c.mma == 2) streams.push_back(c);
  ASSERT_GE(streams.size(), 2u);
  const TileConfig s1 = streams[0], s2 = streams[1], tma{128, 64, 128, 8, 8, 3};
  nlohmann::json b;
  b["tokens"] = 16;
  b["rows_per_expert"] = 0.5;
  b["shared_expert_fused"] = true;
  b["timings"] = nlohmann::json::array();
  for (auto [c, us] : {std::pair{s1, 30.0}, {tma, 20.0}, {s2, 25.0}})
    b["timings"].push_back({{"config", c.name()}, {"cfg", tile_config_to_json(c)}, {"median_us", us}});
  std::vector<TileConfig> got = tuner_bucket_candidates(b, 3);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], s2);
  EXPECT_EQ(got[1], s1);
  EXPECT_EQ(tuner_bucket_candidates(b, 1).size(), 1u);
  b["shared_expert_fused"] = false;
  got = tuner_bucket_candidates(b, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0], tma);
  EXPECT_EQ(got[1], s2);
  EXPECT_THROW(tuner_bucket_candidates(b, 0), Error);
  EXPECT_THROW(tuner_bucket_candidates(nlohmann::json::object(), 2), Error);
}

TEST(TuneInLayer, AChallengerIsKeptOnlyWhenItBeatsTheTablesPairByTheMargin) {
  EXPECT_EQ(choose_layer_pair({1.0}, 0.01), 0u);
  EXPECT_EQ(choose_layer_pair({1.0, 0.995, 1.02}, 0.01), 0u);   // within the margin: the table stays
  EXPECT_EQ(choose_layer_pair({1.0, 0.985, 0.97}, 0.01), 2u);   // the lowest score wins
  EXPECT_EQ(choose_layer_pair({1.0, 0.97, 0.97}, 0.01), 1u);    // a tie keeps the first timed
  EXPECT_EQ(choose_layer_pair({1.0, 0.999}, 0.0), 1u);
  EXPECT_THROW(choose_layer_pair({}, 0.01), Error);
  EXPECT_THROW(choose_layer_pair({1.0}, 1.0), Error);
}

// The shipped tables (tune/h200-*.json, tune/h100-*.json) serve their GPU whatever its driver, runtime and
// fp4moe version, and every pick in them follows the tuner's rules.
TEST(ShippedTuneTables, ServeAnyH200OrH100Install) {
  const std::string dir = std::string(FP4MOE_TEST_SOURCE_DIR) + "/tune";
  for (const auto& [prefix, gpu] : {std::pair<std::string, std::string>{"h200", "NVIDIA H200"},
                                    std::pair<std::string, std::string>{"h100", "NVIDIA H100 80GB HBM3"}}) {
    SCOPED_TRACE(prefix);
    TuneKey key;
    key.gpu = gpu;
    key.cc = "9.0";
    key.sms = 132;
    key.cuda_runtime = 13020;   // not what the tables were measured with
    key.cuda_driver = 13050;
    key.fp4moe_version = "9.9.9";
    struct Want {
      TuneProblem problem;
      int64_t tokens;
    } wants[] = {{{256, 8, 4096, 6144, GemmEpilogue::kSwiGLU}, 1},
                 {{256, 8, 6144, 2048, GemmEpilogue::kPlain}, 1024},
                 {{128, 4, 5760, 2880, GemmEpilogue::kGptOssSwiGLU}, 32},
                 {{128, 4, 2880, 2880, GemmEpilogue::kPlain}, 4096}};
    for (const Want& w : wants) {
      const TuneLookup l = lookup_tuned_config(w.problem, w.tokens, key, dir, false);
      ASSERT_TRUE(l.config.has_value()) << w.problem.key() << ": " << l.reason;
      EXPECT_FALSE(l.table.empty());
      EXPECT_TRUE(has_note(l, "provenance differs")) << l.reason;
      // Every shipped pick is a config of this build (the table's recorded winner, not a substitute).
      EXPECT_FALSE(has_note(l, "skipped")) << l.reason;
    }
    // The shipped files are in the current format, with the SM count recorded.
    for (const std::string& f : {"/" + prefix + "-glm-5.json", "/" + prefix + "-gpt-oss-120b.json"}) {
      std::ifstream in(dir + f);
      const nlohmann::json doc = nlohmann::json::parse(in);
      EXPECT_EQ(doc.at("format"), "fp4moe-tune/2") << f;
      const TuneKey k = tune_key_from_json(doc);
      EXPECT_EQ(k.gpu, gpu) << f;
      EXPECT_EQ(k.sms, 132) << f;
      EXPECT_FALSE(k.config_list.empty()) << f;
    }
    // Every shipped pick obeys the tuner's rule (tuner_may_pick): no tma or pipeline config below one row
    // per expert where the layer fuses a shared expert there (a bucket measured before the rule knew the
    // model says nothing: the strict rule), and every bucket's pick is its fastest eligible timing (or a
    // layer A/B's, with a note). A routed bucket's recorded rule matches its preset; the shared expert's
    // own problem (one expert, top-1) exists only for a preset with one and sees >= 1 row per expert.
    constexpr TileConfig kTma{128, 64, 128, 8, 8, 3}, kStream{192, 8, 64, 4, 12, 2, 2};
    static_assert(!tuner_may_pick(kTma, 0.5) && tuner_may_pick(kTma, 0.5, false) && tuner_may_pick(kTma, 1.0) &&
                  tuner_may_pick(kStream, 0.5));
    for (const char* model : {"glm-5", "kimi-k2", "gpt-oss-120b", "qwen3-30b"}) {
      const std::string f = "/" + prefix + "-" + model + ".json";
      std::ifstream in(dir + f);
      const nlohmann::json doc = nlohmann::json::parse(in);
      const MoeConfig& pc = preset(model);
      for (const auto& e : doc.at("entries"))
        for (const auto& b : e.at("buckets")) {
          const bool routed = e.at("problem").at("experts").get<int>() == pc.num_experts;
          const double rows = b.at("rows_per_expert").get<double>();
          const bool fused = b.value("shared_expert_fused", true);
          if (routed && b.contains("shared_expert_fused")) {
            EXPECT_EQ(fused, pc.num_shared > 0) << f << " T=" << b.at("tokens");
          }
          if (!routed) {
            // The shared expert's own problem: one expert seeing every token, only in a model with one.
            // Measured with explicit commands, its buckets record the strict rule, which at >= 1 row per
            // expert allows every config, as the `--model` run's (not fused) does.
            EXPECT_GT(pc.num_shared, 0) << f;
            EXPECT_EQ(e.at("problem").at("top_k").get<int>(), 1) << f;
            EXPECT_GE(rows, 1.0) << f << " T=" << b.at("tokens");
          }
          EXPECT_TRUE(tuner_may_pick(tile_config_from_json(b.at("best")), rows, fused)) << f << " T=" << b.at("tokens");
          double fastest = 1e30;
          for (const auto& t : b.at("timings"))
            if (tuner_may_pick(tile_config_from_json(t.at("cfg")), rows, fused))
              fastest = std::min(fastest, t.at("median_us").get<double>());
          // A bucket may keep a slower pick only where a same-machine layer A/B overruled the GEMM-alone
          // timing; its "pick_note" names the result file, and the pick is still one of its timings.
          if (b.contains("layer_pick")) {
            // Decided in the layer (`fp4moe tune --in-layer`): the pick is the kept pair's config, the kept
            // pair is what choose_layer_pair makes of the recorded scores, and the record is complete.
            const auto& lp = b.at("layer_pick");
            const auto& pairs = lp.at("pairs");
            ASSERT_FALSE(pairs.empty()) << f << " T=" << b.at("tokens");
            std::vector<double> scores;
            for (const auto& p : pairs) {
              scores.push_back(p.at("score").get<double>());
              EXPECT_EQ(p.at("layer_us").size(), lp.at("tokens_timed").size()) << f;
            }
            EXPECT_DOUBLE_EQ(scores[0], 1.0) << f << " T=" << b.at("tokens");
            const size_t chosen = lp.at("chosen").get<size_t>();
            EXPECT_EQ(chosen, choose_layer_pair(scores, lp.at("margin").get<double>())) << f << " T=" << b.at("tokens");
            const bool is_gemm1 = e.at("problem").at("n").get<int64_t>() == pc.gemm1_n();
            EXPECT_EQ(b.at("best_name"), pairs.at(chosen).at(is_gemm1 ? "gemm1" : "gemm2"))
                << f << " T=" << b.at("tokens");
            bool timed = false;
            for (const auto& t : b.at("timings")) timed = timed || t.at("config") == b.at("best_name");
            EXPECT_TRUE(timed) << f << " T=" << b.at("tokens");
          } else if (b.contains("pick_note")) {
            EXPECT_NE(b.at("pick_note").get<std::string>().find("bench/results/"), std::string::npos) << f;
            bool timed = false;
            for (const auto& t : b.at("timings")) timed = timed || t.at("config") == b.at("best_name");
            EXPECT_TRUE(timed) << f << " T=" << b.at("tokens");
          } else {
            EXPECT_DOUBLE_EQ(b.at("best_us").get<double>(), fastest) << f << " T=" << b.at("tokens");
          }
        }
    }
    // Another GPU does not use them.
    TuneKey b200 = key;
    b200.gpu = "NVIDIA B200";
    b200.cc = "10.0";
    b200.sms = 148;
    EXPECT_FALSE(lookup_tuned_config(wants[0].problem, 1, b200, dir, false).config.has_value());
  }
}

}  // namespace
}  // namespace fp4moe
