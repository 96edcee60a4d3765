// Checkpoint format detection, config.json parsing and the MoE layer loaders (checkpoint.hpp).
// Host code only; the upload to the GPU is checkpoint_upload.cpp.
#include "fp4moe/checkpoint.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "fp4moe/error.hpp"
#include "fp4moe/format_math.hpp"

namespace fp4moe {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

json read_json_file(const std::string& dir, const std::string& name) {
  std::ifstream f(fs::path(dir) / name, std::ios::binary);
  FP4MOE_REQUIRE(f.good(), "{}: cannot be read", name);
  std::stringstream ss;
  ss << f.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  FP4MOE_REQUIRE(!j.is_discarded(), "{}: not well-formed JSON", name);
  FP4MOE_REQUIRE(j.is_object(), "{}: must be a JSON object", name);
  return j;
}

// Typed lookups in config.json with errors naming the key.
const json* find_key(const json& j, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    auto it = j.find(k);
    if (it != j.end() && !it->is_null()) return &*it;
  }
  return nullptr;
}
int64_t get_int(const json& j, std::initializer_list<const char*> keys, const char* file) {
  const json* v = find_key(j, keys);
  FP4MOE_REQUIRE(v != nullptr, "{}: key '{}' is missing", file, *keys.begin());
  FP4MOE_REQUIRE(v->is_number_integer(), "{}: key '{}' must be an integer; it is {}", file, *keys.begin(), v->dump());
  return v->get<int64_t>();
}
int64_t get_int_or(const json& j, std::initializer_list<const char*> keys, int64_t dflt, const char* file) {
  return find_key(j, keys) ? get_int(j, keys, file) : dflt;
}
double get_num_or(const json& j, const char* key, double dflt, const char* file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  FP4MOE_REQUIRE(it->is_number(), "{}: key '{}' must be a number; it is {}", file, key, it->dump());
  return it->get<double>();
}
bool get_bool_or(const json& j, const char* key, bool dflt, const char* file) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  FP4MOE_REQUIRE(it->is_boolean(), "{}: key '{}' must be true or false; it is {}", file, key, it->dump());
  return it->get<bool>();
}
std::string get_str_or(const json& j, const char* key, const std::string& dflt) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : dflt;
}

bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

void default_warn(const std::string& s) { std::fprintf(stderr, "fp4moe: warning: %s\n", s.c_str()); }

// ---------------------------------------------------------------------------------------------------
// Architectures
// ---------------------------------------------------------------------------------------------------

enum class Arch { kQwenMoe, kDeepSeekLike, kGptOss, kMixtral };

Arch arch_of(const std::string& model_type, const std::string& architecture) {
  if (model_type == "qwen3_moe" || architecture == "Qwen3MoeForCausalLM") return Arch::kQwenMoe;
  if (model_type == "deepseek_v3" || model_type == "kimi_k2" || model_type == "glm4_moe" ||
      model_type == "glm_moe_dsa" || model_type == "deepseek_v32" || architecture == "DeepseekV3ForCausalLM" ||
      architecture == "Glm4MoeForCausalLM" || architecture == "GlmMoeDsaForCausalLM")
    return Arch::kDeepSeekLike;
  if (model_type == "gpt_oss" || architecture == "GptOssForCausalLM") return Arch::kGptOss;
  if (model_type == "mixtral" || architecture == "MixtralForCausalLM") return Arch::kMixtral;
  FP4MOE_FAIL("config.json: model_type '{}' (architecture '{}') is not a supported MoE architecture; supported: "
              "qwen3_moe, deepseek_v3, kimi_k2, glm4_moe, glm_moe_dsa (GLM-5), gpt_oss, mixtral",
              model_type, architecture);
}

void parse_model(const json& c, CheckpointInfo& info) {
  const char* F = "config.json";
  info.model_type = get_str_or(c, "model_type", "");
  if (auto it = c.find("architectures"); it != c.end() && it->is_array() && !it->empty() && (*it)[0].is_string())
    info.architecture = (*it)[0].get<std::string>();
  const Arch arch = arch_of(info.model_type, info.architecture);
  MoeConfig& m = info.moe;
  m.name = fs::path(info.dir).filename().string();
  if (m.name.empty()) m.name = fs::path(info.dir).parent_path().filename().string();
  m.hidden = get_int(c, {"hidden_size"}, F);
  info.num_layers = static_cast<int>(get_int(c, {"num_hidden_layers"}, F));
  FP4MOE_REQUIRE(info.num_layers >= 1 && info.num_layers <= 100000, "{}: num_hidden_layers = {} must be >= 1", F,
                 info.num_layers);
  m.top_k = static_cast<int>(get_int(c, {"num_experts_per_tok", "experts_per_token"}, F));
  info.layer_prefix_fmt = "model.layers.{}.mlp";
  std::vector<char> is_moe(static_cast<size_t>(info.num_layers), 1);
  switch (arch) {
    case Arch::kQwenMoe: {
      m.intermediate = get_int(c, {"moe_intermediate_size"}, F);
      m.num_experts = static_cast<int>(get_int(c, {"num_experts", "num_local_experts"}, F));
      m.router = RouterKind::kSoftmaxTopK;
      m.renormalize = get_bool_or(c, "norm_topk_prob", false, F);
      const int64_t step = get_int_or(c, {"decoder_sparse_step"}, 1, F);
      FP4MOE_REQUIRE(step >= 1, "{}: decoder_sparse_step = {} must be >= 1", F, step);
      std::vector<int64_t> mlp_only;
      if (auto it = c.find("mlp_only_layers"); it != c.end() && it->is_array())
        for (const auto& v : *it)
          if (v.is_number_integer()) mlp_only.push_back(v.get<int64_t>());
      for (int l = 0; l < info.num_layers; ++l)
        is_moe[l] = std::find(mlp_only.begin(), mlp_only.end(), l) == mlp_only.end() && (l + 1) % step == 0;
      FP4MOE_REQUIRE(get_int_or(c, {"shared_expert_intermediate_size"}, 0, F) == 0,
                     "{}: shared_expert_intermediate_size is set: a gated shared expert (Qwen2-MoE) is not supported",
                     F);
      break;
    }
    case Arch::kDeepSeekLike: {
      m.intermediate = get_int(c, {"moe_intermediate_size"}, F);
      m.num_experts = static_cast<int>(get_int(c, {"n_routed_experts"}, F));
      m.num_shared = static_cast<int>(get_int_or(c, {"n_shared_experts"}, 0, F));
      m.router = RouterKind::kSigmoidGrouped;
      const std::string scoring = get_str_or(c, "scoring_func", "sigmoid");
      FP4MOE_REQUIRE(scoring == "sigmoid", "{}: scoring_func '{}' is not supported (sigmoid is)", F, scoring);
      m.n_group = static_cast<int>(get_int_or(c, {"n_group"}, 1, F));
      m.topk_group = static_cast<int>(get_int_or(c, {"topk_group"}, 1, F));
      m.routed_scaling = static_cast<float>(get_num_or(c, "routed_scaling_factor", 1.0, F));
      m.renormalize = get_bool_or(c, "norm_topk_prob", true, F);
      const int64_t first_dense = get_int_or(c, {"first_k_dense_replace"}, 0, F);
      const int64_t freq = get_int_or(c, {"moe_layer_freq"}, 1, F);
      FP4MOE_REQUIRE(freq >= 1, "{}: moe_layer_freq = {} must be >= 1", F, freq);
      for (int l = 0; l < info.num_layers; ++l) is_moe[l] = l >= first_dense && l % freq == 0;
      break;
    }
    case Arch::kGptOss: {
      m.intermediate = get_int(c, {"intermediate_size"}, F);
      m.num_experts = static_cast<int>(get_int(c, {"num_local_experts", "num_experts"}, F));
      m.router = RouterKind::kGptOss;
      m.renormalize = false;
      m.activation = Activation::kGptOssSwiGLU;
      m.swiglu_limit = static_cast<float>(get_num_or(c, "swiglu_limit", 7.0, F));
      m.swiglu_alpha = 1.702f;  // fixed in the reference implementation (no config key)
      m.expert_bias = true;
      break;
    }
    case Arch::kMixtral: {
      m.intermediate = get_int(c, {"intermediate_size"}, F);
      m.num_experts = static_cast<int>(get_int(c, {"num_local_experts"}, F));
      m.router = RouterKind::kSoftmaxTopK;
      m.renormalize = true;
      info.layer_prefix_fmt = "model.layers.{}.block_sparse_moe";
      break;
    }
  }
  for (int l = 0; l < info.num_layers; ++l)
    if (is_moe[l]) info.moe_layers.push_back(l);
  FP4MOE_REQUIRE(!info.moe_layers.empty(), "{}: no decoder layer is an MoE layer", F);
}

// ---------------------------------------------------------------------------------------------------
// Formats
// ---------------------------------------------------------------------------------------------------

std::vector<std::string> string_list(const json& j, const char* key) {
  std::vector<std::string> r;
  if (auto it = j.find(key); it != j.end() && it->is_array())
    for (const auto& v : *it)
      if (v.is_string()) r.push_back(v.get<std::string>());
  return r;
}

void parse_format(const json& c, const std::string& dir, CheckpointInfo& info) {
  const json* qc = find_key(c, {"quantization_config"});
  std::error_code ec;
  const bool has_hfq = fs::exists(fs::path(dir) / "hf_quant_config.json", ec);
  const std::string method = qc && qc->is_object() ? get_str_or(*qc, "quant_method", "") : "";
  if (has_hfq || method == "modelopt") {
    // hf_quant_config.json is ModelOpt's own record; newer exports repeat it in config.json.
    json q;
    std::string file = "hf_quant_config.json";
    if (has_hfq) {
      const json h = read_json_file(dir, "hf_quant_config.json");
      auto it = h.find("quantization");
      FP4MOE_REQUIRE(it != h.end() && it->is_object(), "hf_quant_config.json: missing the 'quantization' object");
      q = *it;
      if (auto p = h.find("producer"); p != h.end() && p->is_object())
        info.format_detail = fmt::format("producer {} {}", get_str_or(*p, "name", "?"), get_str_or(*p, "version", "?"));
    } else {
      q = *qc;
      file = "config.json";
    }
    const std::string algo = get_str_or(q, "quant_algo", "");
    FP4MOE_REQUIRE(algo == "NVFP4" || algo == "MIXED_PRECISION",
                   "{}: quant_algo '{}' is not supported (NVFP4, or MIXED_PRECISION with NVFP4 experts)", file, algo);
    if (algo == "NVFP4") {
      const int64_t gs = get_int_or(q, {"group_size"}, 16, file.c_str());
      FP4MOE_REQUIRE(gs == 16, "{}: group_size = {}; NVFP4 has one scale per 16 elements", file, gs);
    } else {
      auto ql = q.find("quantized_layers");
      FP4MOE_REQUIRE(ql != q.end() && ql->is_object() && !ql->empty(),
                     "{}: quant_algo MIXED_PRECISION needs a quantized_layers object (module -> quant_algo)", file);
      for (auto it = ql->begin(); it != ql->end(); ++it) {
        FP4MOE_REQUIRE(it->is_object(), "{}: quantized_layers[\"{}\"] must be an object", file, it.key());
        info.quantized_layers[it.key()] = fmt::format("{}/{}", get_str_or(*it, "quant_algo", "?"),
                                                      get_int_or(*it, {"group_size"}, 0, file.c_str()));
      }
    }
    info.format = CheckpointFormat::kModelOptNvfp4;
    info.unquantized = string_list(q, "exclude_modules");
    info.format_detail = fmt::format("quant_algo {}, group_size 16{}{}", algo, info.format_detail.empty() ? "" : ", ",
                                     info.format_detail);
    return;
  }
  FP4MOE_REQUIRE(qc != nullptr && qc->is_object(),
                 "config.json: no quantization_config and no hf_quant_config.json: an unquantized checkpoint (fp4moe "
                 "runs NVFP4 or MXFP4 experts)");
  if (method == "compressed-tensors") {
    const std::string fmt_name = get_str_or(*qc, "format", "");
    FP4MOE_REQUIRE(fmt_name == "nvfp4-pack-quantized",
                   "config.json: quantization_config.format '{}' is not supported (compressed-tensors "
                   "'nvfp4-pack-quantized' is)", fmt_name);
    auto groups = qc->find("config_groups");
    FP4MOE_REQUIRE(groups != qc->end() && groups->is_object() && !groups->empty(),
                   "config.json: quantization_config.config_groups is missing");
    for (auto g = groups->begin(); g != groups->end(); ++g) {
      auto w = g->find("weights");
      if (w == g->end() || !w->is_object()) continue;
      const int64_t bits = get_int_or(*w, {"num_bits"}, 0, "config.json");
      const int64_t gsz = get_int_or(*w, {"group_size"}, 0, "config.json");
      const std::string type = get_str_or(*w, "type", "");
      FP4MOE_REQUIRE(bits == 4 && type == "float" && gsz == 16,
                     "config.json: config_groups.{}.weights is {}-bit {} with group_size {}; NVFP4 is 4-bit float "
                     "with group_size 16", g.key(), bits, type, gsz);
      if (auto ia = g->find("input_activations"); ia != g->end() && ia->is_object()) info.activation_scales = true;
    }
    info.format = CheckpointFormat::kCompressedTensorsNvfp4;
    info.unquantized = string_list(*qc, "ignore");
    info.format_detail = info.activation_scales ? "group_size 16, W4A4 (activation scales present)" : "group_size 16, weights only";
    return;
  }
  if (method == "mxfp4") {
    info.format = CheckpointFormat::kGptOssMxfp4;
    info.unquantized = string_list(*qc, "modules_to_not_convert");
    info.format_detail = "OCP MX, E8M0 scale per 32 elements";
    info.moe.format = WeightFormat::kMxfp4;
    return;
  }
  FP4MOE_FAIL("config.json: quantization_config.quant_method '{}' is not a supported format (modelopt NVFP4, "
              "compressed-tensors nvfp4-pack-quantized, mxfp4)", method);
}

// ---------------------------------------------------------------------------------------------------
// Tensor checks
// ---------------------------------------------------------------------------------------------------

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

// The tensor, checked for dtype (one of `dtypes`) and shape.
TensorRef expect(const SafetensorsCheckpoint& ck, const std::string& name, std::initializer_list<SafetensorsDtype> dtypes,
                 const std::vector<int64_t>& shape) {
  TensorRef t = ck.tensor(name);
  bool ok = false;
  std::string want;
  for (SafetensorsDtype d : dtypes) {
    ok = ok || t.info->dtype == d;
    want += (want.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  FP4MOE_REQUIRE(ok, "{}: tensor '{}' has dtype {}; expected {}", t.file, name, dtype_name(t.info->dtype), want);
  FP4MOE_REQUIRE(t.info->shape == shape, "{}: tensor '{}' has shape {}; expected {}", t.file, name,
                 t.info->shape_str(), shape_str(shape));
  return t;
}

// A scalar F32 tensor ([] or [1]).
float scalar_f32(const SafetensorsCheckpoint& ck, const std::string& name) {
  TensorRef t = ck.tensor(name);
  FP4MOE_REQUIRE(t.info->dtype == SafetensorsDtype::kF32, "{}: tensor '{}' has dtype {}; expected F32", t.file, name,
                 dtype_name(t.info->dtype));
  FP4MOE_REQUIRE(t.info->numel() == 1, "{}: tensor '{}' has shape {}; expected a scalar ([] or [1])", t.file, name,
                 t.info->shape_str());
  float v;
  std::memcpy(&v, t.data, 4);
  return v;
}

float global_scale(const SafetensorsCheckpoint& ck, const std::string& name, bool reciprocal) {
  const float v = scalar_f32(ck, name);
  const std::string file(ck.tensor(name).file);
  FP4MOE_REQUIRE(std::isfinite(v) && v > 0.0f, "{}: tensor '{}' = {} must be a finite, positive global scale", file,
                 name, v);
  if (!reciprocal) return v;
  const float r = 1.0f / v;
  FP4MOE_REQUIRE(std::isfinite(r) && r > 0.0f, "{}: tensor '{}' = {}: its reciprocal {} is not a usable scale", file,
                 name, v, r);
  return r;
}

// Reads a vector of float from an F32 or BF16 tensor of `n` elements.
std::vector<float> read_floats(const SafetensorsCheckpoint& ck, const std::string& name, const std::vector<int64_t>& shape) {
  TensorRef t = expect(ck, name, {SafetensorsDtype::kF32, SafetensorsDtype::kBF16}, shape);
  std::vector<float> r(static_cast<size_t>(t.info->numel()));
  for (size_t i = 0; i < r.size(); ++i) {
    if (t.info->dtype == SafetensorsDtype::kF32) {
      std::memcpy(&r[i], t.data + 4 * i, 4);
    } else {
      uint16_t b;
      std::memcpy(&b, t.data + 2 * i, 2);
      r[i] = bf16_bits_to_float(b);
    }
    FP4MOE_REQUIRE(std::isfinite(r[i]), "{}: tensor '{}' element {} = {} is not finite", t.file, name, i, r[i]);
  }
  return r;
}

std::vector<uint16_t> read_bf16(const SafetensorsCheckpoint& ck, const std::string& name,
                                const std::vector<int64_t>& shape, bool* was_f32 = nullptr) {
  TensorRef t = expect(ck, name, {SafetensorsDtype::kBF16, SafetensorsDtype::kF32}, shape);
  std::vector<uint16_t> r(static_cast<size_t>(t.info->numel()));
  if (was_f32) *was_f32 = t.info->dtype == SafetensorsDtype::kF32;
  if (t.info->dtype == SafetensorsDtype::kBF16) {
    std::memcpy(r.data(), t.data, r.size() * 2);
  } else {
    for (size_t i = 0; i < r.size(); ++i) {
      float v;
      std::memcpy(&v, t.data + 4 * i, 4);
      r[i] = float_to_bf16_bits(v);
    }
  }
  for (size_t i = 0; i < r.size(); ++i)
    FP4MOE_REQUIRE(std::isfinite(bf16_bits_to_float(r[i])), "{}: tensor '{}' element {} is not finite", t.file, name, i);
  return r;
}

// ---------------------------------------------------------------------------------------------------
// Copies with a progress bar
// ---------------------------------------------------------------------------------------------------

struct CopyTask {
  const uint8_t* src;
  uint8_t* dst;
  size_t bytes;
};

void run_copies(const std::vector<CopyTask>& tasks, int threads, bool progress, const std::string& what) {
  size_t total = 0;
  for (const auto& t : tasks) total += t.bytes;
  const bool bar = progress && stderr_is_terminal() && total > (64u << 20);
  std::atomic<size_t> next{0}, done{0};
  // Large tensors are split so that threads share the work evenly.
  constexpr size_t kPiece = 8u << 20;
  std::vector<CopyTask> pieces;
  for (const auto& t : tasks)
    for (size_t o = 0; o < t.bytes; o += kPiece) pieces.push_back({t.src + o, t.dst + o, std::min(kPiece, t.bytes - o)});
  auto worker = [&] {
    for (;;) {
      const size_t i = next.fetch_add(1);
      if (i >= pieces.size()) return;
      std::memcpy(pieces[i].dst, pieces[i].src, pieces[i].bytes);
      done.fetch_add(pieces[i].bytes);
    }
  };
  if (threads <= 0) threads = static_cast<int>(std::min(8u, std::max(1u, std::thread::hardware_concurrency())));
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) pool.emplace_back(worker);
  if (bar) {
    while (done.load() < total) {
      const double f = static_cast<double>(done.load()) / static_cast<double>(total);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const int w = 30, filled = static_cast<int>(f * w);
      std::fprintf(stderr, "\r%s [%s%s] %5.1f%% %.2f GB %.1f GB/s", what.c_str(), std::string(filled, '#').c_str(),
                   std::string(w - filled, ' ').c_str(), 100.0 * f, static_cast<double>(done.load()) / 1e9,
                   s > 0 ? static_cast<double>(done.load()) / 1e9 / s : 0.0);
      std::fflush(stderr);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  for (auto& t : pool) t.join();
  if (bar) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "\r%s [%s] 100.0%% %.2f GB in %.2f s (%.1f GB/s)\n", what.c_str(), std::string(30, '#').c_str(),
                 static_cast<double>(total) / 1e9, s, static_cast<double>(total) / 1e9 / std::max(s, 1e-9));
  }
}

// ---------------------------------------------------------------------------------------------------
// NVFP4 loaders (ModelOpt, compressed-tensors)
// ---------------------------------------------------------------------------------------------------

struct Nvfp4Names {
  std::string codes, scales, global;
  bool reciprocal = false;
};
Nvfp4Names nvfp4_names(CheckpointFormat f, const std::string& module) {
  if (f == CheckpointFormat::kCompressedTensorsNvfp4)
    return {module + ".weight_packed", module + ".weight_scale", module + ".weight_global_scale", true};
  return {module + ".weight", module + ".weight_scale", module + ".weight_scale_2", false};
}

// MIXED_PRECISION checkpoints list each quantized module; an expert projection must be NVFP4/16.
void check_mixed_precision(const CheckpointInfo& info, const std::string& module) {
  if (info.quantized_layers.empty()) return;
  auto it = info.quantized_layers.find(module);
  FP4MOE_REQUIRE(it != info.quantized_layers.end(),
                 "hf_quant_config.json: quantized_layers does not list '{}' (MIXED_PRECISION); fp4moe needs every "
                 "expert projection in NVFP4", module);
  FP4MOE_REQUIRE(it->second == "NVFP4/16",
                 "hf_quant_config.json: quantized_layers['{}'] is {} (quant_algo/group_size); fp4moe runs NVFP4 "
                 "experts with group size 16", module, it->second);
}

// One NVFP4 projection [n, k]: checked; its global scale returned, bytes scheduled for copying.
struct Nvfp4Proj {
  TensorRef codes, scales;
  float global = 1.0f;
};
Nvfp4Proj nvfp4_proj(const SafetensorsCheckpoint& ck, CheckpointFormat f, const std::string& module, int64_t n,
                     int64_t k) {
  const Nvfp4Names nm = nvfp4_names(f, module);
  Nvfp4Proj p;
  {
    // Group size: the scale tensor's width says it (k/32 columns would be a group of 32).
    TensorRef s = ck.tensor(nm.scales);
    if (s.info->shape.size() == 2 && s.info->shape[0] == n && s.info->shape[1] != k / 16 && s.info->shape[1] > 0 &&
        k % s.info->shape[1] == 0)
      FP4MOE_FAIL("{}: tensor '{}' has shape {}: a group size of {}; NVFP4 has one scale per 16 elements", s.file,
                  nm.scales, s.info->shape_str(), k / s.info->shape[1]);
  }
  p.codes = expect(ck, nm.codes, {SafetensorsDtype::kU8}, {n, k / 2});
  p.scales = expect(ck, nm.scales, {SafetensorsDtype::kF8E4M3}, {n, k / 16});
  p.global = global_scale(ck, nm.global, nm.reciprocal);
  return p;
}

// Requantizes NVFP4 rows in place (codes [rows, k/2], scales [rows, k/16]) from global g_old to g_new
// (>= g_old): each block's values e2m1 * e4m3 * g_old are quantized again with ModelOpt's recipe.
void requantize_nvfp4(uint8_t* codes, uint8_t* scales, int64_t rows, int64_t k, float g_old, float g_new) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < k / 16; ++b) {
      uint8_t& s = scales[r * (k / 16) + b];
      uint8_t* c = codes + r * (k / 2) + b * 8;
      float x[16], amax = 0.0f;
      for (int i = 0; i < 16; ++i) {
        const uint8_t code = static_cast<uint8_t>((c[i / 2] >> ((i & 1) * 4)) & 0xf);
        x[i] = nvfp4_dequantize_element(code, s, g_old);
        amax = std::max(amax, std::fabs(x[i]));
      }
      s = nvfp4_block_scale(amax, g_new);
      for (int i = 0; i < 8; ++i)
        c[i] = static_cast<uint8_t>(nvfp4_quantize_element(x[2 * i], s, g_new) |
                                    (nvfp4_quantize_element(x[2 * i + 1], s, g_new) << 4));
    }
}

void check_e4m3_scales(const TensorRef& t, const std::string& name) {
  for (size_t i = 0; i < t.bytes(); ++i) {
    const uint8_t s = t.data[i];
    FP4MOE_REQUIRE((s & 0x7f) != 0x7f && !(s & 0x80 && (s & 0x7f) != 0),
                   "{}: tensor '{}' element {} (row {}, block {}) is {} (E4M3 block scales must be finite and >= 0)",
                   t.file, name, i, i / static_cast<size_t>(t.info->shape[1]), i % static_cast<size_t>(t.info->shape[1]),
                   (s & 0x7f) == 0x7f ? "NaN" : "negative");
  }
}

void load_nvfp4_experts(const SafetensorsCheckpoint& ck, const CheckpointInfo& info, int layer, const LoadOptions& opts,
                        HostMoeLayer& out) {
  const MoeConfig& c = out.cfg;
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  const std::string P = info.layer_prefix(layer);
  const bool mixtral = info.layer_prefix_fmt.find("block_sparse_moe") != std::string::npos;
  const char* gname = mixtral ? "w1" : "gate_proj";
  const char* uname = mixtral ? "w3" : "up_proj";
  const char* dname = mixtral ? "w2" : "down_proj";
  out.w13_codes = HostBytes(static_cast<size_t>(E * 2 * I * H / 2));
  out.w13_scales = HostBytes(static_cast<size_t>(E * 2 * I * H / 16));
  out.w2_codes = HostBytes(static_cast<size_t>(E * H * I / 2));
  out.w2_scales = HostBytes(static_cast<size_t>(E * H * I / 16));
  out.w13_global.resize(static_cast<size_t>(E));
  out.w2_global.resize(static_cast<size_t>(E));
  std::vector<CopyTask> tasks;
  std::vector<std::pair<int, std::pair<float, float>>> mismatched;  // expert, (gate, up) globals
  for (int64_t e = 0; e < E; ++e) {
    const std::string ex = fmt::format("{}.experts.{}.", P, e);
    for (const char* nm : {gname, uname, dname}) check_mixed_precision(info, ex + nm);
    const Nvfp4Proj g = nvfp4_proj(ck, info.format, ex + gname, I, H);
    const Nvfp4Proj u = nvfp4_proj(ck, info.format, ex + uname, I, H);
    const Nvfp4Proj d = nvfp4_proj(ck, info.format, ex + dname, H, I);
    for (const auto& [p, nm] : {std::pair{&g, gname}, {&u, uname}, {&d, dname}})
      check_e4m3_scales(p->scales, nvfp4_names(info.format, ex + nm).scales);
    const size_t gc = static_cast<size_t>(I * H / 2), gs = static_cast<size_t>(I * H / 16);
    tasks.push_back({g.codes.data, out.w13_codes.data() + e * 2 * gc, gc});
    tasks.push_back({u.codes.data, out.w13_codes.data() + e * 2 * gc + gc, gc});
    tasks.push_back({g.scales.data, out.w13_scales.data() + e * 2 * gs, gs});
    tasks.push_back({u.scales.data, out.w13_scales.data() + e * 2 * gs + gs, gs});
    tasks.push_back({d.codes.data, out.w2_codes.data() + e * gc, gc});
    tasks.push_back({d.scales.data, out.w2_scales.data() + e * gs, gs});
    out.w13_global[e] = std::max(g.global, u.global);
    out.w2_global[e] = d.global;
    if (g.global != u.global) mismatched.push_back({static_cast<int>(e), {g.global, u.global}});
  }
  run_copies(tasks, opts.threads, opts.progress, fmt::format("layer {}", layer));
  // The fused GEMM1 applies one global scale to gate and up; requantize the smaller-scaled half to
  // the larger scale (the block scales then shrink, never overflow E4M3).
  for (const auto& [e, gu] : mismatched) {
    const bool gate_smaller = gu.first < gu.second;
    const int64_t row0 = gate_smaller ? 0 : I;
    const float g_old = gate_smaller ? gu.first : gu.second, g_new = std::max(gu.first, gu.second);
    requantize_nvfp4(out.w13_codes.data() + (e * 2 * I + row0) * H / 2, out.w13_scales.data() + (e * 2 * I + row0) * H / 16,
                     I, H, g_old, g_new);
  }
  if (!mismatched.empty()) {
    const auto& [e, gu] = mismatched.front();
    out.warnings.push_back(fmt::format(
        "layer {}: {} of {} experts have different global scales for {} and {} (expert {}: {} vs {}); the GEMM "
        "applies one global scale to both, so the half with the smaller scale was requantized to the larger one "
        "(its values move by up to half an E2M1 step of the new block scale)",
        layer, mismatched.size(), E, gname, uname, e, gu.first, gu.second));
  }
}

void load_nvfp4_shared(const SafetensorsCheckpoint& ck, const CheckpointInfo& info, int layer, HostMoeLayer& out) {
  const MoeConfig& c = out.cfg;
  const int64_t H = c.hidden, Is = c.intermediate * c.num_shared;
  const std::string S = info.layer_prefix(layer) + ".shared_experts.";
  if (out.shared == SharedExpertStorage::kBf16) {
    std::vector<uint16_t> g = read_bf16(ck, S + "gate_proj.weight", {Is, H});
    std::vector<uint16_t> u = read_bf16(ck, S + "up_proj.weight", {Is, H});
    out.shared_w13_bf16 = std::move(g);
    out.shared_w13_bf16.insert(out.shared_w13_bf16.end(), u.begin(), u.end());
    out.shared_w2_bf16 = read_bf16(ck, S + "down_proj.weight", {H, Is});
    return;
  }
  for (const char* nm : {"gate_proj", "up_proj", "down_proj"}) check_mixed_precision(info, S + nm);
  const Nvfp4Proj g = nvfp4_proj(ck, info.format, S + "gate_proj", Is, H);
  const Nvfp4Proj u = nvfp4_proj(ck, info.format, S + "up_proj", Is, H);
  const Nvfp4Proj d = nvfp4_proj(ck, info.format, S + "down_proj", H, Is);
  for (const auto& [p, nm] : {std::pair{&g, "gate_proj"}, {&u, "up_proj"}, {&d, "down_proj"}})
    check_e4m3_scales(p->scales, nvfp4_names(info.format, S + nm).scales);
  auto cat = [](const TensorRef& a, const TensorRef& b) {
    std::vector<uint8_t> v(a.data, a.data + a.bytes());
    v.insert(v.end(), b.data, b.data + b.bytes());
    return v;
  };
  out.shared_w13_codes = cat(g.codes, u.codes);
  out.shared_w13_scales = cat(g.scales, u.scales);
  out.shared_w2_codes.assign(d.codes.data, d.codes.data + d.codes.bytes());
  out.shared_w2_scales.assign(d.scales.data, d.scales.data + d.scales.bytes());
  out.shared_w13_global = std::max(g.global, u.global);
  out.shared_w2_global = d.global;
  if (g.global != u.global) {
    const bool gate_smaller = g.global < u.global;
    const int64_t row0 = gate_smaller ? 0 : Is;
    requantize_nvfp4(out.shared_w13_codes.data() + row0 * H / 2, out.shared_w13_scales.data() + row0 * H / 16, Is, H,
                     std::min(g.global, u.global), out.shared_w13_global);
    out.warnings.push_back(fmt::format(
        "layer {}: the shared expert's gate_proj and up_proj have different global scales ({} vs {}); the {} half "
        "was requantized to the larger scale", layer, g.global, u.global, gate_smaller ? "gate" : "up"));
  }
}

// ---------------------------------------------------------------------------------------------------
// gpt-oss MXFP4
// ---------------------------------------------------------------------------------------------------

void check_e8m0(const TensorRef& t, const std::string& name, int64_t rows_per_expert, int64_t blocks) {
  for (size_t i = 0; i < t.bytes(); ++i)
    if (t.data[i] == 0xff) {
      const int64_t e = static_cast<int64_t>(i) / (rows_per_expert * blocks);
      const int64_t r = (static_cast<int64_t>(i) / blocks) % rows_per_expert, b = static_cast<int64_t>(i) % blocks;
      FP4MOE_FAIL("{}: tensor '{}' [expert {}, row {}, block {}] is 0xFF, the E8M0 NaN", t.file, name, e, r, b);
    }
}

void load_gptoss(const SafetensorsCheckpoint& ck, const CheckpointInfo& info, int layer, const LoadOptions& opts,
                 HostMoeLayer& out) {
  const MoeConfig& c = out.cfg;
  const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate;
  FP4MOE_REQUIRE(H % 32 == 0 && I % 32 == 0, "config.json: hidden_size = {} and intermediate_size = {} must be "
                 "multiples of 32 (the MXFP4 block)", H, I);
  const std::string P = info.layer_prefix(layer) + ".experts.";
  const TensorRef gu_b = expect(ck, P + "gate_up_proj_blocks", {SafetensorsDtype::kU8}, {E, 2 * I, H / 32, 16});
  const TensorRef gu_s = expect(ck, P + "gate_up_proj_scales", {SafetensorsDtype::kU8, SafetensorsDtype::kF8E8M0},
                                {E, 2 * I, H / 32});
  const TensorRef d_b = expect(ck, P + "down_proj_blocks", {SafetensorsDtype::kU8}, {E, H, I / 32, 16});
  const TensorRef d_s = expect(ck, P + "down_proj_scales", {SafetensorsDtype::kU8, SafetensorsDtype::kF8E8M0},
                               {E, H, I / 32});
  check_e8m0(gu_s, P + "gate_up_proj_scales", 2 * I, H / 32);
  check_e8m0(d_s, P + "down_proj_scales", H, I / 32);
  const std::vector<float> gu_bias = read_floats(ck, P + "gate_up_proj_bias", {E, 2 * I});
  out.b2 = read_floats(ck, P + "down_proj_bias", {E, H});
  out.w13_codes = HostBytes(static_cast<size_t>(E * 2 * I * H / 2));
  out.w13_scales = HostBytes(static_cast<size_t>(E * 2 * I * H / 32));
  out.w2_codes = HostBytes(static_cast<size_t>(E * H * I / 2));
  out.w2_scales = HostBytes(static_cast<size_t>(E * H * I / 32));
  // Rows 2j (gate) and 2j+1 (up) on disk -> rows j and I + j.
  std::vector<CopyTask> tasks;
  const size_t rc = static_cast<size_t>(H / 2), rs = static_cast<size_t>(H / 32);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < 2 * I; ++r) {
      const int64_t dst = e * 2 * I + (r % 2 == 0 ? r / 2 : I + r / 2);
      tasks.push_back({gu_b.data + (e * 2 * I + r) * rc, out.w13_codes.data() + dst * rc, rc});
      tasks.push_back({gu_s.data + (e * 2 * I + r) * rs, out.w13_scales.data() + dst * rs, rs});
    }
  tasks.push_back({d_b.data, out.w2_codes.data(), d_b.bytes()});
  tasks.push_back({d_s.data, out.w2_scales.data(), d_s.bytes()});
  run_copies(tasks, opts.threads, opts.progress, fmt::format("layer {}", layer));
  out.b13.resize(static_cast<size_t>(E * 2 * I));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t j = 0; j < I; ++j) {
      out.b13[e * 2 * I + j] = gu_bias[e * 2 * I + 2 * j];
      out.b13[e * 2 * I + I + j] = gu_bias[e * 2 * I + 2 * j + 1];
    }
}

}  // namespace

std::string_view checkpoint_format_name(CheckpointFormat f) {
  switch (f) {
    case CheckpointFormat::kModelOptNvfp4: return "ModelOpt NVFP4";
    case CheckpointFormat::kCompressedTensorsNvfp4: return "compressed-tensors nvfp4-pack-quantized";
    case CheckpointFormat::kGptOssMxfp4: return "gpt-oss MXFP4";
  }
  return "?";
}

std::string CheckpointInfo::layer_prefix(int layer) const {
  return fmt::format(fmt::runtime(layer_prefix_fmt), layer);
}

HostBytes::HostBytes(size_t bytes) : p(std::make_unique_for_overwrite<uint8_t[]>(bytes)), n(bytes) {}

size_t HostMoeLayer::bytes() const {
  return w13_codes.size() + w13_scales.size() + w2_codes.size() + w2_scales.size() + shared_w13_codes.size() +
         shared_w13_scales.size() + shared_w2_codes.size() + shared_w2_scales.size() + 2 * shared_w13_bf16.size() +
         2 * shared_w2_bf16.size();
}

CheckpointInfo inspect_checkpoint(const SafetensorsCheckpoint& ck) {
  CheckpointInfo info;
  info.dir = ck.dir();
  const json c = read_json_file(ck.dir(), "config.json");
  parse_model(c, info);
  parse_format(c, ck.dir(), info);
  if (info.format == CheckpointFormat::kGptOssMxfp4)
    FP4MOE_REQUIRE(info.model_type == "gpt_oss" || info.architecture == "GptOssForCausalLM",
                   "config.json: quant_method mxfp4 is supported for gpt-oss only (model_type is '{}')", info.model_type);
  else
    FP4MOE_REQUIRE(info.model_type != "gpt_oss",
                   "config.json: gpt-oss with quant_method other than mxfp4 is not supported");
  // The shared expert's storage: NVFP4 tensors or bf16 ones (ModelOpt's experts-only recipe).
  if (info.moe.num_shared > 0) {
    const std::string S = info.layer_prefix(info.moe_layers.front()) + ".shared_experts.gate_proj.";
    const Nvfp4Names nm = nvfp4_names(info.format, S.substr(0, S.size() - 1));
    if (ck.has(nm.codes) && ck.tensor(nm.codes).info->dtype == SafetensorsDtype::kU8)
      info.shared = SharedExpertStorage::kQuantized;
    else if (ck.has(S + "weight"))
      info.shared = SharedExpertStorage::kBf16;
    else
      FP4MOE_FAIL("config.json says n_shared_experts = {} but tensor '{}' (or '{}') is missing", info.moe.num_shared,
                  nm.codes, S + "weight");
  }
  info.moe.validate();
  return info;
}

HostMoeLayer load_moe_layer(const SafetensorsCheckpoint& ck, const CheckpointInfo& info, int layer,
                            const LoadOptions& opts) {
  FP4MOE_REQUIRE(std::find(info.moe_layers.begin(), info.moe_layers.end(), layer) != info.moe_layers.end(),
                 "layer {} is not an MoE layer of '{}' (MoE layers: {} of 0..{})", layer, info.moe.name,
                 info.moe_layers.size() <= 8 ? fmt::format("{}", fmt::join(info.moe_layers, ", "))
                                             : fmt::format("{} .. {}", info.moe_layers.front(), info.moe_layers.back()),
                 info.num_layers - 1);
  HostMoeLayer out;
  out.layer = layer;
  out.cfg = info.moe;
  out.cfg.name = fmt::format("{} layer {}", info.moe.name, layer);
  out.shared = info.shared;
  if (opts.routed_only) {
    out.cfg.num_shared = 0;
    out.shared = SharedExpertStorage::kNone;
  }
  const int64_t E = out.cfg.num_experts, H = out.cfg.hidden;
  const std::string P = info.layer_prefix(layer);
  bool router_f32 = false;
  if (info.format == CheckpointFormat::kGptOssMxfp4) {
    out.router_weight = read_bf16(ck, P + ".router.weight", {E, H}, &router_f32);
    out.router_bias = read_floats(ck, P + ".router.bias", {E});
    load_gptoss(ck, info, layer, opts, out);
  } else {
    out.router_weight = read_bf16(ck, P + ".gate.weight", {E, H}, &router_f32);
    if (out.cfg.router == RouterKind::kSigmoidGrouped) {
      const std::string b1 = P + ".gate.e_score_correction_bias", b2 = P + ".e_score_correction_bias";
      out.router_bias = read_floats(ck, ck.has(b1) || !ck.has(b2) ? b1 : b2, {E});
    }
    load_nvfp4_experts(ck, info, layer, opts, out);
    if (out.shared != SharedExpertStorage::kNone) load_nvfp4_shared(ck, info, layer, out);
  }
  if (router_f32)
    out.warnings.push_back(fmt::format("layer {}: the router weight is stored in F32; fp4moe's router GEMM runs it "
                                       "rounded to bf16", layer));
  const auto warn = opts.warn ? opts.warn : default_warn;
  for (const auto& w : out.warnings) warn(w);
  return out;
}

// ---------------------------------------------------------------------------------------------------
// CPU reference view
// ---------------------------------------------------------------------------------------------------

std::vector<float> host_router_logits(const HostMoeLayer& l, std::span<const float> hidden, int64_t tokens) {
  const int64_t E = l.cfg.num_experts, H = l.cfg.hidden;
  FP4MOE_REQUIRE(static_cast<int64_t>(hidden.size()) == tokens * H,
                 "host_router_logits: hidden has {} values; tokens x hidden = {} x {} needed", hidden.size(), tokens, H);
  FP4MOE_REQUIRE(static_cast<int64_t>(l.router_weight.size()) == E * H,
                 "host_router_logits: layer {} has no router weight of [{}, {}]", l.layer, E, H);
  std::vector<float> w(l.router_weight.size());
  for (size_t i = 0; i < w.size(); ++i) w[i] = bf16_bits_to_float(l.router_weight[i]);
  std::vector<float> logits(static_cast<size_t>(tokens * E));
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < E; ++e) {
      double s = 0;
      for (int64_t h = 0; h < H; ++h) s += static_cast<double>(round_to_bf16(hidden[t * H + h])) * w[e * H + h];
      logits[t * E + e] = static_cast<float>(s);
    }
  return logits;
}

std::shared_ptr<const ExpertWeights> HostLayerExperts::expert(int e) const {
  const MoeConfig& c = l_.cfg;
  const int64_t H = c.hidden;
  auto w = std::make_shared<ExpertWeights>();
  auto slice = [](const uint8_t* base, size_t off, size_t n) { return std::vector<uint8_t>(base + off, base + off + n); };
  if (e == kSharedExpert) {
    FP4MOE_REQUIRE(l_.shared != SharedExpertStorage::kNone && c.num_shared > 0,
                   "HostLayerExperts: layer {} has no shared expert", l_.layer);
    const int64_t Is = c.intermediate * c.num_shared;
    if (l_.shared == SharedExpertStorage::kBf16) {
      w->storage = ExpertStorage::kBf16;
      auto dense = [](const std::vector<uint16_t>& v, size_t off, int64_t rows, int64_t cols) {
        DenseMatrix m;
        m.rows = rows;
        m.cols = cols;
        m.values.resize(static_cast<size_t>(rows * cols));
        for (size_t i = 0; i < m.values.size(); ++i) m.values[i] = bf16_bits_to_float(v[off + i]);
        return m;
      };
      w->dense_gate = dense(l_.shared_w13_bf16, 0, Is, H);
      w->dense_up = dense(l_.shared_w13_bf16, static_cast<size_t>(Is * H), Is, H);
      w->dense_down = dense(l_.shared_w2_bf16, 0, H, Is);
      return w;
    }
    auto t = [&](const std::vector<uint8_t>& codes, const std::vector<uint8_t>& scales, int64_t row0, int64_t rows,
                 int64_t cols, float g) {
      Nvfp4Tensor n;
      n.rows = rows;
      n.cols = cols;
      n.codes = slice(codes.data(), static_cast<size_t>(row0 * cols / 2), static_cast<size_t>(rows * cols / 2));
      n.scales = slice(scales.data(), static_cast<size_t>(row0 * cols / 16), static_cast<size_t>(rows * cols / 16));
      n.global_scale = g;
      return n;
    };
    w->gate = t(l_.shared_w13_codes, l_.shared_w13_scales, 0, Is, H, l_.shared_w13_global);
    w->up = t(l_.shared_w13_codes, l_.shared_w13_scales, Is, Is, H, l_.shared_w13_global);
    w->down = t(l_.shared_w2_codes, l_.shared_w2_scales, 0, H, Is, l_.shared_w2_global);
    return w;
  }
  FP4MOE_REQUIRE(e >= 0 && e < c.num_experts, "HostLayerExperts: expert = {} must be in [0, {})", e, c.num_experts);
  const int64_t I = c.intermediate;
  const int blk = c.format == WeightFormat::kMxfp4 ? kMxfp4Block : kNvfp4Block;
  // rows [row0, row0 + rows) of expert e's stacked tensor of `n` rows and `k` columns
  auto codes_of = [&](const HostBytes& b, int64_t n, int64_t k, int64_t row0, int64_t rows) {
    return slice(b.data(), static_cast<size_t>((e * n + row0) * k / 2), static_cast<size_t>(rows * k / 2));
  };
  auto scales_of = [&](const HostBytes& b, int64_t n, int64_t k, int64_t row0, int64_t rows) {
    return slice(b.data(), static_cast<size_t>((e * n + row0) * k / blk), static_cast<size_t>(rows * k / blk));
  };
  if (c.format == WeightFormat::kMxfp4) {
    w->storage = ExpertStorage::kMxfp4;
    auto mx = [&](const HostBytes& codes, const HostBytes& scales, int64_t n, int64_t k, int64_t row0, int64_t rows) {
      Mxfp4Tensor t;
      t.rows = rows;
      t.cols = k;
      t.codes = codes_of(codes, n, k, row0, rows);
      t.scales = scales_of(scales, n, k, row0, rows);
      return t;
    };
    w->mx_gate = mx(l_.w13_codes, l_.w13_scales, 2 * I, H, 0, I);
    w->mx_up = mx(l_.w13_codes, l_.w13_scales, 2 * I, H, I, I);
    w->mx_down = mx(l_.w2_codes, l_.w2_scales, H, I, 0, H);
  } else {
    auto nv = [&](const HostBytes& codes, const HostBytes& scales, int64_t n, int64_t k, int64_t row0, int64_t rows,
                  float g) {
      Nvfp4Tensor t;
      t.rows = rows;
      t.cols = k;
      t.codes = codes_of(codes, n, k, row0, rows);
      t.scales = scales_of(scales, n, k, row0, rows);
      t.global_scale = g;
      return t;
    };
    w->gate = nv(l_.w13_codes, l_.w13_scales, 2 * I, H, 0, I, l_.w13_global[e]);
    w->up = nv(l_.w13_codes, l_.w13_scales, 2 * I, H, I, I, l_.w13_global[e]);
    w->down = nv(l_.w2_codes, l_.w2_scales, H, I, 0, H, l_.w2_global[e]);
  }
  if (c.expert_bias) {
    w->bias_gate.assign(l_.b13.begin() + e * 2 * I, l_.b13.begin() + e * 2 * I + I);
    w->bias_up.assign(l_.b13.begin() + e * 2 * I + I, l_.b13.begin() + (e + 1) * 2 * I);
    w->bias_down.assign(l_.b2.begin() + e * H, l_.b2.begin() + (e + 1) * H);
  }
  return w;
}

}  // namespace fp4moe
