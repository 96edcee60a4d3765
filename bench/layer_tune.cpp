#include "layer_tune.hpp"

#include <algorithm>
#include <cstdio>

#include <fmt/format.h>

#include "bench_common.hpp"
#include "fp4moe/arch.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/tuner.hpp"
#include "layer_bench.hpp"

namespace fp4moe::bench {

namespace {

nlohmann::json& entry_of(nlohmann::json& doc, const std::string& key) {
  FP4MOE_REQUIRE(doc.is_object() && doc.contains("entries") && doc.at("entries").is_array(),
                 "--in-layer: the tuner table has no \"entries\" array");
  for (auto& e : doc["entries"])
    if (e.value("problem_key", "") == key) return e;
  FP4MOE_FAIL("--in-layer: the tuner table has no entry for problem {}; tune the model first (without --layer-only)",
              key);
}

nlohmann::json& bucket_of(nlohmann::json& entry, int64_t tokens) {
  for (auto& b : entry["buckets"])
    if (b.at("tokens").get<int64_t>() == tokens) return b;
  FP4MOE_FAIL("--in-layer: bucket T = {} is not tuned for problem {}; tune it first (without --layer-only)", tokens,
              entry.value("problem_key", "?"));
}

const nlohmann::json* find_bucket(const nlohmann::json& entry, int64_t tokens) {
  for (const auto& b : entry.at("buckets"))
    if (b.at("tokens").get<int64_t>() == tokens) return &b;
  return nullptr;
}

// Whether c may be this bucket's pick: the tuner's rule at its rows per expert, and timed here (in build).
bool eligible_here(const nlohmann::json& bucket, const TileConfig& c) {
  for (const TileConfig& e : tuner_bucket_candidates(bucket, kNumGemmConfigs))
    if (e == c) return true;
  return false;
}

// The tuned bucket just below (dir < 0) or above T, or 0.
int64_t adjacent_bucket(const nlohmann::json& entry, int64_t T, int dir) {
  int64_t best = 0;
  for (const auto& b : entry.at("buckets")) {
    const int64_t t = b.at("tokens").get<int64_t>();
    if (dir < 0 ? (t < T && t > best) : (t > T && (best == 0 || t < best))) best = t;
  }
  return best;
}

// The token counts a bucket is timed at: the smallest and the largest that it serves in the layer
// (serving_bucket at the resolution points; the largest bucket's range is cut at twice its T), and T.
std::vector<int64_t> served_counts(const nlohmann::json& entry, int64_t T) {
  std::vector<int64_t> tuned;
  for (const auto& b : entry.at("buckets")) tuned.push_back(b.at("tokens").get<int64_t>());
  const int64_t top = 2 * *std::max_element(tuned.begin(), tuned.end());
  int64_t lo = 0, hi_point = 0;
  for (int64_t p : layer_resolution_points(top))
    if (serving_bucket(tuned, p) == T) {
      if (lo == 0) lo = p;
      hi_point = p;
    }
  std::vector<int64_t> ts{T};
  if (lo != 0) {
    ts.push_back(lo);
    ts.push_back(std::min(next_layer_resolution_point(hi_point) - 1, 2 * T - 1));
  }
  std::sort(ts.begin(), ts.end());
  ts.erase(std::unique(ts.begin(), ts.end()), ts.end());
  return ts;
}

double standalone_us(const nlohmann::json& bucket, const std::string& name) {
  for (const auto& t : bucket.at("timings"))
    if (t.at("config") == name) return t.at("median_us").get<double>();
  FP4MOE_FAIL("--in-layer: config {} has no timing in bucket T = {}", name, bucket.at("tokens").get<int64_t>());
}

struct Pair {
  TileConfig g1, g2;
};

}  // namespace

void tune_pairs_in_layer(const MoeConfig& cfg, const std::string& gemm1_key, const std::string& gemm2_key,
                         nlohmann::json& doc, const LayerTuneOptions& opt, cudaStream_t s) {
  FP4MOE_REQUIRE(!opt.buckets.empty(), "--in-layer: no buckets to decide");
  FP4MOE_REQUIRE(opt.candidates >= 1 && opt.rounds >= 1 && opt.reps >= 1,
                 "--in-layer: candidates = {}, rounds = {}, reps = {} must all be >= 1", opt.candidates, opt.rounds,
                 opt.reps);
  nlohmann::json& e1 = entry_of(doc, gemm1_key);
  nlohmann::json& e2 = entry_of(doc, gemm2_key);
  // The token counts timed per bucket: T and the smallest and largest counts it serves in the layer.
  std::vector<std::vector<int64_t>> counts;
  int64_t max_t = 1;
  for (int64_t T : opt.buckets) {
    bucket_of(e1, T), bucket_of(e2, T);  // both tuned, or a clear error before any GPU work
    const std::vector<int64_t> ts = served_counts(e1, T);
    max_t = std::max(max_t, ts.back());
    counts.push_back(ts);
  }

  SyntheticLayerRig rig = make_synthetic_layer_rig(cfg, opt.seed, max_t, s);
  int device = 0;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  const ArchInfo arch = arch_from_device(device);
  MoeLayer& layer = *rig.layer;
  for (size_t bi = 0; bi < opt.buckets.size(); ++bi) {
    const int64_t T = opt.buckets[bi];
    const std::vector<int64_t>& ts = counts[bi];
    nlohmann::json& b1 = bucket_of(e1, T);
    nlohmann::json& b2 = bucket_of(e2, T);
    // The incumbent first: the table's picks (a pick_note's layer A/B included).
    std::vector<Pair> pairs{{tile_config_from_json(b1.at("best")), tile_config_from_json(b2.at("best"))}};
    auto add = [&](const TileConfig& c1, const TileConfig& c2) {
      if (std::none_of(pairs.begin(), pairs.end(), [&](const Pair& p) { return p.g1 == c1 && p.g2 == c2; }))
        pairs.push_back({c1, c2});
    };
    for (const TileConfig& c1 : tuner_bucket_candidates(b1, opt.candidates))
      for (const TileConfig& c2 : tuner_bucket_candidates(b2, opt.candidates)) add(c1, c2);
    // The neighbouring buckets' pairs too: before this bucket existed (or under another lookup rule) one of
    // them served these counts, and its GEMM-alone timings here need not rank it among the fastest (GLM-5
    // at T = 768: the T = 512 pair ran the layer 10% faster than the T = 768 bucket's own picks).
    for (int64_t nb : {adjacent_bucket(e1, T, -1), adjacent_bucket(e1, T, +1)}) {
      if (nb <= 0) continue;
      const nlohmann::json& n1 = bucket_of(e1, nb);
      const nlohmann::json* n2 = find_bucket(e2, nb);
      if (n2 == nullptr) continue;
      const TileConfig c1 = tile_config_from_json(n1.at("best")), c2 = tile_config_from_json(n2->at("best"));
      if (eligible_here(b1, c1) && eligible_here(b2, c2)) add(c1, c2);
    }
    // And the heuristic's pair (what the layer runs without a table): the GEMM-alone ranking can leave it
    // out, and it can be the fastest in the layer (qwen3-30b on the H100 at T = 4 and 8: 59 / 80 us
    // against 67 / 87 for the in-layer pick from the other candidates; bench/NOTES.md, eighteenth session).
    {
      const double rows = b1.at("rows_per_expert").get<double>();
      const TileConfig h1 = heuristic_tile_config(cfg.gemm1_n(), cfg.gemm1_k(), rows, arch);
      const TileConfig h2 = heuristic_tile_config(cfg.gemm2_n(), cfg.gemm2_k(), rows, arch);
      if (eligible_here(b1, h1) && eligible_here(b2, h2)) add(h1, h2);
    }
    // times[pair][count][round]; each round visits the pairs in another rotation, so a drift of the
    // GPU's clock over the run (the power cap) does not favor the pairs timed first.
    std::vector<std::vector<std::vector<double>>> times(
        pairs.size(), std::vector<std::vector<double>>(ts.size()));
    // A pair the layer refuses (its launch checks each config against the problem it runs: the shared
    // expert fused into the routed launch, say) is reported and left out, not a reason to stop.
    std::vector<std::string> refused(pairs.size());
    for (int r = 0; r < opt.rounds; ++r)
      for (size_t j = 0; j < pairs.size(); ++j) {
        const size_t pi = (j + static_cast<size_t>(r)) % pairs.size();
        if (!refused[pi].empty()) continue;
        MoeTileConfigs forced;
        forced.gemm1 = pairs[pi].g1;
        forced.gemm2 = pairs[pi].g2;
        layer.set_tile_configs(forced);
        for (size_t ti = 0; ti < ts.size() && refused[pi].empty(); ++ti) {
          const int64_t t = ts[ti];
          auto fwd = [&](cudaStream_t st) { rig.forward(st, t); };
          try {
            fwd(s);  // outside the capture: kernel loading, cuBLAS handles; and where a refusal is thrown
          } catch (const Error& e) {
            FP4MOE_REQUIRE(pi != 0, "--in-layer: the table's own pair fails in the layer at T = {}: {}", t, e.what());
            refused[pi] = e.what();
            break;
          }
          FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
          times[pi][ti].push_back(time_graph_us(fwd, s, opt.reps));
        }
      }
    layer.set_tile_configs({});
    for (size_t pi = 0; pi < pairs.size(); ++pi)
      if (!refused[pi].empty())
        std::printf("  (left out: %s + %s: %s)\n", pairs[pi].g1.name().c_str(), pairs[pi].g2.name().c_str(),
                    refused[pi].c_str());
    {  // the refused pairs go; the incumbent (index 0) is never refused
      std::vector<Pair> kept;
      std::vector<std::vector<std::vector<double>>> kept_times;
      for (size_t pi = 0; pi < pairs.size(); ++pi)
        if (refused[pi].empty()) kept.push_back(pairs[pi]), kept_times.push_back(std::move(times[pi]));
      pairs = std::move(kept);
      times = std::move(kept_times);
    }

    std::vector<std::vector<double>> med(pairs.size(), std::vector<double>(ts.size()));
    for (size_t pi = 0; pi < pairs.size(); ++pi)
      for (size_t ti = 0; ti < ts.size(); ++ti) med[pi][ti] = median(times[pi][ti]);
    std::vector<double> score(pairs.size(), 0.0);
    for (size_t pi = 0; pi < pairs.size(); ++pi) {
      for (size_t ti = 0; ti < ts.size(); ++ti) score[pi] += med[pi][ti] / med[0][ti];
      score[pi] /= static_cast<double>(ts.size());
    }
    const size_t chosen = choose_layer_pair(score, opt.margin);

    std::printf("\n%s layer, bucket T = %lld: routed GEMM pairs timed at T =", cfg.name.c_str(), (long long)T);
    for (int64_t t : ts) std::printf(" %lld", (long long)t);
    std::printf(" (median of %d rounds x %d replays, cold L2; score = mean time / the table's pair)\n", opt.rounds,
                opt.reps);
    std::printf("  %-28s %-28s", "GEMM1", "GEMM2");
    for (int64_t t : ts) std::printf(" %10s", fmt::format("T={} us", t).c_str());
    std::printf(" %7s\n", "score");
    nlohmann::json rec;
    rec["tokens_timed"] = ts;
    rec["rounds"] = opt.rounds;
    rec["reps"] = opt.reps;
    rec["margin"] = opt.margin;
    rec["pairs"] = nlohmann::json::array();
    for (size_t pi = 0; pi < pairs.size(); ++pi) {
      std::printf("  %-28s %-28s", pairs[pi].g1.name().c_str(), pairs[pi].g2.name().c_str());
      for (double v : med[pi]) std::printf(" %10.1f", v);
      std::printf(" %7.4f%s%s\n", score[pi], pi == 0 ? "  (table)" : "", pi == chosen ? "  <- kept" : "");
      rec["pairs"].push_back({{"gemm1", pairs[pi].g1.name()},
                              {"gemm2", pairs[pi].g2.name()},
                              {"layer_us", med[pi]},
                              {"score", score[pi]}});
    }
    rec["chosen"] = chosen;
    std::fflush(stdout);
    for (auto [b, c] : {std::pair<nlohmann::json*, TileConfig>{&b1, pairs[chosen].g1}, {&b2, pairs[chosen].g2}}) {
      if (chosen != 0) {  // the layer overrules the table: its record replaces an older note
        (*b)["best"] = tile_config_to_json(c);
        (*b)["best_name"] = c.name();
        const double was = b->at("best_us").get<double>(), now = standalone_us(*b, c.name());
        (*b)["best_us"] = now;
        if (b->contains("all_experts_weight_bytes_per_us") && now > 0)  // bytes / best_us, for the new pick
          (*b)["all_experts_weight_bytes_per_us"] = b->at("all_experts_weight_bytes_per_us").get<double>() * was / now;
        b->erase("pick_note");
      }
      (*b)["layer_pick"] = rec;
    }
  }
}

}  // namespace fp4moe::bench
