// sm80-nvfp4-grouped on the GPU against a float64 CPU reference over the exactly dequantized weights:
// every instantiated config, both epilogues, ragged experts (0, 1, tile-straddling sizes), several
// (N, K) including the GLM-5 and gpt-oss shapes. Outputs are poisoned with NaN before each run; every
// row the experts own must be written and the slack rows after them must stay untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <cuda_bf16.h>

#include "fp4moe/device_buffer.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/grouped_gemm.hpp"
#include "fp4moe/kernels/nvfp4_dequant.cuh"
#include "fp4moe/nvfp4_weight_layout.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/synthetic.hpp"

namespace fp4moe {
namespace {

#define REQUIRE_GPU() \
  if (!gpu_available()) GTEST_SKIP() << "no CUDA GPU"

// ---- dequantization on the hardware: every code x every scale, bit-exact ----
__global__ void dequant_all_kernel(const uint32_t* words, const uint32_t* scale_pairs, uint32_t* out, int count) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  uint32_t a[4];
  kernels::dequant_fragment(words[i], kernels::decode_scale_pair(scale_pairs[i], layout::kNvfp4ScaleMul, layout::kNvfp4ScaleAdd), a);
  for (int q = 0; q < 4; ++q) out[4 * i + q] = a[q];
}

TEST(GroupedGemmGpu, DequantFragmentIsExactForEveryCodeAndScale) {
  REQUIRE_GPU();
  std::vector<uint32_t> words, pairs;
  std::vector<std::array<uint8_t, 10>> meta;  // 8 codes, scale g, scale g8
  std::mt19937 rng(11);
  for (int sg = 1; sg < 0x7f; ++sg)
    for (int rep = 0; rep < 16; ++rep) {
      std::array<uint8_t, 10> m{};
      uint32_t w = 0;
      for (int v = 0; v < 8; ++v) {
        m[v] = static_cast<uint8_t>((rep + 3 * v + (rng() & 1) * 5) & 15);  // all codes appear in every slot
        w |= layout::place_code(m[v], v);
      }
      m[8] = static_cast<uint8_t>(sg);
      m[9] = static_cast<uint8_t>(1 + rng() % 0x7e);
      words.push_back(w);
      pairs.push_back(uint32_t{layout::encode_scale(m[8])} | (uint32_t{layout::encode_scale(m[9])} << 16));
      meta.push_back(m);
    }
  DeviceBuffer<uint32_t> dw(words), dp(pairs), dout(words.size() * 4);
  dequant_all_kernel<<<(words.size() + 127) / 128, 128>>>(dw.get(), dp.get(), dout.get(), static_cast<int>(words.size()));
  FP4MOE_CUDA_CHECK_LAUNCH();
  const auto out = dout.download();
  for (size_t i = 0; i < words.size(); ++i)
    for (int v = 0; v < 8; ++v) {
      const int reg = v >> 1, half = v & 1;
      const uint16_t bits = static_cast<uint16_t>(out[4 * i + reg] >> (16 * half));
      const uint8_t scale = (reg & 1) ? meta[i][9] : meta[i][8];  // regs 1 and 3 are row g+8
      const float want = e2m1_to_float(meta[i][v]) * e4m3_to_float(scale) / 256.0f;
      ASSERT_EQ(bf16_bits_to_float(bits), want) << "code " << int(meta[i][v]) << " scale " << int(scale);
    }
}

// ---- the GEMM ----
struct Problem {
  int64_t n, k;
  std::vector<int> rows;  // per expert
  GemmEpilogue epi;
  bool bias = false, row_scale = false, separate_up_scale = false;
  int max_ctas = 0;  // GroupedGemmArgs::max_ctas: few CTAs, many work tiles each
  // GroupedGemmArgs::tile_counter (tma configs): tiles taken in arrival order. The run is then repeated
  // twice with the same counter and once without one (static shares); all must be bit-identical, and the
  // counter zero after each launch.
  bool claimed = false;
};

struct HostExpert {
  Nvfp4Tensor w;       // [n, k] on-disk layout (for SwiGLU: rows [gate; up])
  float global_up = 0; // the up half's own global scale, when separate
  std::vector<float> deq;
};

double silu(double x) { return x / (1.0 + std::exp(-x)); }

void run_problem(const Problem& pb, const TileConfig& cfg, uint64_t seed) {
  const int E = static_cast<int>(pb.rows.size());
  const int64_t n = pb.n, k = pb.k;
  const bool swiglu = pb.epi != GemmEpilogue::kPlain;
  std::vector<int32_t> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + pb.rows[e];
  const int64_t rows = offsets[E];
  const int64_t slack = 5;  // rows past offsets[E]: must remain poisoned
  const int64_t max_rows = rows + slack;
  const int64_t out_cols = swiglu ? n / 2 : n;

  // weights: synthetic floats quantized as ModelOpt does; gate/up optionally with separate globals
  std::vector<HostExpert> ex(E);
  std::vector<uint8_t> codes_all, scales_all;
  std::vector<float> gs(E), gs_up(E), bias(pb.bias ? E * n : 0);
  for (int e = 0; e < E; ++e) {
    std::vector<float> wf(n * k);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t c = 0; c < k; ++c)
        wf[r * k + c] = synth_weight(seed, SynthTensor::kW1Gate, e, r, c, 0.05f);
    if (pb.separate_up_scale) {
      // quantize halves independently: each has its own global scale
      std::vector<float> top(wf.begin(), wf.begin() + n / 2 * k), bot(wf.begin() + n / 2 * k, wf.end());
      for (auto& v : bot) v *= 3.0f;
      auto qt = quantize_nvfp4(top, n / 2, k), qb = quantize_nvfp4(bot, n / 2, k);
      ex[e].w.rows = n; ex[e].w.cols = k;
      ex[e].w.codes = qt.codes; ex[e].w.codes.insert(ex[e].w.codes.end(), qb.codes.begin(), qb.codes.end());
      ex[e].w.scales = qt.scales; ex[e].w.scales.insert(ex[e].w.scales.end(), qb.scales.begin(), qb.scales.end());
      ex[e].w.global_scale = qt.global_scale;
      ex[e].global_up = qb.global_scale;
    } else {
      ex[e].w = quantize_nvfp4(wf, n, k);
      ex[e].global_up = ex[e].w.global_scale;
    }
    ex[e].deq.resize(n * k);
    for (int64_t r = 0; r < n; ++r) {
      const float g = (swiglu && r >= n / 2) ? ex[e].global_up : ex[e].w.global_scale;
      for (int64_t c = 0; c < k; ++c)
        ex[e].deq[r * k + c] = e2m1_to_float(packed_code(ex[e].w.codes.data(), r * k + c)) *
                               e4m3_to_float(ex[e].w.scales[r * (k / 16) + c / 16]) * g;
    }
    gs[e] = ex[e].w.global_scale;
    gs_up[e] = ex[e].global_up;
    std::vector<uint8_t> rc(repacked_codes_bytes(n, k)), rs(repacked_scales_bytes(n, k));
    repack_nvfp4_weights(ex[e].w.codes.data(), ex[e].w.scales.data(), n, k, swiglu, rc.data(), rs.data());
    codes_all.insert(codes_all.end(), rc.begin(), rc.end());
    scales_all.insert(scales_all.end(), rs.begin(), rs.end());
    for (int64_t r = 0; r < (pb.bias ? n : 0); ++r) bias[e * n + r] = synth_normal(synth_key(seed, 77, e, r, 0)) * 0.1f;
  }
  // activations (bf16), router-like row scales
  std::vector<uint16_t> act(max_rows * k);
  std::vector<float> rs_host(max_rows);
  for (int64_t r = 0; r < max_rows; ++r) {
    for (int64_t c = 0; c < k; ++c) act[r * k + c] = float_to_bf16_bits(synth_normal(synth_key(seed, 99, 0, r, c)));
    rs_host[r] = 0.25f + 0.5f * static_cast<float>(r % 7) / 7.0f;
  }

  DeviceBuffer<uint8_t> d_codes(codes_all), d_scales(scales_all);
  DeviceBuffer<float> d_gs(gs), d_gs_up(gs_up), d_bias(bias), d_rs(rs_host);
  DeviceBuffer<uint16_t> d_act(act), d_out(max_rows * out_cols);
  DeviceBuffer<int32_t> d_off(offsets);
  FP4MOE_CUDA_CHECK(cudaMemset(d_out.get(), 0xff, d_out.bytes()));  // bf16 0xffff = NaN

  GroupedWeightsView w;
  w.num_experts = E; w.n = n; w.k = k; w.gate_up_interleaved = swiglu;
  w.codes = d_codes.get(); w.scales = d_scales.get(); w.global_scale = d_gs.get();
  w.global_scale_up = (swiglu && pb.separate_up_scale) ? d_gs_up.get() : nullptr;
  w.bias = pb.bias ? d_bias.get() : nullptr;
  GroupedGemmArgs a;
  a.act = d_act.get(); a.expert_offsets = d_off.get(); a.max_rows = max_rows;
  a.row_scale = pb.row_scale ? d_rs.get() : nullptr; a.out = d_out.get(); a.epilogue = pb.epi;
  a.max_ctas = pb.max_ctas;
  DeviceBuffer<int32_t> d_counter(std::vector<int32_t>{0, 0});
  if (pb.claimed) a.tile_counter = d_counter.get();
  grouped_gemm_nvfp4(w, a, cfg, nullptr);
  FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const auto out = d_out.download();
  if (pb.claimed) {
    EXPECT_EQ(d_counter.download(), (std::vector<int32_t>{0, 0})) << cfg.name() << ": the launch left its counter set";
    for (int again = 0; again < 3; ++again) {
      FP4MOE_CUDA_CHECK(cudaMemset(d_out.get(), 0xff, d_out.bytes()));
      a.tile_counter = again < 2 ? d_counter.get() : nullptr;
      grouped_gemm_nvfp4(w, a, cfg, nullptr);
      FP4MOE_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(d_out.download() == out) << cfg.name() << (again < 2 ? ": a repeated launch" : ": static shares")
                                           << " differs from the first launch (bits)";
      EXPECT_EQ(d_counter.download(), (std::vector<int32_t>{0, 0})) << cfg.name();
    }
  }

  double err2 = 0, ref2 = 0;
  int64_t unwritten = 0, clobbered = 0;
  for (int e = 0; e < E; ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; ++r) {
      std::vector<double> acc(n, 0.0);
      for (int64_t f = 0; f < n; ++f) {
        double s = 0;
        const float* wr = ex[e].deq.data() + f * k;
        for (int64_t c = 0; c < k; ++c) s += double(bf16_bits_to_float(act[r * k + c])) * wr[c];
        acc[f] = s + (pb.bias ? bias[e * n + f] : 0.0);
      }
      for (int64_t j = 0; j < out_cols; ++j) {
        double ref;
        if (pb.epi == GemmEpilogue::kPlain) ref = acc[j] * (pb.row_scale ? rs_host[r] : 1.0);
        else if (pb.epi == GemmEpilogue::kSwiGLU) ref = silu(acc[j]) * acc[n / 2 + j];
        else {
          const double gt = std::min(acc[j], 7.0), up = std::clamp(acc[n / 2 + j], -7.0, 7.0);
          ref = (up + 1.0) * gt / (1.0 + std::exp(-1.702 * gt));
        }
        const float got = bf16_bits_to_float(out[r * out_cols + j]);
        if (std::isnan(got)) { ++unwritten; continue; }
        err2 += (got - ref) * (got - ref);
        ref2 += ref * ref;
      }
    }
  for (int64_t r = rows; r < max_rows; ++r)
    for (int64_t j = 0; j < out_cols; ++j) clobbered += out[r * out_cols + j] != 0xffff;
  const double rel = std::sqrt(err2 / std::max(ref2, 1e-30));
  EXPECT_EQ(unwritten, 0) << cfg.name();
  EXPECT_EQ(clobbered, 0) << cfg.name() << ": rows past offsets[E] were written";
  // bf16 output rounding alone is ~2^-9 relative per element (~2e-3 rms); fp32 accumulation adds ~1e-6.
  EXPECT_LT(rel, 4e-3) << cfg.name() << " n=" << n << " k=" << k;
}

std::vector<int> ragged(int E, int max_rows, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> r(E);
  for (auto& x : r) x = static_cast<int>(rng() % (max_rows + 1));
  r[0] = 0;
  if (E > 1) r[1] = 1;
  if (E > 2) r[E - 1] = 0;
  return r;
}

TEST(GroupedGemmGpu, EveryConfigBothEpiloguesRaggedExperts) {
  REQUIRE_GPU();
  for (int ci = 0; ci < kNumGemmConfigs; ++ci) {
    const TileConfig cfg = kGemmConfigs[ci];
    const int64_t k = cfg.bk >= 128 ? 2 * cfg.bk : 3 * cfg.bk;  // several k-stages, never a multiple of 128 for bk 64
    std::vector<int> rows = ragged(5, 2 * cfg.bt + 3, 100 + ci);
    rows[2] = cfg.bt + 1;  // straddles a token tile
    run_problem({cfg.bn * 2 + 16 * (cfg.bn > 64), k, rows, GemmEpilogue::kPlain, false, true}, cfg, 1 + ci);
    run_problem({cfg.bn + 32, k, rows, GemmEpilogue::kSwiGLU}, cfg, 2 + ci);
  }
}

TEST(GroupedGemmGpu, GptOssEpilogueWithBiasesAndSeparateUpScale) {
  REQUIRE_GPU();
  run_problem({5760 / 8, 2880 / 9 / 64 * 64, {3, 0, 17, 1}, GemmEpilogue::kGptOssSwiGLU, true, false, true},
              TileConfig{128, 32, 64, 8, 8}, 7);
  run_problem({2880 / 4, 2880, {9, 1, 0, 33}, GemmEpilogue::kPlain, true, true}, TileConfig{128, 32, 64, 8, 8}, 8);
  run_problem({256, 512, {5, 40, 0, 2}, GemmEpilogue::kSwiGLU, false, false, true}, TileConfig{128, 64, 128, 4, 8}, 9);
}

TEST(GroupedGemmGpu, Glm5Shapes) {
  REQUIRE_GPU();
  // GLM-5: GEMM1 N=4096 K=6144 (SwiGLU), GEMM2 N=6144 K=2048; a few experts, decode-like sizes
  run_problem({4096, 6144, {1, 0, 7, 33}, GemmEpilogue::kSwiGLU}, TileConfig{128, 16, 128, 6, 8}, 21);
  run_problem({6144, 2048, {2, 31, 0, 65}, GemmEpilogue::kPlain, false, true}, TileConfig{128, 32, 128, 5, 8}, 22);
  run_problem({6144, 2048, {130, 3}, GemmEpilogue::kPlain, false, true}, TileConfig{256, 64, 64, 4, 8}, 23);
}

// Stream configs (the decode kernel) split each CTA's units evenly over its warps, so a warp's slice can
// start and end inside an m16 tile; split tiles are summed after the round's barrier. Few units per CTA
// (narrow N, long K, few rows) split every m-tile over many warps; several token tiles per expert and
// rounds that cross expert boundaries exercise the round logic.
TEST(GroupedGemmGpu, StreamConfigsSplitTilesAndRounds) {
  REQUIRE_GPU();
  for (int ci = 0; ci < kNumGemmConfigs; ++ci) {
    const TileConfig cfg = kGemmConfigs[ci];
    if (cfg.mma != 2) continue;
    SCOPED_TRACE(cfg.name());
    // 2 m-tiles x 96 chunks per segment: most CTAs idle, the busy ones split each m-tile across warps.
    // Where the rows of K = 6144 do not fit (sm_120's 99 KB per block: bt 16 x 6144 x 2 B alone is 192 KB),
    // the launch must refuse with the arithmetic instead.
    if (plan_sm80(cfg, arch_from_device(0), 0, 6144).verdict.valid) {
      run_problem({32, 6144, {1, 0, 2 * cfg.bt + 5, 3}, GemmEpilogue::kPlain, false, true}, cfg, 40 + ci);
      run_problem({32, 6144, {cfg.bt, 1, 0, 0, 7}, GemmEpilogue::kSwiGLU}, cfg, 41 + ci);
    } else {
      try {
        run_problem({32, 6144, {cfg.bt, 1, 0, 0, 7}, GemmEpilogue::kSwiGLU}, cfg, 41 + ci);
        ADD_FAILURE() << "launched at K = 6144 although the planner refuses it";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("of shared memory per block"), std::string::npos) << e.what();
      }
    }
    // many experts of 0..bt+2 rows, GLM-like N: rounds cross expert boundaries inside a CTA
    run_problem({1024, 1024, ragged(24, cfg.bt + 2, 50 + ci), GemmEpilogue::kSwiGLU}, cfg, 42 + ci);
    // gpt-oss K = 2880 = 45 chunks (not a multiple of 128), biases, separate up scale
    run_problem({5760 / 8, 2880, {3, 0, cfg.bt + 1, 1}, GemmEpilogue::kGptOssSwiGLU, true, false, true}, cfg,
                43 + ci);
  }
}

// Stream configs: slices of many whole m-tiles per warp and round (many token tiles x many m-tiles of a
// short K, 1 and 2 chunks per m-tile), with empty experts and partial token tiles in between: the path
// from one m-tile's end to the next m-tile of the same round, taken once per m-tile at decode.
TEST(GroupedGemmGpu, StreamConfigsManyWholeMtilesPerSlice) {
  REQUIRE_GPU();
  for (int ci = 0; ci < kNumGemmConfigs; ++ci) {
    const TileConfig cfg = kGemmConfigs[ci];
    if (cfg.mma != 2) continue;
    SCOPED_TRACE(cfg.name());
    run_problem({4096, 64, ragged(130, 2 * cfg.bt + 3, 70 + ci), GemmEpilogue::kSwiGLU}, cfg, 70 + ci);
    run_problem({2048, 128, ragged(90, cfg.bt + 2, 71 + ci), GemmEpilogue::kPlain, false, true}, cfg, 71 + ci);
  }
}

TEST(GroupedGemmGpu, StreamGlm5DecodeShapes) {
  REQUIRE_GPU();
  run_problem({4096, 6144, {1, 0, 3, 8, 2}, GemmEpilogue::kSwiGLU}, TileConfig{384, 8, 64, 4, 24, 2, 1}, 31);
  run_problem({6144, 2048, {2, 9, 0, 1}, GemmEpilogue::kPlain, false, true}, TileConfig{384, 16, 64, 4, 24, 2, 1},
              32);
}

// tma configs (sm_90a): every instruction width a tile can pick (each width of tma_widths with its
// narrowest and widest rows, every activation box's exact height bt/4 .. bt, then a second token tile
// of one row), a partial feature tile (n = bn + 48), one K stage and several, both epilogues; empty
// experts in between. Elsewhere the launch must refuse them with the reason.
TEST(GroupedGemmGpu, TmaConfigsEveryTileWidth) {
  REQUIRE_GPU();
  const ArchInfo arch = arch_from_device(0);
  for (int ci = 0; ci < kNumGemmConfigs; ++ci) {
    const TileConfig cfg = kGemmConfigs[ci];
    if (cfg.mma != 3) continue;
    SCOPED_TRACE(cfg.name());
    const int q = cfg.bt / 4;
    std::vector<int> rows = {0, q, 2 * q, 0, 3 * q, cfg.bt, cfg.bt + 1, 2 * cfg.bt + 5};
    const TmaWidths tw = tma_widths(cfg);
    for (int i = 0; i < tw.n; ++i) {  // each width's narrowest and widest tile
      rows.push_back(i == 0 ? 1 : tw.w[i - 1] + 1);
      rows.push_back(tw.w[i]);
    }
    if (!plan_sm80(cfg, arch).verdict.valid) {
      try {
        run_problem({cfg.bn + 48, cfg.bk, rows, GemmEpilogue::kPlain}, cfg, 60 + ci);
        ADD_FAILURE() << "launched although the planner refuses it on " << arch.name;
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("sm_90a"), std::string::npos) << e.what();
      }
      continue;
    }
    run_problem({cfg.bn + 48, cfg.bk, rows, GemmEpilogue::kPlain, true, true}, cfg, 60 + ci);
    run_problem({cfg.bn + 48, 3 * cfg.bk, rows, GemmEpilogue::kSwiGLU}, cfg, 61 + ci);
    run_problem({2 * cfg.bn, 5 * cfg.bk, {cfg.bt + 3, 0, 2}, GemmEpilogue::kPlain, false, true}, cfg, 62 + ci);
  }
}

// tma configs: experts whose last two token tiles share their rest at a cut other than the plain one
// (tma_token_tile: e.g. bt 256, 534 rows -> 256 + 144 + 134), beside ones where the plain cut stays; both
// epilogues, a partial feature tile, empty experts in between.
TEST(GroupedGemmGpu, TmaConfigsLastTwoTilesCut) {
  REQUIRE_GPU();
  const ArchInfo arch = arch_from_device(0);
  int ran = 0;
  for (int ci = 0; ci < kNumGemmConfigs; ++ci) {
    const TileConfig cfg = kGemmConfigs[ci];
    if (cfg.mma != 3 || !plan_sm80(cfg, arch).verdict.valid) continue;
    SCOPED_TRACE(cfg.name());
    // the first and last rest (bt < R <= 2 bt) that moves the cut; evenly spaced lists (bt 32) never do
    int lo = 0, hi = 0;
    for (int R = cfg.bt + 1; R <= 2 * cfg.bt; ++R) {
      if (tma_token_tile(cfg, R, 0).rows == cfg.bt) continue;
      if (lo == 0) lo = R;
      hi = R;
    }
    if (lo == 0) continue;
    const std::vector<int> rows = {0, lo, 3, hi + cfg.bt, 0, cfg.bt + 1, 2 * cfg.bt - 1, lo + 2 * cfg.bt, 0};
    run_problem({cfg.bn + 48, 2 * cfg.bk, rows, GemmEpilogue::kPlain, true, true}, cfg, 120 + ci);
    run_problem({2 * cfg.bn, 3 * cfg.bk, rows, GemmEpilogue::kSwiGLU}, cfg, 121 + ci);
    ++ran;
  }
  if (ran == 0) GTEST_SKIP() << "no tma config with a moved cut is valid on " << arch.name << " (they need sm_90a)";
}

// f(ci, cfg) for every tma config valid on this GPU, under a SCOPED_TRACE of its name; how many ran.
template <class F>
int for_each_valid_tma_config(const ArchInfo& arch, F&& f) {
  int ran = 0;
  for (int ci = 0; ci < kNumGemmConfigs; ++ci) {
    const TileConfig cfg = kGemmConfigs[ci];
    if (cfg.mma != 3 || !plan_sm80(cfg, arch).verdict.valid) continue;
    SCOPED_TRACE(cfg.name());
    f(ci, cfg);
    ++ran;
  }
  return ran;
}

// Two launches of few CTAs with many work tiles each: 7 token tiles (ragged, empty experts between) x 3
// feature tiles, K of 3 stages (not dividing the ring), plain epilogue with bias and row scales, on
// ctas_a CTAs; x 2 feature tiles, K of more stages than the ring holds, SwiGLU, on ctas_b CTAs.
void run_many_tiles_per_cta(const TileConfig& cfg, int ctas_a, int ctas_b, bool claimed, uint64_t seed) {
  const std::vector<int> rows = {cfg.bt + 9, 0, 3, 2 * cfg.bt, 0, cfg.bt / 2 + 1, 1};  // 7 token tiles
  Problem a{3 * cfg.bn - 48, 3 * cfg.bk, rows, GemmEpilogue::kPlain, true, true};     // x 3 feature tiles
  a.max_ctas = ctas_a;
  a.claimed = claimed;
  run_problem(a, cfg, seed);
  Problem b{2 * cfg.bn, (cfg.stages + 3) * cfg.bk, rows, GemmEpilogue::kSwiGLU};
  b.max_ctas = ctas_b;
  b.claimed = claimed;
  run_problem(b, cfg, seed + 1);
}

// tma configs with few CTAs, so each runs many work tiles in turn: the stage ring's position and its
// barriers' phases carry across tiles, which a launch of one tile per CTA never reaches. One CTA (every
// tile on one SM), two and three; ragged experts with empty ones, K of 3 stages (not dividing the ring)
// and of more stages than the ring holds.
TEST(GroupedGemmGpu, TmaConfigsManyTilesPerCta) {
  REQUIRE_GPU();
  const ArchInfo arch = arch_from_device(0);
  const int ran = for_each_valid_tma_config(arch, [](int ci, const TileConfig& cfg) {
    run_many_tiles_per_cta(cfg, 1, 2, /*claimed=*/false, 90 + ci);
    Problem c{3 * cfg.bn - 48, 2 * cfg.bk, {1, 2 * cfg.bt + 5, 0, cfg.bt}, GemmEpilogue::kPlain, false, true};
    c.max_ctas = 3;
    run_problem(c, cfg, 92 + ci);
  });
  if (ran == 0) GTEST_SKIP() << "no tma config is valid on " << arch.name << " (they need sm_90a)";
  // the stream configs refuse it
  try {
    Problem s{32, 128, {3}, GemmEpilogue::kPlain};
    s.max_ctas = 2;
    run_problem(s, TileConfig{384, 8, 64, 4, 24, 2, 1}, 3);
    ADD_FAILURE() << "a stream config launched with max_ctas";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("max_ctas = 2 applies to tile-scheduled configs"), std::string::npos)
        << e.what();
  }
}

// tma configs taking work tiles in arrival order (GroupedGemmArgs::tile_counter): few CTAs with many
// tiles each (every tile after the first is claimed), and a full grid with more tiles than CTAs; ragged
// experts with empty ones and partial tiles, both epilogues, K shorter and longer than the ring.
// run_problem checks the result against the reference, bit-identity with static shares and repeated
// launches, and that each launch leaves the counter zero.
TEST(GroupedGemmGpu, TmaConfigsClaimTilesInArrivalOrder) {
  REQUIRE_GPU();
  const ArchInfo arch = arch_from_device(0);
  const int ran = for_each_valid_tma_config(arch, [](int ci, const TileConfig& cfg) {
    run_many_tiles_per_cta(cfg, 2, 5, /*claimed=*/true, 150 + ci);
    // a full grid: ~300 tiles (40 experts, ~1.5 token tiles each, 5 feature tiles) for 132 SMs
    Problem c{4 * cfg.bn + 16, cfg.bk, ragged(40, 2 * cfg.bt, 152 + ci), GemmEpilogue::kPlain, false, true};
    c.claimed = true;
    run_problem(c, cfg, 152 + ci);
  });
  if (ran == 0) GTEST_SKIP() << "no tma config is valid on " << arch.name << " (they need sm_90a)";
}

// tma configs with 128-wide stages at K not a multiple of 128 (tile_config_has_k_tail): the last stage's
// copies reach past K and TMA fills them with zeros. K = 64 (the only stage is the partial one), 3 x 64,
// more stages than the ring holds plus a half (the tail lands at a ring position other than 0, tiles
// claimed in arrival order on few CTAs), and gpt-oss's K = 2880 with its epilogue (biases, separate up
// scale). Ragged experts with empty ones and partial token and feature tiles; every result against the
// float64 reference over the exactly dequantized weights.
TEST(GroupedGemmGpu, TmaConfigsKTail) {
  REQUIRE_GPU();
  const ArchInfo arch = arch_from_device(0);
  int ran = 0;
  for_each_valid_tma_config(arch, [&](int ci, const TileConfig& cfg) {
    if (cfg.bk % 128 != 0) return;  // 64-wide stages divide every K the kernels take
    const std::vector<int> rows = {cfg.bt + 5, 0, 3, 1, 2 * cfg.bt - 1, 0};
    run_problem({cfg.bn + 48, 64, rows, GemmEpilogue::kPlain, true, true}, cfg, 180 + ci);
    run_problem({2 * cfg.bn, 3 * 64, rows, GemmEpilogue::kSwiGLU}, cfg, 181 + ci);
    Problem many{2 * cfg.bn - 16, (cfg.stages + 2) * cfg.bk + 64, rows, GemmEpilogue::kPlain, false, true};
    many.max_ctas = 2;
    many.claimed = true;
    run_problem(many, cfg, 182 + ci);
    run_problem({2 * cfg.bn, 2880, {3, 0, 17, cfg.bt + 1}, GemmEpilogue::kGptOssSwiGLU, true, false, true}, cfg,
                183 + ci);
    ++ran;
  });
  if (ran == 0) GTEST_SKIP() << "no tma config with 128-wide stages is valid on " << arch.name << " (they need sm_90a)";
}

TEST(GroupedGemmGpu, RejectsBadArguments) {
  GroupedWeightsView w;
  w.num_experts = 2; w.n = 128; w.k = 96;
  GroupedGemmArgs a;
  try {
    grouped_gemm_nvfp4(w, a, kGemmConfigs[0], nullptr);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k = 96"), std::string::npos) << e.what();
  }
  // Routing ids (the layer's GEMM1): more ids than rows is refused before anything is launched.
  w.k = 128;
  w.codes = reinterpret_cast<const uint8_t*>(uintptr_t{256});
  w.scales = reinterpret_cast<const uint8_t*>(uintptr_t{512});
  const float gs = 1.0f;
  w.global_scale = &gs;
  a.act = reinterpret_cast<const void*>(uintptr_t{1024});
  a.expert_offsets = reinterpret_cast<const int32_t*>(uintptr_t{2048});
  a.out = reinterpret_cast<void*>(uintptr_t{4096});
  a.max_rows = 8;
  a.route_ids = reinterpret_cast<const int32_t*>(uintptr_t{8192});
  a.route_entries = 9;
  try {
    grouped_gemm_nvfp4(w, a, TileConfig{384, 8, 64, 4, 24, 2, 1}, nullptr);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("route_entries = 9 must not exceed max_rows = 8"), std::string::npos)
        << e.what();
  }
  // A tma config's tile counter must be 8-byte aligned.
  a.route_ids = nullptr;
  a.route_entries = 0;
  a.tile_counter = reinterpret_cast<int32_t*>(uintptr_t{8196});
  for (const TileConfig& cfg : kGemmConfigs) {
    if (cfg.mma != 3) continue;
    try {
      grouped_gemm_nvfp4(w, a, cfg, nullptr);
      FAIL() << cfg.name();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("tile_counter = 0x2004 must be 8-byte aligned"), std::string::npos)
          << e.what();
    }
    break;
  }
}

}  // namespace
}  // namespace fp4moe
