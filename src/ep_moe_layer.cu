// EpMoeLayer: host launch code of the expert-parallel MoE layer (ep_moe_layer.hpp). Device code:
// include/fp4moe/kernels/ep_dispatch.cuh; the layout arithmetic: ep_plan.cpp; routing, the
// permutations, the expert GEMMs and the combine are MoeLayer's own (moe_layer.cu).
#include "fp4moe/ep_moe_layer.hpp"

#include <algorithm>
#include <vector>

#include "fp4moe/cuda_check.hpp"
#include "launch.hpp"
#include "fp4moe/ep_nccl.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/kernels/ep_dispatch.cuh"
#include "moe_layer_internal.hpp"

namespace fp4moe {

namespace {

bool aligned(const void* p, size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

int row_slices(int64_t h8, int threads) { return static_cast<int>((h8 + threads - 1) / threads); }

}  // namespace

struct EpMoeLayer::Impl {
  MoeConfig cfg;
  EpCapacity cap;
  EpPartition part;
  int rank = 0;
  int world = 1;
  int device = 0;
  int num_sms = 0;
  std::shared_ptr<EpTransport> transport;  // null only for world size 1 without a communicator
  detail::RepackedGemm gemm1, gemm2, shared1, shared2;
  OwnedDeviceBuffer router_bias;
  OwnedDeviceBuffer tile_counters;  // detail::make_tile_counters
  MoeTileConfigs tiles;
  std::vector<MoeResolvedTileConfigs> auto_tiles;  // by world * tokens
  EpWorkspaceLayout layout;
  EpStatus* status = nullptr;         // host-mapped, written by ep_unpack_kernel
  EpStatus* status_device = nullptr;  // its device address

  ~Impl() {
    if (status != nullptr) cudaFreeHost(status);
  }

  void init(const MoeConfig& c, const MoeLayerWeights& w, int expert_begin, int expert_count, const EpCapacity& capacity,
            cudaStream_t stream);
};

void EpMoeLayer::Impl::init(const MoeConfig& c, const MoeLayerWeights& w, int expert_begin, int expert_count,
                            const EpCapacity& capacity, cudaStream_t stream) {
  validate_moe_layer_config(c);
  validate_moe_layer_weights(c, w);
  FP4MOE_REQUIRE(w.router_weight == nullptr,
                 "EpMoeLayer: MoeLayerWeights::router_weight must be null; the expert-parallel layer takes router "
                 "logits (fp32 [T, E]) in forward()");
  validate_ep_capacity(c, capacity);
  FP4MOE_REQUIRE(world >= 1 && world <= kMaxEpRanks && rank >= 0 && rank < world,
                 "EpMoeLayer: rank = {} of world size {}: need 0 <= rank < world size <= {}", rank, world, kMaxEpRanks);
  FP4MOE_REQUIRE(expert_begin >= 0 && expert_count >= 1 && expert_begin + expert_count <= c.num_experts,
                 "EpMoeLayer: this rank's experts [{}, {}) must lie in [0, E = {}) and hold at least one",
                 expert_begin, expert_begin + expert_count, c.num_experts);
  cfg = c;
  cap = capacity;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
  if (transport != nullptr && transport->device() >= 0)
    FP4MOE_REQUIRE(transport->device() == device,
                   "EpMoeLayer: the communicator of rank {} is on device {} but the current device is {}; call "
                   "cudaSetDevice({}) before constructing the layer", rank, transport->device(), device,
                   transport->device());

  // Handshake: every rank's config, capacity and slice, gathered and checked before any message is
  // sized from them (a mismatch would otherwise show up as NCCL size mismatches, i.e. hangs).
  const EpHandshake mine = ep_handshake(c, rank, world, expert_begin, expert_count, capacity);
  std::vector<EpHandshake> all(world);
  if (transport != nullptr) transport->allgather(&mine, all.data(), sizeof(EpHandshake), stream);
  else all[0] = mine;
  part = ep_check_handshake(all, rank);

  FP4MOE_REQUIRE(w.shared_w13_bf16 == nullptr && w.shared_w2_bf16 == nullptr && !w.routed_only,
                 "EpMoeLayer: a bf16 shared expert and routed_only are MoeLayer options, not supported here; pass "
                 "the shared expert as NVFP4 weights, or a config with num_shared = 0");
  detail::LayerGemms g = detail::repack_layer_gemms(c, w, expert_count, stream);
  gemm1 = std::move(g.gemm1);
  gemm2 = std::move(g.gemm2);
  shared1 = std::move(g.shared1);
  shared2 = std::move(g.shared2);
  router_bias = detail::copy_to_owned(w.router_bias, c.num_experts * sizeof(float), stream);
  tile_counters = detail::make_tile_counters(stream);
  auto_tiles = detail::resolve_auto_tiles(c, world * capacity.max_tokens, arch_from_device(device));
  layout = ep_workspace_layout(c, part, rank, capacity);

  FP4MOE_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status), sizeof(EpStatus),
                                  cudaHostAllocMapped | cudaHostAllocPortable));
  *status = EpStatus{};
  status->code = 0;
  FP4MOE_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device), status, 0));

  // NCCL connects a pair of peers on their first send/receive; doing that here, eagerly, keeps it out
  // of any CUDA-graph capture of forward().
  if (transport != nullptr && world > 1) {
    DeviceBuffer<int32_t> ping(static_cast<size_t>(2 * world));
    FP4MOE_CUDA_CHECK(cudaMemsetAsync(ping.get(), 0, ping.bytes(), stream));
    transport->begin_exchange();
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      transport->send(ping.get() + p, sizeof(int32_t), p, stream);
      transport->recv(ping.get() + world + p, sizeof(int32_t), p, stream);
    }
    transport->end_exchange(stream);
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  // The copies read the caller's buffers asynchronously; finishing here lets the caller free them.
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

EpMoeLayer::EpMoeLayer(ncclComm_t comm, int rank, int world_size, const MoeConfig& cfg,
                       const MoeLayerWeights& local_weights, int expert_begin, int expert_count,
                       const EpCapacity& capacity, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  if (comm == nullptr) {
    FP4MOE_REQUIRE(world_size == 1 && rank == 0,
                   "EpMoeLayer: comm is null, which only a world size of 1 allows (rank = {}, world_size = {}); "
                   "pass the rank's NCCL communicator", rank, world_size);
  } else {
    m.transport = make_nccl_transport(comm);
    FP4MOE_REQUIRE(m.transport->rank() == rank && m.transport->world_size() == world_size,
                   "EpMoeLayer: rank = {}, world_size = {} given, but the communicator is rank {} of {}", rank,
                   world_size, m.transport->rank(), m.transport->world_size());
  }
  m.rank = rank;
  m.world = world_size;
  m.init(cfg, local_weights, expert_begin, expert_count, capacity, stream);
}

EpMoeLayer::EpMoeLayer(std::shared_ptr<EpTransport> transport, const MoeConfig& cfg,
                       const MoeLayerWeights& local_weights, int expert_begin, int expert_count,
                       const EpCapacity& capacity, cudaStream_t stream)
    : impl_(std::make_unique<Impl>()) {
  FP4MOE_REQUIRE(transport != nullptr, "EpMoeLayer: transport is null");
  Impl& m = *impl_;
  m.rank = transport->rank();
  m.world = transport->world_size();
  m.transport = std::move(transport);
  m.init(cfg, local_weights, expert_begin, expert_count, capacity, stream);
}

EpMoeLayer::~EpMoeLayer() = default;
EpMoeLayer::EpMoeLayer(EpMoeLayer&&) noexcept = default;
EpMoeLayer& EpMoeLayer::operator=(EpMoeLayer&&) noexcept = default;

const MoeConfig& EpMoeLayer::config() const { return impl_->cfg; }
const EpCapacity& EpMoeLayer::capacity() const { return impl_->cap; }
const EpPartition& EpMoeLayer::partition() const { return impl_->part; }
int EpMoeLayer::rank() const { return impl_->rank; }
int EpMoeLayer::world_size() const { return impl_->world; }
size_t EpMoeLayer::workspace_bytes() const { return impl_->layout.total; }
EpWorkspaceLayout EpMoeLayer::workspace_layout() const { return impl_->layout; }
void EpMoeLayer::set_tile_configs(const MoeTileConfigs& tiles) { impl_->tiles = tiles; }

EpStepLayout EpMoeLayer::step_layout(int64_t step_tokens) const {
  const Impl& m = *impl_;
  FP4MOE_REQUIRE(step_tokens >= 1 && step_tokens <= m.cap.max_tokens,
                 "EpMoeLayer: step_tokens = {} must be in [1, max_tokens = {}]", step_tokens, m.cap.max_tokens);
  return ep_step_layout(m.cfg, m.part, m.rank, step_tokens, m.cap.capacity_factor);
}

MoeResolvedTileConfigs EpMoeLayer::tile_configs(int64_t tokens) const {
  const Impl& m = *impl_;
  return detail::pick_tiles(m.auto_tiles, m.tiles, m.world * std::max<int64_t>(tokens, 1));
}

EpIntermediates EpMoeLayer::intermediates(void* workspace) const {
  const EpWorkspaceLayout& l = impl_->layout;
  char* ws = static_cast<char*>(workspace);
  EpIntermediates r;
  r.topk_ids = reinterpret_cast<int32_t*>(ws + l.topk_ids);
  r.topk_weights = reinterpret_cast<float*>(ws + l.topk_weights);
  r.expert_offsets = reinterpret_cast<int32_t*>(ws + l.expert_offsets);
  r.pos_of = reinterpret_cast<int32_t*>(ws + l.pos_of);
  r.recv_ids = reinterpret_cast<int32_t*>(ws + l.recv_ids);
  r.local_offsets = reinterpret_cast<int32_t*>(ws + l.local_offsets);
  r.ret_recv = ws + l.ret_recv;
  return r;
}

EpStatus EpMoeLayer::status() const {
  const volatile int32_t* s = reinterpret_cast<const volatile int32_t*>(impl_->status);
  EpStatus r;
  r.code = s[0];  // the device writes the code last
  r.reporter = s[1];
  r.src = s[2];
  r.dst = s[3];
  r.rows = s[4];
  r.capacity = s[5];
  r.step_tokens = s[6];
  r.expected_step = s[7];
  return r;
}

void EpMoeLayer::check(cudaStream_t stream) const {
  FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const EpStatus s = status();
  if (s.code != 0) FP4MOE_FAIL("{}", ep_status_message(s, impl_->cap.capacity_factor));
}

void EpMoeLayer::forward(cudaStream_t stream, const void* hidden, int64_t tokens, const float* router_logits,
                         void* out, void* workspace, size_t workspace_size, const EpForwardOptions& opt) const {
  const Impl& m = *impl_;
  const MoeConfig& c = m.cfg;
  const int64_t step = opt.step_tokens == 0 ? m.cap.max_tokens : opt.step_tokens;
  FP4MOE_REQUIRE(step >= 1 && step <= m.cap.max_tokens,
                 "EpMoeLayer::forward: step_tokens = {} must be in [1, max_tokens = {}] (0 means max_tokens)",
                 opt.step_tokens, m.cap.max_tokens);
  FP4MOE_REQUIRE(tokens >= 0 && tokens <= step,
                 "EpMoeLayer::forward: tokens = {} must be in [0, step_tokens = {}] (the bound every rank passes; "
                 "max_tokens = {} is fixed at construction)", tokens, step, m.cap.max_tokens);
  if (tokens > 0) {
    FP4MOE_REQUIRE(hidden != nullptr && aligned(hidden, 16),
                   "EpMoeLayer::forward: hidden = {} must be a non-null, 16-byte aligned bf16 [T, H] device pointer",
                   hidden);
    FP4MOE_REQUIRE(out != nullptr && aligned(out, 16),
                   "EpMoeLayer::forward: out = {} must be a non-null, 16-byte aligned bf16 [T, H] device pointer", out);
    FP4MOE_REQUIRE(router_logits != nullptr && aligned(router_logits, 4),
                   "EpMoeLayer::forward: router_logits = {} must be a non-null, 4-byte aligned fp32 [T, E] device "
                   "pointer", static_cast<const void*>(router_logits));
  }
  FP4MOE_REQUIRE(workspace != nullptr && aligned(workspace, 16),
                 "EpMoeLayer::forward: workspace = {} must be a non-null, 16-byte aligned device pointer", workspace);
  FP4MOE_REQUIRE(workspace_size >= m.layout.total,
                 "EpMoeLayer::forward: workspace_size = {} bytes is less than workspace_bytes() = {}", workspace_size,
                 m.layout.total);
  int device = -1;
  FP4MOE_CUDA_CHECK(cudaGetDevice(&device));
  FP4MOE_REQUIRE(device == m.device, "EpMoeLayer::forward: current device {} differs from device {} the layer was built on",
                 device, m.device);
  if (const EpStatus s = status(); s.code != 0) FP4MOE_FAIL("{}", ep_status_message(s, m.cap.capacity_factor));
  if (m.transport != nullptr) m.transport->check_health();

  const EpStepLayout S = ep_step_layout(c, m.part, m.rank, step, m.cap.capacity_factor);
  const EpWorkspaceLayout& L = m.layout;
  char* ws = static_cast<char*>(workspace);
  auto at = [&](size_t off) { return ws + off; };
  auto i32 = [&](size_t off) { return reinterpret_cast<int32_t*>(ws + off); };
  auto f32 = [&](size_t off) { return reinterpret_cast<float*>(ws + off); };
  const int E = c.num_experts, k = c.top_k, El = m.part.count(m.rank);
  const int64_t H = c.hidden, h8 = H / 8, row_bytes = H * 2;
  const int world = m.world, rank = m.rank;
  // External records: inside a stream capture a plain cudaEventRecord only orders the capture and is
  // never recorded when the graph runs (cudaEventElapsedTime then fails); these become event nodes.
  auto mark = [&](int i) {
    if (opt.stage_events != nullptr)
      detail::record_stage_event(opt.stage_events[i], stream);
  };

  // ---- routing, this rank's pairs sorted by expert (= by destination), the messages ----
  mark(0);
  if (tokens > 0) {
    moe_route(c, router_logits, m.router_bias.as<float>(), tokens, i32(L.topk_ids), f32(L.topk_weights), stream);
    moe_permute(E, k, tokens, i32(L.topk_ids), f32(L.topk_weights), i32(L.chunk_counts), i32(L.expert_offsets),
                i32(L.row_of), f32(L.row_scale), nullptr, stream);
  }
  {
    kernels::EpPackParams p;
    p.topk_ids = i32(L.topk_ids);
    p.topk_weights = f32(L.topk_weights);
    p.expert_offsets = i32(L.expert_offsets);
    p.row_of = i32(L.row_of);
    p.hidden = static_cast<const uint4*>(tokens > 0 ? hidden : nullptr);
    p.send_rows = reinterpret_cast<uint4*>(at(L.send_rows));
    p.send_meta = i32(L.send_meta);
    p.self_rows = reinterpret_cast<uint4*>(at(L.recv_rows)) + rank * S.rows_from * h8;
    p.self_meta = i32(L.recv_meta) + rank * ep_meta_ints(S.rows_from);
    p.pos_of = i32(L.pos_of);
    p.zero_row = reinterpret_cast<uint4*>(at(L.ret_recv)) + S.zero_row * h8;
    p.shared_offsets = c.num_shared > 0 ? i32(L.shared_offsets) : nullptr;
    p.h8 = h8;
    p.tokens = static_cast<int>(tokens);
    p.top_k = k;
    p.world = world;
    p.rank = rank;
    p.row_slices = row_slices(h8, kernels::kEpRowThreads);
    p.step_tokens = static_cast<int>(step);
    p.zero_row_index = static_cast<int32_t>(S.zero_row);
    p.total_rows = static_cast<int32_t>(S.zero_row);
    for (int d = 0; d <= world; ++d) p.expert_begin[d] = m.part.expert_begin[d];
    for (int d = 0; d < world; ++d) {
      p.rows_to[d] = static_cast<int32_t>(S.rows_to[d]);
      p.ret_off[d] = static_cast<int32_t>(S.ret_row_offset[d]);
      p.row_off[d] = S.send_row_offset[d];
      p.meta_off[d] = S.send_meta_offset[d];
    }
    const int64_t meta_blocks =
        std::clamp<int64_t>((S.zero_row + kernels::kEpRowThreads - 1) / kernels::kEpRowThreads, 1,
                            kernels::kEpMaxMetaBlocks);
    const int64_t blocks = tokens * p.row_slices + meta_blocks;
    kernels::ep_pack_kernel<<<static_cast<unsigned>(blocks), kernels::kEpRowThreads, 0, stream>>>(p);
    FP4MOE_CUDA_CHECK_LAUNCH();
  }
  mark(1);

  // ---- dispatch: rows, then metadata, to every other rank ----
  if (world > 1) {
    EpTransport& t = *m.transport;
    const int64_t recv_meta_bytes = ep_meta_ints(S.rows_from) * 4;
    t.begin_exchange();
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      t.send(at(L.send_rows) + S.send_row_offset[p] * row_bytes, S.rows_to[p] * row_bytes, p, stream);
      t.send(i32(L.send_meta) + S.send_meta_offset[p], ep_meta_ints(S.rows_to[p]) * 4, p, stream);
      t.recv(at(L.recv_rows) + p * S.rows_from * row_bytes, S.rows_from * row_bytes, p, stream);
      t.recv(at(L.recv_meta) + p * recv_meta_bytes, recv_meta_bytes, p, stream);
    }
    t.end_exchange(stream);
  }
  mark(2);

  // ---- what arrived: local ids, the local permutation, the expert GEMMs, the replies ----
  {
    kernels::EpUnpackParams p;
    p.recv_meta = i32(L.recv_meta);
    p.ids = i32(L.recv_ids);
    p.weights = f32(L.recv_weights);
    p.status = m.status_device;
    p.meta_ints = ep_meta_ints(S.rows_from);
    p.world = world;
    p.rank = rank;
    p.rows_from = static_cast<int>(S.rows_from);
    p.local_experts = El;
    p.step_tokens = static_cast<int>(step);
    const auto blocks = static_cast<unsigned>((S.recv_rows + kernels::kEpMetaThreads - 1) / kernels::kEpMetaThreads);
    kernels::ep_unpack_kernel<<<blocks, kernels::kEpMetaThreads, 0, stream>>>(p);
    FP4MOE_CUDA_CHECK_LAUNCH();
  }
  // Padding rows carry id -1: the permutation drops them, so the GEMMs see exactly the routed rows.
  moe_permute_gather(El, 1, S.recv_rows, i32(L.recv_ids), f32(L.recv_weights), i32(L.recv_chunk_counts),
                     i32(L.local_offsets), i32(L.recv_row_of), f32(L.recv_row_scale), nullptr, at(L.recv_rows), H,
                     at(L.sorted), stream);
  {
    const MoeResolvedTileConfigs tiles = tile_configs(tokens);
    detail::ExpertGemmBuffers gb;
    gb.sorted = at(L.sorted);
    gb.expert_offsets = i32(L.local_offsets);
    gb.rows = S.recv_rows;
    gb.row_scale = f32(L.recv_row_scale);
    gb.gemm1_out = at(L.gemm1_out);
    gb.gemm2_out = at(L.gemm2_out);
    // The shared expert runs on this rank's own tokens (offsets {0, T} from ep_pack_kernel); with no
    // tokens it has no rows and any aligned buffer stands in for its input.
    gb.shared_act = tokens > 0 ? hidden : at(L.sorted);
    gb.shared_offsets = i32(L.shared_offsets);
    gb.shared_rows = std::max<int64_t>(tokens, 1);
    gb.shared_gemm1_out = at(L.shared_gemm1_out);
    gb.shared_gemm2_out = at(L.shared_gemm2_out);
    gb.tile_counters = m.tile_counters.as<int32_t>();
    const detail::ExpertGemmWeights gw{&m.gemm1.view, &m.gemm2.view, &m.shared1.view, &m.shared2.view};
    detail::run_expert_gemm1(c, gw, gb, tiles, stream);
    detail::run_expert_gemm2(c, gw, gb, tiles, stream);
  }
  {
    kernels::EpReturnParams p;
    p.ids = i32(L.recv_ids);
    p.row_of = i32(L.recv_row_of);
    p.y = reinterpret_cast<const uint4*>(at(L.gemm2_out));
    p.ret_send = reinterpret_cast<uint4*>(at(L.ret_send));
    p.ret_self = reinterpret_cast<uint4*>(at(L.ret_recv)) + S.ret_row_offset[rank] * h8;
    p.h8 = h8;
    p.rows_from = static_cast<int>(S.rows_from);
    p.rank = rank;
    p.slices = row_slices(h8, kernels::kEpRowThreads);
    const auto blocks = static_cast<unsigned>(S.recv_rows * p.slices);
    kernels::ep_return_kernel<<<blocks, kernels::kEpRowThreads, 0, stream>>>(p);
    FP4MOE_CUDA_CHECK_LAUNCH();
  }
  mark(3);

  // ---- replies: every other rank's results for this rank's rows, in this rank's send order ----
  if (world > 1) {
    EpTransport& t = *m.transport;
    t.begin_exchange();
    for (int p = 0; p < world; ++p) {
      if (p == rank) continue;
      t.send(at(L.ret_send) + p * S.rows_from * row_bytes, S.rows_from * row_bytes, p, stream);
      t.recv(at(L.ret_recv) + S.ret_row_offset[p] * row_bytes, S.rows_to[p] * row_bytes, p, stream);
    }
    t.end_exchange(stream);
  }
  mark(4);

  // ---- combine: the single-GPU combine, slot order, rows found through pos_of ----
  if (tokens > 0)
    moe_combine(at(L.ret_recv), c.num_shared > 0 ? at(L.shared_gemm2_out) : nullptr, i32(L.pos_of), k, tokens, H,
                out, stream);
  mark(5);
}

}  // namespace fp4moe
