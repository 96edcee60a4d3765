// The checkpoint parts of `fp4moe info`, `fp4moe run` and `fp4moe bench` (--checkpoint DIR).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace fp4moe::cli {

// 64-bit FNV-1a over the output's bf16 bits: identical outputs <=> identical hashes (in practice), so
// a GPU run and the CPU reference, or two machines, can be compared from the printed line.
uint64_t bf16_hash(const std::vector<float>& v);

// `fp4moe info --checkpoint DIR`: format, architecture, MoE layers, shapes, routing, what stays bf16.
void print_checkpoint_info(const std::string& dir);

struct CheckpointRunArgs {
  std::string dir;
  int layer = -1;          // -1: the first MoE layer
  int64_t tokens = 4;
  uint64_t seed = 1;
  bool cpu = false;        // CPU reference only
  bool check = false;      // GPU and CPU reference, compared
  bool routed_only = false;
  int threads = 0;
};
// `fp4moe run --checkpoint DIR --layer L --tokens T [--check] [--cpu]`.
void run_checkpoint(const CheckpointRunArgs& a);

struct CheckpointBenchArgs {
  std::string dir;
  int layer = -1;
  std::vector<int64_t> tokens;  // default 1, 8, 32, 128, 512, 2048
  int reps = 20;
  bool routed_only = false;
  std::string json;
};
// `fp4moe bench --checkpoint DIR --layer L`: the loaded layer's forward (router GEMM included), CUDA
// graph replays, against the streaming-read ceiling measured in the same run.
void bench_checkpoint(const CheckpointBenchArgs& a);

}  // namespace fp4moe::cli
