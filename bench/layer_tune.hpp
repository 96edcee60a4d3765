// `fp4moe tune --in-layer`: the routed GEMMs' picks of a model's tuner table decided by timing the whole
// layer (graph replay, cold L2), as the hand-run layer A/Bs of bench/NOTES.md did. Why the GEMM-alone
// timings are not enough, and the record it writes: tuner.hpp (tuner_bucket_candidates,
// choose_layer_pair) and tune/README.md ("layer_pick").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>
#include <nlohmann/json.hpp>

#include "fp4moe/config.hpp"

namespace fp4moe::bench {

struct LayerTuneOptions {
  std::vector<int64_t> buckets;  // table buckets to decide; each must be tuned for both routed GEMMs
  int candidates = 3;            // fastest eligible configs per GEMM taken from the GEMM-alone timings
  int rounds = 3;                // passes over all pairs, each in another order; a pair's median is kept
  int reps = 20;                 // graph replays per timing (median)
  double margin = 0.01;          // a challenger must beat the incumbent pair by this fraction
  uint64_t seed = 1;
};

// doc: a tuner table (format tune/README.md) holding the model's routed problems gemm1_key and gemm2_key
// with every bucket of opt.buckets. Each bucket's pair is timed at its token count T and at the smallest
// and largest counts it serves in the layer (serving_bucket, tuner.hpp); the kept pair becomes both
// buckets' "best" and both get the "layer_pick" record. Prints one table per bucket.
void tune_pairs_in_layer(const MoeConfig& cfg, const std::string& gemm1_key, const std::string& gemm2_key,
                         nlohmann::json& doc, const LayerTuneOptions& opt, cudaStream_t stream);

}  // namespace fp4moe::bench
