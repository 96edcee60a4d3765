// Helpers of the expert-parallel GPU suites: an in-process transport (several ranks as threads on one
// GPU), the single-GPU reference run and a driver that runs every rank of an EP layer on its thread.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/ep_moe_layer.hpp"
#include "fp4moe/ep_transport.hpp"
#include "fp4moe/format_math.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/reference.hpp"
#include "gpu_test_util.hpp"

namespace fp4moe::test {

// A reusable barrier that gives up (throws) instead of hanging a test forever when a rank died.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(120), [&] { return gen_ != gen; }))
      throw std::runtime_error("loopback barrier: a rank did not arrive within 120 s (another rank failed?)");
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_;
  int arrived_ = 0;
  int64_t gen_ = 0;
};

// The ranks of one EP group on ONE GPU, each a thread with its own stream. An exchange is a barrier
// at which every rank copies what was sent to it (cudaMemcpyAsync on its stream, after the sender's
// stream reached the exchange), then a second barrier after which every rank's stream also waits for
// every copy: the same ordering NCCL's grouped send/receive gives. Byte counts that do not match are
// counted (size_mismatches) and the shorter length is copied, so a test can watch the layer's own
// header check report it.
class LoopbackHub {
 public:
  explicit LoopbackHub(int world) : world_(world), barrier_(world), posts_(world), gathered_(world), ready_(world), done_(world) {
    for (int r = 0; r < world; ++r) {
      FP4MOE_CUDA_CHECK(cudaEventCreateWithFlags(&ready_[r], cudaEventDisableTiming));
      FP4MOE_CUDA_CHECK(cudaEventCreateWithFlags(&done_[r], cudaEventDisableTiming));
    }
  }
  ~LoopbackHub() {
    for (int r = 0; r < world_; ++r) {
      cudaEventDestroy(ready_[r]);
      cudaEventDestroy(done_[r]);
    }
  }
  int world() const { return world_; }
  int size_mismatches() const { return mismatches_.load(); }

  struct Post {
    bool is_send;
    const void* src;
    void* dst;
    size_t bytes;
    int peer;
  };

  void allgather(int rank, const void* mine, void* all, size_t bytes) {
    gathered_[rank].assign(static_cast<const uint8_t*>(mine), static_cast<const uint8_t*>(mine) + bytes);
    barrier_.wait();
    for (int r = 0; r < world_; ++r) std::memcpy(static_cast<uint8_t*>(all) + r * bytes, gathered_[r].data(), bytes);
    barrier_.wait();
  }
  void begin(int rank) { posts_[rank].clear(); }
  void post(int rank, const Post& p) { posts_[rank].push_back(p); }
  void end(int rank, cudaStream_t stream) {
    FP4MOE_CUDA_CHECK(cudaEventRecord(ready_[rank], stream));
    barrier_.wait();
    std::vector<int> nth(world_, 0);
    for (const Post& r : posts_[rank]) {
      if (r.is_send) continue;
      const int p = r.peer;
      int seen = 0;
      const Post* match = nullptr;
      for (const Post& s : posts_[p])
        if (s.is_send && s.peer == rank && seen++ == nth[p]) {
          match = &s;
          break;
        }
      ++nth[p];
      if (match == nullptr) {
        ++mismatches_;
        continue;
      }
      if (match->bytes != r.bytes) ++mismatches_;
      FP4MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, ready_[p], 0));
      FP4MOE_CUDA_CHECK(cudaMemcpyAsync(r.dst, match->src, std::min(match->bytes, r.bytes), cudaMemcpyDeviceToDevice, stream));
    }
    FP4MOE_CUDA_CHECK(cudaEventRecord(done_[rank], stream));
    barrier_.wait();
    for (int p = 0; p < world_; ++p) FP4MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, done_[p], 0));
    barrier_.wait();  // nobody re-records or clears before everyone has waited
  }

 private:
  int world_;
  Barrier barrier_;
  std::vector<std::vector<Post>> posts_;
  std::vector<std::vector<uint8_t>> gathered_;
  std::vector<cudaEvent_t> ready_, done_;
  std::atomic<int> mismatches_{0};
};

class LoopbackTransport final : public EpTransport {
 public:
  LoopbackTransport(LoopbackHub& hub, int rank) : hub_(hub), rank_(rank) {}
  int rank() const override { return rank_; }
  int world_size() const override { return hub_.world(); }
  void allgather(const void* mine, void* all, size_t bytes, cudaStream_t) override {
    hub_.allgather(rank_, mine, all, bytes);
  }
  void begin_exchange() override { hub_.begin(rank_); }
  void send(const void* buf, size_t bytes, int peer, cudaStream_t) override {
    hub_.post(rank_, {true, buf, nullptr, bytes, peer});
  }
  void recv(void* buf, size_t bytes, int peer, cudaStream_t) override {
    hub_.post(rank_, {false, nullptr, buf, bytes, peer});
  }
  void end_exchange(cudaStream_t stream) override { hub_.end(rank_, stream); }

 private:
  LoopbackHub& hub_;
  int rank_;
};

// ---- one EP scenario ----
struct EpCase {
  MoeConfig cfg;
  uint64_t seed = 1;
  std::vector<int64_t> tokens;     // per rank (may be 0)
  std::vector<int> expert_counts;  // per rank; empty: even partition
  double capacity_factor = 0.0;
  int64_t max_tokens = 0;          // 0: the largest of `tokens` (at least 1)
  std::vector<int64_t> step_tokens;  // per rank; empty: 0 (max_tokens) on every rank
  int skew_to_rank = -1;           // >= 0: every token's logits favour that rank's experts
  int world() const { return static_cast<int>(tokens.size()); }
  int64_t total() const {
    int64_t t = 0;
    for (int64_t x : tokens) t += x;
    return t;
  }
  EpPartition partition() const {
    return expert_counts.empty() ? ep_even_partition(cfg.num_experts, world())
                                 : ep_partition_from_counts(cfg.num_experts, expert_counts);
  }
  int64_t capacity_tokens() const {
    int64_t m = max_tokens;
    for (int64_t x : tokens) m = std::max(m, x);
    return std::max<int64_t>(m, 1);
  }
};

// The inputs of all ranks, concatenated in rank order (what the single-GPU layer sees).
struct EpInputs {
  std::vector<uint16_t> hidden;  // bf16 [total, H]
  std::vector<float> logits;     // [total, E]
};

inline EpInputs make_ep_inputs(const EpCase& c) {
  EpInputs in;
  const int64_t n = c.total();
  const std::vector<float> h = make_synthetic_hidden(c.cfg, c.seed, std::max<int64_t>(n, 1));
  in.hidden.resize(static_cast<size_t>(n * c.cfg.hidden));
  for (size_t i = 0; i < in.hidden.size(); ++i) in.hidden[i] = float_to_bf16_bits(h[i]);
  in.logits = make_synthetic_router_logits(c.cfg, c.seed, std::max<int64_t>(n, 1));
  in.logits.resize(static_cast<size_t>(n * c.cfg.num_experts));
  if (c.skew_to_rank >= 0) {
    // Large logits on the chosen rank's experts, low elsewhere: every slot of every token lands there
    // (it holds >= top_k experts in the tests that use this). Seeded noise keeps the order random.
    const EpPartition p = c.partition();
    std::mt19937 rng(static_cast<uint32_t>(c.seed));
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (int64_t t = 0; t < n; ++t)
      for (int e = 0; e < c.cfg.num_experts; ++e)
        in.logits[t * c.cfg.num_experts + e] = (p.owner(e) == c.skew_to_rank ? 8.0f : -8.0f) + u(rng);
  }
  return in;
}

// The single-GPU layer over every rank's tokens; also returns the tile configs it used (the EP ranks
// are given the same ones, which is what makes bit-identity a fair requirement).
struct ReferenceRun {
  std::vector<uint16_t> out;  // [total, H]
  MoeTileConfigs tiles;
};

inline ReferenceRun run_single_gpu_reference(const EpCase& c, const EpInputs& in, const MoeLayerWeights& w,
                                             cudaStream_t s) {
  ReferenceRun r;
  const int64_t n = c.total(), H = c.cfg.hidden;
  MoeLayer layer(c.cfg, w, std::max<int64_t>(n, 1), s);
  const MoeResolvedTileConfigs t = layer.tile_configs(std::max<int64_t>(n, 1));
  r.tiles.gemm1 = t.gemm1;
  r.tiles.gemm2 = t.gemm2;
  if (c.cfg.num_shared > 0) {
    r.tiles.shared_gemm1 = t.shared_gemm1;
    r.tiles.shared_gemm2 = t.shared_gemm2;
  }
  if (n == 0) return r;
  DeviceBuffer<uint8_t> ws(layer.workspace_bytes()), out(static_cast<size_t>(n * H * 2));
  DeviceBuffer<uint8_t> dh = upload(in.hidden), dl = upload(in.logits);
  FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), s));
  layer.forward(s, dh.get(), n, dl.as<float>(), out.get(), ws.get(), ws.bytes());
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  r.out = download<uint16_t>(out.get(), static_cast<size_t>(n * H));
  return r;
}

// What one rank saw.
struct RankResult {
  std::vector<uint16_t> out;   // [T_r, H]
  EpStatus status;             // after the forward, synchronized
  std::string error;           // an exception's message, if any
  bool guard_intact = true;    // the bytes after the workspace were not written
  int32_t rows_received = -1;  // routed rows this rank's experts computed
  std::vector<int32_t> topk_ids, pos_of;  // [T, k]: the routing and where each slot's result came back
  std::vector<uint16_t> eager_out;        // with graph replay: the eager forward's output
};

struct RankRunOptions {
  int forwards = 1;    // eager forwards (the last one's output is reported)
  bool graph = false;  // then capture one forward in a CUDA graph and report its replay's output
};

// Runs the forward of rank `rank` on the current device: builds the full synthetic layer (same seed on
// every rank, so bit-identical weights), slices it, constructs the layer through make_layer, runs
// `forwards` forwards (the last one's output is returned), and reports.
using MakeEpLayer = std::function<EpMoeLayer(const MoeLayerWeights& local, int begin, int count, const EpCapacity& cap,
                                             cudaStream_t s)>;

inline RankResult run_ep_rank(const EpCase& c, const EpInputs& in, int rank, const MoeTileConfigs* tiles,
                              const MakeEpLayer& make_layer, const RankRunOptions& ro = {}) {
  RankResult res;
  try {
    Stream st;
    const EpPartition part = c.partition();
    SyntheticDeviceLayer L = make_synthetic_layer_device(c.cfg, c.seed, st.s);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    EpCapacity cap;
    cap.max_tokens = c.capacity_tokens();
    cap.capacity_factor = c.capacity_factor;
    const int begin = part.begin(rank), count = part.count(rank);
    EpMoeLayer layer = make_layer(ep_slice_weights(c.cfg, L.weights, begin, count), begin, count, cap, st.s);
    L.buffers.clear();
    if (tiles != nullptr) layer.set_tile_configs(*tiles);
    const int64_t H = c.cfg.hidden, E = c.cfg.num_experts, T = c.tokens[rank];
    int64_t first = 0;
    for (int r = 0; r < rank; ++r) first += c.tokens[r];
    const std::vector<uint16_t> h(in.hidden.begin() + first * H, in.hidden.begin() + (first + T) * H);
    const std::vector<float> lg(in.logits.begin() + first * E, in.logits.begin() + (first + T) * E);
    DeviceBuffer<uint8_t> dh = upload(h), dl = upload(lg), out(static_cast<size_t>(std::max<int64_t>(T, 1) * H * 2));
    constexpr size_t kGuard = 4096;
    DeviceBuffer<uint8_t> ws(layer.workspace_bytes() + kGuard);
    // Poisoned: no result may depend on what a workspace held before.
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(ws.get(), 0xab, ws.bytes(), st.s));
    EpForwardOptions opt;
    if (!c.step_tokens.empty()) opt.step_tokens = c.step_tokens[rank];
    auto fwd = [&] {
      layer.forward(st.s, T > 0 ? dh.get() : nullptr, T, T > 0 ? dl.as<float>() : nullptr, T > 0 ? out.get() : nullptr,
                    ws.get(), layer.workspace_bytes(), opt);
    };
    for (int f = 0; f < ro.forwards; ++f) {
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st.s));
      fwd();
    }
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
    res.out = download<uint16_t>(out.get(), static_cast<size_t>(T * H));
    if (ro.graph) {
      res.eager_out = res.out;
      // Poison the workspace too: the graph must not depend on what the eager forwards left there.
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(ws.get(), 0xab, ws.bytes(), st.s));
      FP4MOE_CUDA_CHECK(cudaMemsetAsync(out.get(), 0xff, out.bytes(), st.s));
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      FP4MOE_CUDA_CHECK(cudaStreamBeginCapture(st.s, cudaStreamCaptureModeThreadLocal));
      fwd();
      FP4MOE_CUDA_CHECK(cudaStreamEndCapture(st.s, &graph));
      FP4MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      FP4MOE_CUDA_CHECK(cudaGraphLaunch(exec, st.s));
      FP4MOE_CUDA_CHECK(cudaStreamSynchronize(st.s));
      res.out = download<uint16_t>(out.get(), static_cast<size_t>(T * H));
      FP4MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FP4MOE_CUDA_CHECK(cudaGraphDestroy(graph));
    }
    res.status = layer.status();
    const std::vector<uint8_t> guard = download<uint8_t>(ws.get() + layer.workspace_bytes(), kGuard);
    for (uint8_t b : guard) res.guard_intact = res.guard_intact && b == 0xab;
    const EpIntermediates im = layer.intermediates(ws.get());
    res.rows_received = download<int32_t>(im.local_offsets + count, 1)[0];
    res.topk_ids = download<int32_t>(im.topk_ids, static_cast<size_t>(T * c.cfg.top_k));
    res.pos_of = download<int32_t>(im.pos_of, static_cast<size_t>(T * c.cfg.top_k));
  } catch (const std::exception& e) {
    res.error = e.what();
  }
  return res;
}

// Runs every rank on its own thread (each sets its device first) and waits for all.
inline std::vector<RankResult> run_ep_ranks(const EpCase& c, const EpInputs& in, const std::vector<int>& devices,
                                            const MoeTileConfigs* tiles,
                                            const std::function<MakeEpLayer(int rank)>& layer_factory,
                                            const RankRunOptions& ro = {}) {
  std::vector<RankResult> res(c.world());
  std::vector<std::thread> threads;
  for (int r = 0; r < c.world(); ++r)
    threads.emplace_back([&, r] {
      if (const cudaError_t e = cudaSetDevice(devices[r]); e != cudaSuccess) {
        res[r].error = cudaGetErrorString(e);
        return;
      }
      res[r] = run_ep_rank(c, in, r, tiles, layer_factory(r), ro);
    });
  for (auto& t : threads) t.join();
  return res;
}

// Every rank's output equals the reference's rows of its tokens, bit for bit.
inline void expect_bit_identical(const EpCase& c, const ReferenceRun& ref, const std::vector<RankResult>& res,
                                 const std::string& what) {
  const int64_t H = c.cfg.hidden;
  int64_t first = 0;
  for (int r = 0; r < c.world(); ++r) {
    ASSERT_TRUE(res[r].error.empty()) << what << ": rank " << r << " threw: " << res[r].error;
    EXPECT_EQ(res[r].status.code, 0) << what << ": rank " << r << ": " << ep_status_message(res[r].status, c.capacity_factor);
    EXPECT_TRUE(res[r].guard_intact) << what << ": rank " << r << " wrote past its workspace";
    const int64_t T = c.tokens[r];
    ASSERT_EQ(static_cast<int64_t>(res[r].out.size()), T * H) << what << ": rank " << r;
    int64_t diffs = 0, first_diff = -1;
    for (int64_t i = 0; i < T * H; ++i)
      if (res[r].out[i] != ref.out[first * H + i]) {
        if (first_diff < 0) first_diff = i;
        ++diffs;
      }
    EXPECT_EQ(diffs, 0) << what << ": rank " << r << " differs from the single-GPU layer in " << diffs << " of " << T * H
                        << " values; first at token " << (first_diff < 0 ? -1 : first_diff / H) << ", column "
                        << (first_diff < 0 ? -1 : first_diff % H);
    first += T;
  }
}

// ---- configs of the EP suites: one per router kind, small enough for many scenarios ----
inline MoeConfig ep_softmax_config() {
  MoeConfig c;
  c.name = "ep-softmax";
  c.hidden = 256;
  c.intermediate = 128;
  c.num_experts = 16;
  c.top_k = 4;
  c.router = RouterKind::kSoftmaxTopK;
  c.renormalize = false;
  return c;
}
inline MoeConfig ep_gptoss_config() {
  MoeConfig c;
  c.name = "ep-gptoss";
  c.hidden = 128;
  c.intermediate = 192;
  c.num_experts = 12;
  c.top_k = 4;
  c.router = RouterKind::kGptOss;
  c.renormalize = false;
  c.activation = Activation::kGptOssSwiGLU;
  c.expert_bias = true;
  return c;
}
inline MoeConfig ep_grouped_wide_shared_config() {
  MoeConfig c;
  c.name = "ep-grouped";
  c.hidden = 128;
  c.intermediate = 64;
  c.num_experts = 32;
  c.top_k = 4;
  c.num_shared = 2;  // a shared expert twice the routed width: its own GEMM launches
  c.router = RouterKind::kSigmoidGrouped;
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling = 2.5f;
  return c;
}
// tiny (sigmoid grouped, fused shared expert of the routed width), softmax, gpt-oss, grouped + wide shared.
inline std::vector<MoeConfig> ep_router_configs() {
  return {preset("tiny"), ep_softmax_config(), ep_gptoss_config(), ep_grouped_wide_shared_config()};
}

}  // namespace fp4moe::test
