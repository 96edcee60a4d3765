#include "ep_bench.hpp"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "bench_common.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/ep_moe_layer.hpp"
#include "fp4moe/ep_nccl.hpp"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe::bench {
namespace {

std::vector<int32_t> download_i32(const int32_t* p, size_t n) {
  std::vector<int32_t> v(n);
  FP4MOE_CUDA_CHECK(cudaMemcpy(v.data(), p, n * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return v;
}

struct RankPoint {
  double layer_us = 0;
  std::vector<double> stage_us;  // kNumEpStages medians (graph replays with event nodes)
  int64_t wire_sent = 0;         // bytes this rank puts on the wire per forward (fixed message sizes)
  int64_t wire_received = 0;
  int64_t routed_sent = 0;       // the part of wire_sent that carries routed rows (dispatch + reply)
  int64_t rows_computed = 0;     // routed rows this rank's experts computed
};

struct RankResult {
  std::vector<RankPoint> points;  // per token count
  std::string configs;            // tile configs used at the largest T
  std::string error;
};

// One captured graph per measurement, each replay preceded by an L2 flush outside the timed region,
// on this rank's own device and stream (bench::time_graph_us keeps one flush buffer per process).
class ReplayTimer {
 public:
  explicit ReplayTimer(cudaStream_t s) : s_(s) {
    int dev = 0, l2 = 0;
    FP4MOE_CUDA_CHECK(cudaGetDevice(&dev));
    FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
    flush_ = DeviceBuffer<uint8_t>(static_cast<size_t>(std::max(l2, 1 << 20)) * 4);
    FP4MOE_CUDA_CHECK(cudaEventCreate(&a_));
    FP4MOE_CUDA_CHECK(cudaEventCreate(&b_));
  }
  ~ReplayTimer() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  // Median microseconds of `reps` replays; when `events` is given (kNumEpStages + 1 event nodes in the
  // graph), also the median of each stage.
  double time(const std::function<void(cudaStream_t)>& record, int reps, int warmup, const cudaEvent_t* events,
              std::vector<double>* stages) {
    const CapturedGraph graph(record, s_);
    std::vector<double> times;
    std::vector<std::vector<double>> st(kNumEpStages);
    for (int i = 0; i < warmup + reps; ++i) {
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(flush_.get(), i & 0xff, flush_.bytes(), s_));
      FP4MOE_CUDA_CHECK(cudaEventRecord(a_, s_));
      graph.launch(s_);
      FP4MOE_CUDA_CHECK(cudaEventRecord(b_, s_));
      FP4MOE_CUDA_CHECK(cudaEventSynchronize(b_));
      float ms = 0;
      FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
      if (i < warmup) continue;
      times.push_back(ms * 1e3);
      if (events != nullptr)
        for (int k = 0; k < kNumEpStages; ++k) {
          FP4MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, events[k], events[k + 1]));
          st[k].push_back(ms * 1e3);
        }
    }
    if (stages != nullptr)
      for (int k = 0; k < kNumEpStages; ++k) stages->push_back(median(st[k]));
    return median(times);
  }

 private:
  cudaStream_t s_;
  DeviceBuffer<uint8_t> flush_;
  cudaEvent_t a_, b_;
};

// Every rank runs the same sequence of forwards (NCCL keeps them in step); an overflow is seen by
// every rank in the same forward, so check() makes them all stop together instead of leaving a peer
// waiting in NCCL.
void run_rank(const MoeConfig& cfg, const EpBenchOptions& opt, const std::vector<int64_t>& tokens, int rank, int world,
              ncclComm_t comm, RankResult& res) {
  cudaStream_t s = nullptr;
  try {
    FP4MOE_CUDA_CHECK(cudaSetDevice(rank));
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
    const int64_t H = cfg.hidden, E = cfg.num_experts;
    const EpPartition part = ep_even_partition(cfg.num_experts, world);
    const int begin = part.begin(rank), count = part.count(rank);
    SyntheticDeviceLayer syn = make_synthetic_layer_device(cfg, opt.seed, s);
    // Uniform random routing, as the single-GPU layer bench measures it (the synthetic correction
    // bias would concentrate tokens on a few experts).
    if (syn.weights.router_bias != nullptr)
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(const_cast<float*>(syn.weights.router_bias), 0, E * sizeof(float), s));
    EpCapacity cap;
    cap.max_tokens = max_t;
    cap.capacity_factor = opt.capacity_factor;
    EpMoeLayer layer(comm, rank, world, cfg, ep_slice_weights(cfg, syn.weights, begin, count), begin, count, cap, s);
    syn.buffers.clear();
    DeviceBuffer<uint8_t> ws(layer.workspace_bytes());
    DeviceBuffer<uint16_t> hidden(max_t * H), outb(max_t * H);
    DeviceBuffer<float> logits(max_t * E);
    // Each rank has tokens of its own.
    make_synthetic_hidden_device(cfg, opt.seed + 7919 * (rank + 1), max_t, hidden.get(), s);
    make_synthetic_router_logits_device(cfg, opt.seed + 7919 * (rank + 1), max_t, logits.get(), s);
    const EpIntermediates im = layer.intermediates(ws.get());
    std::vector<cudaEvent_t> ev(kNumEpStages + 1);
    for (auto& e : ev) FP4MOE_CUDA_CHECK(cudaEventCreate(&e));
    ReplayTimer timer(s);
    for (int64_t T : tokens) {
      EpForwardOptions o;
      o.step_tokens = T;
      auto fwd = [&](cudaStream_t st) {
        layer.forward(st, hidden.get(), T, logits.get(), outb.get(), ws.get(), ws.bytes(), o);
      };
      fwd(s);
      layer.check(s);
      RankPoint pt;
      const EpStepLayout S = layer.step_layout(T);
      pt.wire_sent = S.bytes_sent(H);
      pt.wire_received = S.bytes_received(H);
      const std::vector<int32_t> off = download_i32(im.expert_offsets, E + 1);
      for (int d = 0; d < world; ++d) {
        if (d == rank) continue;
        const int64_t rows = std::min<int64_t>(off[part.expert_begin[d + 1]] - off[part.expert_begin[d]], S.rows_to[d]);
        pt.routed_sent += rows * H * 2 * 2;  // the rows out and their results back
      }
      pt.rows_computed = download_i32(im.local_offsets + count, 1)[0];
      pt.layer_us = timer.time(fwd, opt.reps, 3, nullptr, nullptr);
      o.stage_events = ev.data();
      timer.time(fwd, std::max(5, opt.reps / 2), 1, ev.data(), &pt.stage_us);
      o.stage_events = nullptr;
      layer.check(s);
      res.points.push_back(pt);
    }
    const MoeResolvedTileConfigs tc = layer.tile_configs(max_t);
    res.configs = tc.gemm1.name() + " | " + tc.gemm2.name();
    for (auto& e : ev) FP4MOE_CUDA_CHECK(cudaEventDestroy(e));
  } catch (const std::exception& e) {
    res.error = e.what();
  }
  if (s != nullptr) cudaStreamDestroy(s);
}

}  // namespace

void run_ep_bench(const MoeConfig& cfg, const EpBenchOptions& opt, nlohmann::json& out) {
  const int N = opt.ranks;
  int devices = 0;
  FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  FP4MOE_REQUIRE(N >= 1 && N <= devices && N <= kMaxEpRanks,
                 "bench --ep {}: needs {} GPUs of this host and {} are visible (and at most {} ranks)", N, N, devices,
                 kMaxEpRanks);
  FP4MOE_REQUIRE(cfg.num_experts >= N, "bench --ep {}: {} has E = {} experts, fewer than the ranks", N, cfg.name,
                 cfg.num_experts);
  const std::vector<int64_t> tokens = opt.tokens.empty() ? std::vector<int64_t>{1, 8, 128, 1024} : opt.tokens;
  const int64_t max_t = *std::max_element(tokens.begin(), tokens.end());
  const int64_t H = cfg.hidden, E = cfg.num_experts;

  // ---- t1: the single-GPU layer over all N * T tokens, on GPU 0 ----
  std::vector<double> t1(tokens.size());
  {
    FP4MOE_CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t s;
    FP4MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::fprintf(stderr, "single-GPU reference: the synthetic %s layer on GPU 0...\n", cfg.name.c_str());
    SyntheticDeviceLayer syn = make_synthetic_layer_device(cfg, opt.seed, s);
    if (syn.weights.router_bias != nullptr)
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(const_cast<float*>(syn.weights.router_bias), 0, E * sizeof(float), s));
    const int64_t n_max = N * max_t;
    MoeLayer ref(cfg, syn.weights, n_max, s);
    syn.buffers.clear();
    DeviceBuffer<uint8_t> ws(ref.workspace_bytes());
    DeviceBuffer<uint16_t> hidden(n_max * H), outb(n_max * H);
    DeviceBuffer<float> logits(n_max * E);
    make_synthetic_hidden_device(cfg, opt.seed, n_max, hidden.get(), s);
    make_synthetic_router_logits_device(cfg, opt.seed, n_max, logits.get(), s);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int64_t n = N * tokens[i];
      auto fwd = [&](cudaStream_t st) { ref.forward(st, hidden.get(), n, logits.get(), outb.get(), ws.get(), ws.bytes()); };
      fwd(s);
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      t1[i] = time_graph_us(fwd, s, opt.reps);
    }
    FP4MOE_CUDA_CHECK(cudaStreamDestroy(s));
  }

  // ---- tN: every rank on its own thread ----
  std::vector<ncclComm_t> comms(N, nullptr);
  if (N > 1) {
    nccl_default_environment();
    std::vector<int> devs(N);
    for (int r = 0; r < N; ++r) devs[r] = r;
    comms = nccl_comm_init_all(devs);
  }
  std::fprintf(stderr, "expert parallel over %d GPU%s...\n", N, N > 1 ? "s" : "");
  std::vector<RankResult> res(N);
  {
    std::vector<std::thread> threads;
    for (int r = 0; r < N; ++r)
      threads.emplace_back([&, r] { run_rank(cfg, opt, tokens, r, N, comms[r], res[r]); });
    for (auto& t : threads) t.join();
  }
  for (ncclComm_t c : comms) nccl_comm_destroy(c);
  for (int r = 0; r < N; ++r)
    FP4MOE_REQUIRE(res[r].error.empty(), "bench --ep {}: rank {} failed: {}", N, r, res[r].error);

  const EpPartition part = ep_even_partition(cfg.num_experts, N);
  std::printf("\n%s expert parallel over %d GPU%s (%d..%d experts per rank, capacity_factor %g%s), one thread per GPU, "
              "graph replay, cold L2\n",
              cfg.name.c_str(), N, N > 1 ? "s" : "", part.count(N - 1), part.count(0), opt.capacity_factor,
              opt.capacity_factor == 0 ? " = worst case" : "");
  std::printf("%6s %7s %11s %9s %6s %7s %8s %9s %9s %9s %9s %9s %10s  %s\n", "T/rank", "tokens", "t1(N*T) us", "tN us",
              "eff", "comm %", "route", "dispatch", "experts", "return", "combine", "wire MB", "routed MB",
              "per rank us");
  nlohmann::json rows = nlohmann::json::array();
  for (size_t i = 0; i < tokens.size(); ++i) {
    int slow = 0;
    for (int r = 1; r < N; ++r)
      if (res[r].points[i].layer_us > res[slow].points[i].layer_us) slow = r;
    const RankPoint& p = res[slow].points[i];
    const double tN = p.layer_us;
    const double eff = t1[i] / (N * tN);
    double stage_sum = 0;
    for (double x : p.stage_us) stage_sum += x;
    const double comm = stage_sum > 0 ? (p.stage_us[1] + p.stage_us[3]) / stage_sum : 0.0;
    std::string per_rank;
    nlohmann::json ranks = nlohmann::json::array();
    for (int r = 0; r < N; ++r) {
      const RankPoint& q = res[r].points[i];
      per_rank += (r ? " " : "") + fmt::format("{:.1f}", q.layer_us);
      double qs = 0;
      for (double x : q.stage_us) qs += x;
      ranks.push_back({{"rank", r},
                       {"layer_us", q.layer_us},
                       {"stage_us", {{"route", q.stage_us[0]},
                                     {"dispatch", q.stage_us[1]},
                                     {"experts", q.stage_us[2]},
                                     {"return", q.stage_us[3]},
                                     {"combine", q.stage_us[4]}}},
                       {"comm_share", qs > 0 ? (q.stage_us[1] + q.stage_us[3]) / qs : 0.0},
                       {"wire_bytes_sent", q.wire_sent},
                       {"wire_bytes_received", q.wire_received},
                       {"routed_bytes_sent", q.routed_sent},
                       {"rows_computed", q.rows_computed}});
    }
    std::printf("%6lld %7lld %11.1f %9.1f %6.3f %6.1f%% %8.1f %9.1f %9.1f %9.1f %9.1f %9.2f %10.2f  %s\n",
                (long long)tokens[i], (long long)(N * tokens[i]), t1[i], tN, eff, 100 * comm, p.stage_us[0],
                p.stage_us[1], p.stage_us[2], p.stage_us[3], p.stage_us[4], p.wire_sent / 1e6, p.routed_sent / 1e6,
                per_rank.c_str());
    rows.push_back({{"tokens_per_rank", tokens[i]},
                    {"tokens_total", N * tokens[i]},
                    {"t1_us", t1[i]},
                    {"tN_us", tN},
                    {"slowest_rank", slow},
                    {"scaling_efficiency", eff},
                    {"comm_share", comm},
                    {"ranks", ranks}});
  }
  std::printf("eff = t1(N*T) / (N * tN), tN = the slowest rank's median; comm %% = (dispatch + return) / all stages "
              "of that rank (graph replays with event nodes; waiting for peers counts as communication); wire MB = "
              "bytes one rank sends per forward (messages have fixed sizes), routed MB = the part carrying routed rows\n");
  std::printf("tile configs at T = %lld per rank (GEMM1 | GEMM2): %s\n", (long long)max_t, res[0].configs.c_str());
  out["ep"] = {{"ranks", N},
               {"capacity_factor", opt.capacity_factor},
               {"experts_per_rank", part.count(0)},
               {"configs_at_max_tokens", res[0].configs},
               {"rows", rows}};
}

void run_ep_bench_command(const MoeConfig& cfg, const EpBenchOptions& opt, const std::string& json_path,
                          const std::string& commit) {
  int driver = 0, runtime = 0, devices = 0;
  FP4MOE_CUDA_CHECK(cudaDriverGetVersion(&driver));
  FP4MOE_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  cudaDeviceProp prop{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::string nccl = "not used (one GPU)";
  if (opt.ranks > 1) {
    std::string why;
    FP4MOE_REQUIRE(nccl_available(&why), "bench --ep {}: {}", opt.ranks, why);
    const int v = nccl_version();
    nccl = fmt::format("{}.{}.{} ({})", v / 10000, v / 100 % 100, v % 100, why);
  }
  std::printf("GPU: %d x %s  (driver %d, runtime %d), fp4moe %s, commit %s, NCCL %s\n", opt.ranks, prop.name, driver,
              runtime, FP4MOE_VERSION, commit.c_str(), nccl.c_str());
  nlohmann::json out = {{"gpu", prop.name},     {"gpus_visible", devices}, {"driver", driver},
                        {"runtime", runtime},   {"commit", commit},        {"model", cfg.name},
                        {"nccl", nccl}};
  run_ep_bench(cfg, opt, out);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    FP4MOE_REQUIRE(f.good(), "--json {}: cannot open for writing", json_path);
    f << out.dump(2) << "\n";
  }
}

}  // namespace fp4moe::bench
