// Host-only arithmetic of the expert-parallel layer (ep_plan.hpp). No CUDA calls: the CPU suite tests it.
#include "fp4moe/ep_plan.hpp"

#include <algorithm>
#include <climits>
#include <cmath>

#include "fp4moe/error.hpp"
#include "fp4moe/tile_config.hpp"

namespace fp4moe {

// ---- partition ----
int EpPartition::begin(int rank) const {
  FP4MOE_REQUIRE(rank >= 0 && rank < world(), "EpPartition: rank = {} must be in [0, {})", rank, world());
  return expert_begin[rank];
}
int EpPartition::count(int rank) const {
  const int b = begin(rank);  // checks the rank
  return expert_begin[rank + 1] - b;
}

int EpPartition::owner(int expert) const {
  FP4MOE_REQUIRE(expert >= 0 && expert < num_experts, "EpPartition::owner: expert = {} must be in [0, {})", expert,
                 num_experts);
  // upper_bound: the first slice start above `expert`, minus one
  const auto it = std::upper_bound(expert_begin.begin(), expert_begin.end(), expert);
  return static_cast<int>(it - expert_begin.begin()) - 1;
}

EpPartition ep_partition_from_counts(int num_experts, const std::vector<int>& counts) {
  const int world = static_cast<int>(counts.size());
  FP4MOE_REQUIRE(world >= 1 && world <= kMaxEpRanks, "expert parallel: world size = {} must be in [1, {}]", world,
                 kMaxEpRanks);
  FP4MOE_REQUIRE(num_experts >= 1 && num_experts <= kMaxExperts, "expert parallel: num_experts = {} must be in [1, {}]",
                 num_experts, kMaxExperts);
  EpPartition p;
  p.num_experts = num_experts;
  p.expert_begin.assign(1, 0);
  int64_t sum = 0;
  for (int r = 0; r < world; ++r) {
    FP4MOE_REQUIRE(counts[r] >= 1,
                   "expert parallel: rank {} holds {} experts; every rank must hold at least one (a slice of "
                   "the routed experts)", r, counts[r]);
    sum += counts[r];
    FP4MOE_REQUIRE(sum <= num_experts, "expert parallel: the slices of ranks 0..{} hold {} experts, more than E = {}",
                   r, sum, num_experts);
    p.expert_begin.push_back(static_cast<int>(sum));
  }
  FP4MOE_REQUIRE(sum == num_experts,
                 "expert parallel: the {} ranks' slices hold {} experts in total; they must cover all E = {}",
                 world, sum, num_experts);
  return p;
}

EpPartition ep_even_partition(int num_experts, int world) {
  FP4MOE_REQUIRE(world >= 1 && world <= kMaxEpRanks, "expert parallel: world size = {} must be in [1, {}]", world,
                 kMaxEpRanks);
  FP4MOE_REQUIRE(num_experts >= world,
                 "expert parallel: E = {} experts cannot be split over {} ranks (each rank holds at least one)",
                 num_experts, world);
  std::vector<int> counts(world, num_experts / world);
  for (int r = 0; r < num_experts % world; ++r) ++counts[r];
  return ep_partition_from_counts(num_experts, counts);
}

// ---- capacity ----
namespace {
constexpr double kMaxCapacityFactor = 64.0;
}

int64_t ep_capacity_milli(double capacity_factor) {
  FP4MOE_REQUIRE(std::isfinite(capacity_factor) && capacity_factor >= 0.0 && capacity_factor <= kMaxCapacityFactor,
                 "EpCapacity::capacity_factor = {} must be 0 (the worst case) or in (0, {}]", capacity_factor,
                 kMaxCapacityFactor);
  const auto milli = static_cast<int64_t>(std::llround(capacity_factor * 1000.0));
  FP4MOE_REQUIRE(capacity_factor == 0.0 || milli >= 1,
                 "EpCapacity::capacity_factor = {} is below the resolution of 0.001", capacity_factor);
  return milli;
}

void validate_ep_capacity(const MoeConfig& cfg, const EpCapacity& c) {
  FP4MOE_REQUIRE(c.max_tokens >= 1 && c.max_tokens * cfg.top_k <= INT32_MAX / 4,
                 "EpCapacity::max_tokens = {} must be >= 1 and max_tokens * top_k = {} within the int32 row range",
                 c.max_tokens, c.max_tokens * cfg.top_k);
  ep_capacity_milli(c.capacity_factor);
}

int64_t ep_rows_per_peer(const MoeConfig& cfg, const EpPartition& part, int dst, int64_t step_tokens,
                         double capacity_factor) {
  FP4MOE_REQUIRE(step_tokens >= 1, "ep_rows_per_peer: step_tokens = {} must be >= 1", step_tokens);
  const int64_t local = part.count(dst);
  const int64_t per_token = std::min<int64_t>(cfg.top_k, local);  // a token sends a rank <= this many rows
  const int64_t worst = step_tokens * per_token;
  const int64_t milli = ep_capacity_milli(capacity_factor);
  if (milli == 0) return worst;
  // ceil(cf * T * k * local / E) in integers: T * k <= 2^29, local <= 512, milli <= 64000 keep it < 2^63.
  const int64_t num = milli * step_tokens * cfg.top_k * local;
  const int64_t den = int64_t{1000} * part.num_experts;
  const int64_t balanced = (num + den - 1) / den;
  return std::min(worst, std::max(per_token, balanced));
}

// ---- layouts ----
int64_t EpStepLayout::bytes_sent(int64_t hidden) const {
  int64_t b = 0;
  for (int d = 0; d < world; ++d) {
    if (d == rank) continue;
    b += rows_to[d] * hidden * 2 + ep_meta_ints(rows_to[d]) * 4;  // dispatch to d
    b += rows_from * hidden * 2;                                 // reply to d
  }
  return b;
}

int64_t EpStepLayout::bytes_received(int64_t hidden) const {
  int64_t b = 0;
  for (int d = 0; d < world; ++d) {
    if (d == rank) continue;
    b += rows_from * hidden * 2 + ep_meta_ints(rows_from) * 4;  // dispatch from d
    b += rows_to[d] * hidden * 2;                               // reply from d
  }
  return b;
}

EpStepLayout ep_step_layout(const MoeConfig& cfg, const EpPartition& part, int rank, int64_t step_tokens,
                            double capacity_factor) {
  const int world = part.world();
  FP4MOE_REQUIRE(rank >= 0 && rank < world, "ep_step_layout: rank = {} must be in [0, {})", rank, world);
  EpStepLayout s;
  s.rank = rank;
  s.world = world;
  s.step_tokens = step_tokens;
  s.rows_to.resize(world);
  s.send_row_offset.assign(world, -1);
  s.send_meta_offset.assign(world, -1);
  s.ret_row_offset.resize(world);
  for (int d = 0; d < world; ++d) {
    const int64_t p = ep_rows_per_peer(cfg, part, d, step_tokens, capacity_factor);
    s.rows_to[d] = p;
    s.ret_row_offset[d] = s.ret_rows;
    s.ret_rows += p;
    if (d == rank) continue;
    s.send_row_offset[d] = s.send_rows;
    s.send_meta_offset[d] = s.send_meta_ints;
    s.send_rows += p;
    s.send_meta_ints += ep_meta_ints(p);
  }
  s.zero_row = s.ret_rows;
  s.ret_rows += 1;
  s.rows_from = s.rows_to[rank];
  s.recv_rows = world * s.rows_from;
  s.recv_meta_ints = world * ep_meta_ints(s.rows_from);
  // Row indices (pos_of, row_of, expert offsets) are int32 on the device.
  FP4MOE_REQUIRE(s.ret_rows <= INT32_MAX / 2 && s.recv_rows <= INT32_MAX / 2 && s.recv_meta_ints <= INT32_MAX / 2,
                 "expert parallel: rank {} at step_tokens = {} would hold {} reply rows and {} received rows, beyond "
                 "the int32 row range; lower max_tokens or capacity_factor", rank, step_tokens, s.ret_rows,
                 s.recv_rows);
  return s;
}

EpWorkspaceLayout ep_workspace_layout(const MoeConfig& cfg, const EpPartition& part, int rank,
                                      const EpCapacity& capacity) {
  validate_moe_layer_config(cfg);
  validate_ep_capacity(cfg, capacity);
  FP4MOE_REQUIRE(part.num_experts == cfg.num_experts,
                 "ep_workspace_layout: the partition covers {} experts, the config has E = {}", part.num_experts,
                 cfg.num_experts);
  EpWorkspaceLayout l;
  l.max_step = ep_step_layout(cfg, part, rank, capacity.max_tokens, capacity.capacity_factor);
  const EpStepLayout& s = l.max_step;
  const int64_t T = capacity.max_tokens, k = cfg.top_k, E = cfg.num_experts, El = part.count(rank);
  // GEMM1 outputs as wide as the kernels run them (MoeConfig::kernel_intermediate).
  const int64_t H = cfg.hidden, I = cfg.kernel_intermediate();
  const int64_t Is = cfg.kernel_shared_intermediate();  // 0 without a shared expert
  const int64_t n = T * k, R = s.recv_rows;
  size_t off = 0;
  auto take = [&](int64_t bytes) {
    const size_t at = off;
    off = align_up(off + static_cast<size_t>(bytes), 256);
    return at;
  };
  l.topk_ids = take(n * 4);
  l.topk_weights = take(n * 4);
  l.chunk_counts = take(moe_permute_chunks(n) * E * 4);
  l.expert_offsets = take((E + 1) * 4);
  l.row_of = take(n * 4);
  l.row_scale = take(n * 4);
  l.pos_of = take(n * 4);
  l.shared_offsets = take(2 * 4);
  l.send_rows = take(s.send_rows * H * 2);
  l.send_meta = take(s.send_meta_ints * 4);
  l.ret_recv = take(s.ret_rows * H * 2);
  l.recv_rows = take(R * H * 2);
  l.recv_meta = take(s.recv_meta_ints * 4);
  l.recv_ids = take(R * 4);
  l.recv_weights = take(R * 4);
  l.recv_chunk_counts = take(moe_permute_chunks(R) * El * 4);
  l.local_offsets = take((El + 1) * 4);
  l.recv_row_of = take(R * 4);
  l.recv_row_scale = take(R * 4);
  l.sorted = take(R * H * 2);
  l.gemm1_out = take(R * I * 2);
  l.gemm2_out = take(R * H * 2);
  l.ret_send = take(R * H * 2);
  l.shared_gemm1_out = take(T * Is * 2);
  l.shared_gemm2_out = take(cfg.num_shared > 0 ? T * H * 2 : 0);
  l.total = off;
  return l;
}

// ---- dispatch plan ----
EpDispatchPlan ep_dispatch_plan(const MoeConfig& cfg, const EpPartition& part, const EpStepLayout& step,
                                const std::vector<int32_t>& topk_ids) {
  const int k = cfg.top_k, world = part.world();
  FP4MOE_REQUIRE(topk_ids.size() % k == 0, "ep_dispatch_plan: {} ids is not a multiple of top_k = {}",
                 topk_ids.size(), k);
  FP4MOE_REQUIRE(step.world == world, "ep_dispatch_plan: step layout for {} ranks, partition of {}", step.world, world);
  EpDispatchPlan p;
  p.count_to.assign(world, 0);
  p.entries_to.assign(world, {});
  p.pos_of.assign(topk_ids.size(), static_cast<int32_t>(step.zero_row));
  // Stable counting sort by expert: for each expert in order, its entries in flat order.
  std::vector<std::vector<int32_t>> by_expert(cfg.num_experts);
  for (size_t i = 0; i < topk_ids.size(); ++i) by_expert.at(static_cast<size_t>(topk_ids[i])).push_back(static_cast<int32_t>(i));
  for (int e = 0; e < cfg.num_experts; ++e) {
    const int d = part.owner(e);
    for (int32_t i : by_expert[e]) {
      const int64_t idx = p.count_to[d]++;
      if (idx < step.rows_to[d]) {
        p.entries_to[d].push_back(i);
        p.pos_of[i] = static_cast<int32_t>(step.ret_row_offset[d] + idx);
      }
    }
  }
  for (int d = 0; d < world && p.overflow_dst < 0; ++d)
    if (p.count_to[d] > step.rows_to[d]) p.overflow_dst = d;
  return p;
}

// ---- reports ----
std::string ep_status_message(const EpStatus& s, double capacity_factor) {
  switch (static_cast<EpStatusCode>(s.code)) {
    case EpStatusCode::kOk:
      return "no error";
    case EpStatusCode::kCapacityOverflow:
      return fmt::format(
          "EpMoeLayer (seen by rank {}): rank {} routed {} (token, slot) rows to rank {}, whose messages hold {} "
          "rows at step_tokens = {} (capacity_factor = {}); the rows beyond {} were dropped from that forward's "
          "output. Raise EpCapacity::capacity_factor (0 = the worst case, which never overflows) and rebuild "
          "the layer", s.reporter, s.src, s.rows, s.dst, s.capacity, s.step_tokens, capacity_factor, s.capacity);
    case EpStatusCode::kStepMismatch:
      return fmt::format(
          "EpMoeLayer (seen by rank {}): the message from rank {} holds {} rows (its step_tokens = {}) but this "
          "rank expected {} rows (step_tokens = {}); every rank must pass the same EpForwardOptions::step_tokens "
          "to the same forward() (and build the layer with the same config and capacity)",
          s.reporter, s.src, s.rows, s.step_tokens, s.capacity, s.expected_step);
  }
  return fmt::format("EpMoeLayer (seen by rank {}): unknown status code {}", s.reporter, s.code);
}

// ---- handshake ----
namespace {
constexpr int32_t kHandshakeMagic = 0x45504831;  // "EPH1"
}

EpHandshake ep_handshake(const MoeConfig& cfg, int rank, int world, int expert_begin, int expert_count,
                         const EpCapacity& capacity) {
  EpHandshake h;
  h.magic = kHandshakeMagic;
  h.rank = rank;
  h.world = world;
  h.expert_begin = expert_begin;
  h.expert_count = expert_count;
  h.num_experts = cfg.num_experts;
  h.top_k = cfg.top_k;
  h.num_shared = cfg.num_shared;
  h.router = static_cast<int32_t>(cfg.router);
  h.activation = static_cast<int32_t>(cfg.activation);
  h.expert_bias = cfg.expert_bias ? 1 : 0;
  h.n_group = cfg.n_group;
  h.topk_group = cfg.topk_group;
  h.renormalize = cfg.renormalize ? 1 : 0;
  h.hidden = cfg.hidden;
  h.intermediate = cfg.intermediate;
  h.max_tokens = capacity.max_tokens;
  h.capacity_milli = ep_capacity_milli(capacity.capacity_factor);
  return h;
}

EpPartition ep_check_handshake(const std::vector<EpHandshake>& all, int my_rank) {
  const int world = static_cast<int>(all.size());
  FP4MOE_REQUIRE(world >= 1 && my_rank >= 0 && my_rank < world, "EpMoeLayer handshake: rank {} of {} entries",
                 my_rank, world);
  const EpHandshake& me = all[my_rank];
  std::vector<int> counts;
  for (int r = 0; r < world; ++r) {
    const EpHandshake& h = all[r];
    FP4MOE_REQUIRE(h.magic == kHandshakeMagic,
                   "EpMoeLayer handshake: rank {}'s record is not an EpMoeLayer handshake (magic {:#x}); every rank "
                   "of the communicator must construct its EpMoeLayer at the same time", r, h.magic);
    FP4MOE_REQUIRE(h.rank == r && h.world == world,
                   "EpMoeLayer handshake: entry {} says rank {} of {}; the communicator has {} ranks (the rank and "
                   "world size given to each constructor must be the communicator's)", r, h.rank, h.world, world);
    auto same = [&](const char* field, int64_t mine, int64_t theirs) {
      FP4MOE_REQUIRE(mine == theirs,
                     "EpMoeLayer handshake: {} = {} on rank {} but {} on rank {}; every rank must build its layer "
                     "with the same config and capacity", field, mine, my_rank, theirs, r);
    };
    same("num_experts", me.num_experts, h.num_experts);
    same("top_k", me.top_k, h.top_k);
    same("num_shared", me.num_shared, h.num_shared);
    same("router kind", me.router, h.router);
    same("activation", me.activation, h.activation);
    same("expert_bias", me.expert_bias, h.expert_bias);
    same("n_group", me.n_group, h.n_group);
    same("topk_group", me.topk_group, h.topk_group);
    same("renormalize", me.renormalize, h.renormalize);
    same("hidden", me.hidden, h.hidden);
    same("intermediate", me.intermediate, h.intermediate);
    same("max_tokens", me.max_tokens, h.max_tokens);
    same("capacity_factor (thousandths)", me.capacity_milli, h.capacity_milli);
    const int expected_begin = r == 0 ? 0 : all[r - 1].expert_begin + all[r - 1].expert_count;
    FP4MOE_REQUIRE(h.expert_begin == expected_begin,
                   "EpMoeLayer handshake: rank {} holds experts [{}, {}) but the slices must be contiguous in rank "
                   "order, so it must start at {} (where rank {}'s slice ends)", r, h.expert_begin,
                   h.expert_begin + h.expert_count, expected_begin, r - 1);
    counts.push_back(h.expert_count);
  }
  return ep_partition_from_counts(me.num_experts, counts);
}

MoeLayerWeights ep_slice_weights(const MoeConfig& cfg, const MoeLayerWeights& all, int begin, int count) {
  FP4MOE_REQUIRE(begin >= 0 && count >= 1 && begin + count <= cfg.num_experts,
                 "ep_slice_weights: experts [{}, {}) must lie in [0, E = {}) and hold at least one", begin,
                 begin + count, cfg.num_experts);
  // Scales per expert: one byte per 16 (NVFP4 E4M3) or 32 (MXFP4 E8M0) weights along K.
  const int64_t H = cfg.hidden, I = cfg.intermediate, b = begin, sb = cfg.scale_block();
  MoeLayerWeights w = all;
  auto off = [&](const auto* p, int64_t per_expert) -> decltype(p) { return p == nullptr ? p : p + b * per_expert; };
  w.w13_codes = off(all.w13_codes, 2 * I * H / 2);
  w.w13_scales = off(all.w13_scales, 2 * I * H / sb);
  w.w13_global = off(all.w13_global, 1);
  w.w13_global_up = off(all.w13_global_up, 1);
  w.b13 = off(all.b13, 2 * I);
  w.w2_codes = off(all.w2_codes, H * I / 2);
  w.w2_scales = off(all.w2_scales, H * I / sb);
  w.w2_global = off(all.w2_global, 1);
  w.b2 = off(all.b2, H);
  return w;
}

}  // namespace fp4moe
