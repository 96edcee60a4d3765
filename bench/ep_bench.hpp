// The expert-parallel benchmark (`fp4moe bench --ep N`): one process drives N GPUs of one host, one
// thread per GPU, communicators from ncclCommInitAll (the caller-owned setup, done here by the tool).
// Per token count T per rank: the EP layer time on every rank, the bytes each rank moves, the share
// of the time spent in the two exchanges, and the scaling efficiency t1(N*T) / (N * tN), where t1 is
// the single-GPU MoeLayer over all N*T tokens on GPU 0, measured in the same run the same way (graph
// replay, cold L2, median).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fp4moe/config.hpp"

namespace fp4moe::bench {

struct EpBenchOptions {
  int ranks = 1;                 // N GPUs (devices 0 .. N-1); 1 runs world size 1 on one GPU
  std::vector<int64_t> tokens;   // per rank; default {1, 8, 128, 1024}
  double capacity_factor = 0.0;  // EpCapacity::capacity_factor (0: the worst case)
  int reps = 20;
  uint64_t seed = 1;
};

// Prints a table and appends results to out["ep"].
void run_ep_bench(const MoeConfig& cfg, const EpBenchOptions& opt, nlohmann::json& out);
// The subcommand: GPU / driver / commit header, the table, and the JSON file when json_path is given.
void run_ep_bench_command(const MoeConfig& cfg, const EpBenchOptions& opt, const std::string& json_path,
                          const std::string& commit);

}  // namespace fp4moe::bench
