// fp4moe._ext: the nanobind module behind the Python package (python/fp4moe). Tensors arrive through
// DLPack (torch, CuPy, JAX, NumPy) and are never copied on the forward path; torch is not linked.
//
// Every argument check raises a Python TypeError (wrong dtype or kind of object) or ValueError (shape,
// device, strides, token count) whose message starts with the argument's name. Errors from the C++
// library (fp4moe::Error) become fp4moe.Error, a subclass of both ValueError and RuntimeError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <cuda_runtime.h>

#include "dlpack_exchange.hpp"
#include "fp4moe/arch.hpp"
#include "fp4moe/config.hpp"
#include "fp4moe/cuda_check.hpp"
#include "fp4moe/device_buffer.hpp"
#include "fp4moe/error.hpp"
#include "fp4moe/format.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/moe_layer.hpp"
#include "fp4moe/planner.hpp"
#include "fp4moe/tuner.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace fp4moe::py {
namespace {

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------

PyObject* g_error_type = nullptr;  // fp4moe.Error

// "fp4moe: <sentence> (/some/build/dir/src/x.cu:12)" -> "<sentence> (x.cu:12)": the library's
// messages carry the source location; a build machine's directories mean nothing to a user.
std::string user_message(const std::string& what) {
  std::string m = what;
  if (m.rfind("fp4moe: ", 0) == 0) m = m.substr(8);
  const size_t open = m.rfind(" (");
  if (open != std::string::npos && !m.empty() && m.back() == ')') {
    const size_t slash = m.rfind('/');
    if (slash != std::string::npos && slash > open) m = m.substr(0, open + 2) + m.substr(slash + 1);
  }
  return m;
}

template <class... Args>
[[noreturn]] void type_error(fmt::format_string<Args...> f, Args&&... args) {
  throw nb::type_error(fmt::format(f, std::forward<Args>(args)...).c_str());
}
template <class... Args>
[[noreturn]] void value_error(fmt::format_string<Args...> f, Args&&... args) {
  throw nb::value_error(fmt::format(f, std::forward<Args>(args)...).c_str());
}

// ------------------------------------------------------------------------------------------------
// Tensors through DLPack
// ------------------------------------------------------------------------------------------------

constexpr int kMaxDims = 4;

struct Tensor {
  void* data = nullptr;
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // elements
  DLDataType dtype{};
  int32_t device_type = 0;
  int32_t device_id = 0;
  nb::ndarray<nb::ro> keep;  // the generic path's import; keeps the producer's buffer alive for the call

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  bool is_cuda() const { return device_type == kDLCUDA; }
  bool is_host() const { return device_type == kDLCPU || device_type == kDLCUDAHost; }
  bool row_major() const {
    int64_t expect = 1;
    for (int i = ndim - 1; i >= 0; --i) {
      if (shape[i] != 1 && strides[i] != expect) return false;
      expect *= shape[i];
    }
    return true;
  }
};

std::string shape_str(const int64_t* s, int n) {
  std::string r = "(";
  for (int i = 0; i < n; ++i) r += fmt::format("{}{}", i ? ", " : "", s[i]);
  return r + (n == 1 ? ",)" : ")");
}
std::string shape_str(const Tensor& t) { return shape_str(t.shape, t.ndim); }
std::string strides_str(const Tensor& t) { return shape_str(t.strides, t.ndim); }

std::string dtype_name(DLDataType d) {
  if (d.lanes != 1) return fmt::format("vector dtype (code {}, {} bits, {} lanes)", d.code, d.bits, d.lanes);
  switch (d.code) {
    case kDLInt:
      return fmt::format("int{}", d.bits);
    case kDLUInt:
      return fmt::format("uint{}", d.bits);
    case kDLFloat:
      return fmt::format("float{}", d.bits);
    case kDLBfloat:
      return fmt::format("bfloat{}", d.bits);
    case kDLBool:
      return "bool";
    case kDLFloat8_e4m3fn:
      return "float8_e4m3fn";
    default:
      return fmt::format("DLPack dtype (code {}, {} bits)", d.code, d.bits);
  }
}
bool is(DLDataType d, uint8_t code, uint8_t bits) { return d.code == code && d.bits == bits && d.lanes == 1; }
bool is_bf16(DLDataType d) { return is(d, kDLBfloat, 16); }
bool is_f32(DLDataType d) { return is(d, kDLFloat, 32); }
bool is_i32(DLDataType d) { return is(d, kDLInt, 32); }
bool is_u8(DLDataType d) { return is(d, kDLUInt, 8); }
bool is_e4m3(DLDataType d) { return is(d, kDLFloat8_e4m3fn, 8) || is_u8(d); }

std::string device_str(int32_t type, int32_t id) {
  switch (type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      return fmt::format("cuda:{}", id);
    case kDLCUDAHost:
      return "cpu (pinned)";
    case kDLCUDAManaged:
      return fmt::format("cuda managed memory (device {})", id);
    default:
      return fmt::format("DLPack device type {}", type);
  }
}

// The exchange table of a Python type, looked up once per type. The type is kept alive by the cache
// so that its address cannot be reused by another type.
const DLPackExchangeAPI* exchange_api(PyTypeObject* tp) {
  struct Entry {
    nb::object type;
    const DLPackExchangeAPI* api;
  };
  // Never destroyed: its entries hold Python references, which must not be released after the
  // interpreter has shut down (static destructors run after Py_Finalize).
  static auto& cache = *new std::unordered_map<PyTypeObject*, Entry>();
  if (auto it = cache.find(tp); it != cache.end()) return it->second.api;
  const DLPackExchangeAPI* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(tp), kExchangeAttr);
  if (cap == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(cap, kExchangeCapsuleName)) {
      auto* a = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(cap, kExchangeCapsuleName));
      // Major version 1 is the layout declared in dlpack_exchange.hpp; the fast import is optional.
      if (a != nullptr && a->header.version.major == 1 && a->dltensor_from_py_object_no_sync != nullptr) api = a;
    }
    PyErr_Clear();
    Py_DECREF(cap);
  }
  cache.emplace(tp, Entry{nb::borrow(reinterpret_cast<PyObject*>(tp)), api});
  return api;
}

Tensor from_dltensor(const DLTensor& dl, const char* name) {
  Tensor t;
  if (dl.ndim < 0 || dl.ndim > kMaxDims)
    value_error("{}: {} dimensions; fp4moe takes tensors of at most {}", name, dl.ndim, kMaxDims);
  t.ndim = dl.ndim;
  t.data = static_cast<char*>(dl.data) + dl.byte_offset;
  t.dtype = dl.dtype;
  t.device_type = dl.device.device_type;
  t.device_id = dl.device.device_id;
  int64_t expect = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    t.shape[i] = dl.shape[i];
    t.strides[i] = dl.strides != nullptr ? dl.strides[i] : expect;
    expect *= dl.shape[i];
  }
  return t;
}

Tensor tensor_of(nb::handle obj, const char* name) {
  if (obj.is_none()) value_error("{} is None; a tensor is required", name);
  PyTypeObject* tp = Py_TYPE(obj.ptr());
  if (const DLPackExchangeAPI* api = exchange_api(tp)) {
    DLTensor dl{};
    if (api->dltensor_from_py_object_no_sync(obj.ptr(), &dl) != 0) throw nb::python_error();
    return from_dltensor(dl, name);
  }
  // Read-only arrays are accepted (JAX's, NumPy broadcasts): writes only ever go to `out`, which must be
  // on the GPU, where the producer's flag is the caller's business.
  nb::ndarray<nb::ro> a;
  if (!nb::try_cast(obj, a, /*convert=*/false))
    type_error("{}: a {} is not a tensor; pass a torch / CuPy / JAX / NumPy array (anything with __dlpack__)", name,
               nb::inst_name(obj).c_str());
  Tensor t;
  if (a.ndim() > static_cast<size_t>(kMaxDims))
    value_error("{}: {} dimensions; fp4moe takes tensors of at most {}", name, a.ndim(), kMaxDims);
  t.ndim = static_cast<int>(a.ndim());
  t.data = const_cast<void*>(a.data());
  const auto d = a.dtype();
  t.dtype = DLDataType{d.code, d.bits, d.lanes};
  t.device_type = a.device_type();
  t.device_id = a.device_id();
  for (int i = 0; i < t.ndim; ++i) {
    t.shape[i] = static_cast<int64_t>(a.shape(i));
    t.strides[i] = a.stride(i);
  }
  t.keep = std::move(a);
  return t;
}

std::optional<Tensor> optional_tensor(nb::handle obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return tensor_of(obj, name);
}

// Shape: -1 = any extent.
void require_shape(const Tensor& t, const char* name, std::initializer_list<int64_t> want, const std::string& why) {
  bool ok = static_cast<int>(want.size()) == t.ndim;
  int i = 0;
  for (int64_t w : want) {
    if (ok && w >= 0 && t.shape[i] != w) ok = false;
    ++i;
  }
  if (!ok) {
    std::string ws = "(";
    i = 0;
    for (int64_t w : want) ws += fmt::format("{}{}", i++ ? ", " : "", w < 0 ? std::string("*") : std::to_string(w));
    ws += want.size() == 1 ? ",)" : ")";
    value_error("{}: shape {} must be {}{}", name, shape_str(t), ws, why.empty() ? "" : " " + why);
  }
}
void require_row_major(const Tensor& t, const char* name) {
  if (!t.row_major())
    value_error(
        "{}: strides {} (elements) of shape {} are not row-major contiguous; pass a contiguous tensor "
        "(e.g. .contiguous())",
        name, strides_str(t), shape_str(t));
}
void require_on(const Tensor& t, const char* name, int device);
void require_on_if(const Tensor& t, const char* name, int device) {
  if (device >= 0) require_on(t, name, device);
}
void require_on(const Tensor& t, const char* name, int device) {
  if (!(t.device_type == kDLCUDA && t.device_id == device))
    value_error("{}: on {}, but the layer runs on cuda:{}; move it there first (fp4moe copies nothing per call)", name,
                device_str(t.device_type, t.device_id), device);
}

// ------------------------------------------------------------------------------------------------
// CUDA helpers
// ------------------------------------------------------------------------------------------------

void require_gpu(const char* what) {
  if (!gpu_available())
    throw nb::value_error(fmt::format("{} needs a CUDA GPU and none is available to this process "
                                      "(cudaGetDeviceCount found none, or no driver)",
                                      what)
                              .c_str());
}

// Makes `device` current for a scope (torch may have another current device than the tensors').
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FP4MOE_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device)
      FP4MOE_CUDA_CHECK(cudaSetDevice(device));
    else
      prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// ------------------------------------------------------------------------------------------------
// Config
// ------------------------------------------------------------------------------------------------

const char* router_name(RouterKind r) {
  switch (r) {
    case RouterKind::kSoftmaxTopK:
      return "softmax";
    case RouterKind::kSigmoidGrouped:
      return "sigmoid_grouped";
    case RouterKind::kGptOss:
      return "gpt_oss";
  }
  return "?";
}
RouterKind router_from(const std::string& s) {
  if (s == "softmax") return RouterKind::kSoftmaxTopK;
  if (s == "sigmoid_grouped") return RouterKind::kSigmoidGrouped;
  if (s == "gpt_oss") return RouterKind::kGptOss;
  value_error("router = '{}': known routers are 'softmax', 'sigmoid_grouped', 'gpt_oss'", s);
}
const char* activation_name(Activation a) { return a == Activation::kSwiGLU ? "swiglu" : "gpt_oss_swiglu"; }
Activation activation_from(const std::string& s) {
  if (s == "swiglu") return Activation::kSwiGLU;
  if (s == "gpt_oss_swiglu") return Activation::kGptOssSwiGLU;
  value_error("activation = '{}': known activations are 'swiglu', 'gpt_oss_swiglu'", s);
}
const char* format_name(WeightFormat f) { return f == WeightFormat::kNvfp4 ? "nvfp4" : "mxfp4"; }
WeightFormat format_from(const std::string& s) {
  if (s == "nvfp4") return WeightFormat::kNvfp4;
  if (s == "mxfp4") return WeightFormat::kMxfp4;
  value_error("format = '{}': known formats are 'nvfp4', 'mxfp4'", s);
}

// ------------------------------------------------------------------------------------------------
// The layer
// ------------------------------------------------------------------------------------------------

// What a forward call is checked against. device < 0: skip the device checks (the argument checks of
// _check_forward_args, which the CPU tests exercise with host tensors).
struct Shape {
  MoeConfig cfg;
  int64_t max_tokens = 0;
  int device = -1;
  bool has_router_weight = false;
};

void check_logits(const Shape& sh, const Tensor& l, int64_t T) {
  if (!is_f32(l.dtype) && !is_bf16(l.dtype))
    type_error("router_logits: dtype {}; pass float32 or bfloat16", dtype_name(l.dtype));
  require_shape(l, "router_logits", {T, sh.cfg.num_experts},
                fmt::format("([T, num_experts = {}], T = the tokens of hidden)", sh.cfg.num_experts));
  if (l.shape[0] > sh.max_tokens)
    value_error("router_logits: T = {} tokens exceeds max_tokens = {}", l.shape[0], sh.max_tokens);
  require_on_if(l, "router_logits", sh.device);
  require_row_major(l, "router_logits");
}

void check_routing_tensors(const Shape& sh, const Tensor& ids, const Tensor& wts, int64_t T) {
  if (!is_i32(ids.dtype))
    type_error("topk_ids: dtype {}; pass int32 (e.g. .to(torch.int32) once; fp4moe converts nothing per call)",
               dtype_name(ids.dtype));
  if (!is_f32(wts.dtype)) type_error("topk_weights: dtype {}; pass float32", dtype_name(wts.dtype));
  const std::string why = fmt::format("([T, top_k = {}])", sh.cfg.top_k);
  require_shape(ids, "topk_ids", {T, sh.cfg.top_k}, why);
  require_shape(wts, "topk_weights", {T, sh.cfg.top_k}, why);
  if (ids.shape[0] > sh.max_tokens)
    value_error("topk_ids: T = {} tokens exceeds max_tokens = {}", ids.shape[0], sh.max_tokens);
  require_on_if(ids, "topk_ids", sh.device);
  require_on_if(wts, "topk_weights", sh.device);
  require_row_major(ids, "topk_ids");
  require_row_major(wts, "topk_weights");
}

cudaStream_t resolve_stream(nb::handle tensor, int64_t handle, int device) {
  if (handle >= 0) return reinterpret_cast<cudaStream_t>(handle);
  if (const DLPackExchangeAPI* api = exchange_api(Py_TYPE(tensor.ptr()))) {
    void* s = nullptr;
    if (api->current_work_stream(kDLCUDA, device, &s) != 0) throw nb::python_error();
    return static_cast<cudaStream_t>(s);
  }
  return nullptr;  // the legacy default stream
}

struct Call {
  int64_t tokens = 0;
  const void* hidden = nullptr;
  void* out = nullptr;
  const float* logits = nullptr;  // fp32 (after conversion) or null
  const void* logits_bf16 = nullptr;
  const int32_t* ids = nullptr;
  const float* weights = nullptr;
  cudaStream_t stream = nullptr;
};

Call prepare_call(const Shape& sh, nb::handle hidden, nb::handle router_logits, nb::handle topk_ids,
                  nb::handle topk_weights, nb::handle out, int64_t stream_handle) {
  Call c;
  Tensor h = tensor_of(hidden, "hidden");
  if (!is_bf16(h.dtype)) type_error("hidden: dtype {}; the layer takes bfloat16 activations", dtype_name(h.dtype));
  require_shape(h, "hidden", {-1, sh.cfg.hidden}, fmt::format("([T, hidden = {}])", sh.cfg.hidden));
  const int64_t T = h.shape[0];
  if (T > sh.max_tokens)
    value_error("hidden: T = {} tokens exceeds max_tokens = {} (fixed at construction; it sizes the workspace)", T,
                sh.max_tokens);
  require_on_if(h, "hidden", sh.device);
  require_row_major(h, "hidden");
  Tensor o = tensor_of(out, "out");
  if (!is_bf16(o.dtype)) type_error("out: dtype {}; the layer writes bfloat16", dtype_name(o.dtype));
  require_shape(o, "out", {T, sh.cfg.hidden}, "(the shape of hidden)");
  require_on_if(o, "out", sh.device);
  require_row_major(o, "out");

  const bool given = !topk_ids.is_none() || !topk_weights.is_none();
  if (given && !router_logits.is_none())
    value_error(
        "router_logits and topk_ids / topk_weights were both given; pass one routing: the layer's own "
        "router on logits, or the engine's top-k ids and weights");
  if (given) {
    if (topk_ids.is_none()) value_error("topk_ids is None but topk_weights was given; pass both");
    if (topk_weights.is_none()) value_error("topk_weights is None but topk_ids was given; pass both");
    Tensor ids = tensor_of(topk_ids, "topk_ids"), wts = tensor_of(topk_weights, "topk_weights");
    check_routing_tensors(sh, ids, wts, T);
    c.ids = static_cast<const int32_t*>(ids.data);
    c.weights = static_cast<const float*>(wts.data);
  } else if (!router_logits.is_none()) {
    Tensor l = tensor_of(router_logits, "router_logits");
    check_logits(sh, l, T);
    if (is_f32(l.dtype))
      c.logits = static_cast<const float*>(l.data);
    else
      c.logits_bf16 = l.data;
  } else if (!sh.has_router_weight) {
    value_error(
        "router_logits is None and the layer has no router weight: pass router_logits (fp32 or bf16 "
        "[T, {}]) or topk_ids and topk_weights",
        sh.cfg.num_experts);
  }
  c.tokens = T;
  c.hidden = h.data;
  c.out = o.data;
  if (sh.device >= 0) c.stream = resolve_stream(hidden, stream_handle, sh.device);
  return c;
}

// Weight tensors the constructor accepts (Python maps engine / checkpoint names onto these first).
const char* const kWeightKeys[] = {"w13_weight",
                                   "w13_weight_scale",
                                   "w13_weight_scale_2",
                                   "w2_weight",
                                   "w2_weight_scale",
                                   "w2_weight_scale_2",
                                   "w13_bias",
                                   "w2_bias",
                                   "router_weight",
                                   "router_bias",
                                   "shared_w13_weight",
                                   "shared_w13_weight_scale",
                                   "shared_w13_weight_scale_2",
                                   "shared_w2_weight",
                                   "shared_w2_weight_scale",
                                   "shared_w2_weight_scale_2",
                                   "shared_w13_bias",
                                   "shared_w2_bias"};

class Layer {
 public:
  Layer(const MoeConfig& cfg, const nb::dict& weights, int64_t max_tokens, int device, int64_t stream_handle) {
    require_gpu("fp4moe.MoeLayer");
    validate_moe_layer_config(cfg);
    if (max_tokens < 1) value_error("max_tokens = {} must be >= 1", max_tokens);
    int count = 0;
    FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count) value_error("device = {}: this process sees {} CUDA device(s)", device, count);
    cfg_ = cfg;
    device_ = device;
    max_tokens_ = max_tokens;
    shape_.cfg = cfg;
    shape_.max_tokens = max_tokens;
    shape_.device = device;
    DeviceGuard guard(device);
    auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
    // Device weights may still be being written on the caller's stream.
    FP4MOE_CUDA_CHECK(cudaStreamSynchronize(stream));

    for (auto [k, v] : weights) {
      const std::string key = nb::cast<std::string>(nb::str(k));
      bool known = false;
      for (const char* w : kWeightKeys) known |= key == w;
      if (!known) {
        std::string all;
        for (const char* w : kWeightKeys) all += (all.empty() ? "" : ", ") + std::string(w);
        value_error("weights['{}']: not a weight fp4moe knows; known names: {}", key, all);
      }
    }
    MoeLayerWeights w = collect(weights);
    finish(w, stream);
  }

  // One MoE layer of a checkpoint on disk (ModelOpt NVFP4, compressed-tensors NVFP4, gpt-oss MXFP4):
  // read, uploaded once and repacked (checkpoint.hpp); the host copies are freed before this returns.
  Layer(const std::string& dir, int layer, int64_t max_tokens, int device, bool routed_only) {
    require_gpu("fp4moe.load_moe_layer");
    if (max_tokens < 1) value_error("max_tokens = {} must be >= 1", max_tokens);
    int count = 0;
    FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&count));
    if (device < 0 || device >= count) value_error("device = {}: this process sees {} CUDA device(s)", device, count);
    DeviceGuard guard(device);
    const SafetensorsCheckpoint ck(dir);
    const CheckpointInfo info = inspect_checkpoint(ck);
    LoadOptions opts;
    opts.routed_only = routed_only;
    const HostMoeLayer host = load_moe_layer(ck, info, layer, opts);
    const DeviceMoeLayer dev = upload_moe_layer(host, nullptr);
    cfg_ = dev.cfg;
    device_ = device;
    max_tokens_ = max_tokens;
    shape_.cfg = cfg_;
    shape_.max_tokens = max_tokens;
    shape_.device = device;
    finish(dev.weights, nullptr);  // MoeLayer copies what it keeps and synchronizes: `dev` may go
  }

  const MoeConfig& config() const { return cfg_; }
  int device() const { return device_; }
  int64_t max_tokens() const { return max_tokens_; }
  size_t workspace_bytes() const { return workspace_.bytes() + logits_f32_.bytes(); }
  bool has_router_weight() const { return layer_->has_router_weight(); }

  // stream_handle: a cudaStream_t as an integer, or -1 for the tensors' framework's current stream
  // (DLPack exchange table), else the legacy default stream.
  void forward(nb::handle hidden, nb::handle router_logits, nb::handle topk_ids, nb::handle topk_weights,
               nb::handle out, int64_t stream_handle) {
    Call c = prepare_call(shape_, hidden, router_logits, topk_ids, topk_weights, out, stream_handle);
    if (c.tokens == 0) return;
    DeviceGuard guard(device_);
    run(c);
  }

  // The layer's routing alone: logits [T, E] -> topk_ids (int32 [T, k]) and topk_weights (fp32 [T, k]).
  void route(nb::handle router_logits, nb::handle topk_ids, nb::handle topk_weights, int64_t stream_handle) {
    Tensor l = tensor_of(router_logits, "router_logits");
    check_logits(shape_, l, l.ndim == 2 ? l.shape[0] : -1);
    const int64_t T = l.shape[0];
    Tensor ids = tensor_of(topk_ids, "topk_ids"), wts = tensor_of(topk_weights, "topk_weights");
    check_routing_tensors(shape_, ids, wts, T);
    if (T == 0) return;
    DeviceGuard guard(device_);
    const cudaStream_t s = resolve_stream(router_logits, stream_handle, device_);
    const float* lf = logits_fp32(l, T, s);
    layer_->route(s, lf, T, static_cast<int32_t*>(ids.data), static_cast<float*>(wts.data));
  }

  std::string take_routing_error() const { return layer_->take_routing_error(); }

  // Host time of `iters` forward calls made from C++ with the arguments imported once (the benchmark's
  // baseline for the Python call's overhead). Does not synchronize.
  double bench_cpp_forward(nb::handle hidden, nb::handle router_logits, nb::handle topk_ids, nb::handle topk_weights,
                           nb::handle out, int64_t stream_handle, int iters) {
    Call c = prepare_call(shape_, hidden, router_logits, topk_ids, topk_weights, out, stream_handle);
    if (c.tokens == 0) return 0.0;
    DeviceGuard guard(device_);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) run(c);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  void finish(const MoeLayerWeights& w, cudaStream_t stream) {
    layer_ = std::make_unique<MoeLayer>(cfg_, w, max_tokens_, stream);
    shape_.has_router_weight = layer_->has_router_weight();
    staged_.clear();  // the layer owns repacked copies now
    workspace_ = DeviceBuffer<uint8_t>(layer_->workspace_bytes());
    // Zeroed once, so that nothing in it is ever uninitialized memory.
    FP4MOE_CUDA_CHECK(cudaMemset(workspace_.get(), 0, workspace_.bytes()));
    logits_f32_ = DeviceBuffer<float>(static_cast<size_t>(max_tokens_ * cfg_.num_experts));
  }

  void run(const Call& c) {
    const size_t ws = workspace_.bytes();
    if (c.ids != nullptr) {
      layer_->forward_routed(c.stream, c.hidden, c.tokens, c.ids, c.weights, c.out, workspace_.get(), ws);
      return;
    }
    const float* logits = c.logits;
    if (c.logits_bf16 != nullptr) {
      moe_logits_bf16_to_fp32(c.logits_bf16, c.tokens * cfg_.num_experts, logits_f32_.get(), c.stream);
      logits = logits_f32_.get();
    }
    layer_->forward(c.stream, c.hidden, c.tokens, logits, c.out, workspace_.get(), ws);
  }

  const float* logits_fp32(const Tensor& l, int64_t T, cudaStream_t s) {
    if (is_f32(l.dtype)) return static_cast<const float*>(l.data);
    moe_logits_bf16_to_fp32(l.data, T * cfg_.num_experts, logits_f32_.get(), s);
    return logits_f32_.get();
  }

  // ---- weights ----
  // A device pointer to the tensor's bytes: the tensor itself when it is on the layer's device, else a
  // staged copy (host tensors; freed once the layer has repacked them).
  const void* device_bytes(const Tensor& t, const char* name) {
    if (t.is_cuda()) {
      require_on(t, name, device_);
      return t.data;
    }
    if (!t.is_host())
      value_error("weights['{}']: on {}; pass it on cuda:{} or on the host", name,
                  device_str(t.device_type, t.device_id), device_);
    const size_t bytes = static_cast<size_t>(t.numel()) * ((t.dtype.bits * t.dtype.lanes + 7) / 8);
    staged_.emplace_back(std::max<size_t>(bytes, 16));
    copy_to_device(staged_.back().get(), t.data, bytes);
    return staged_.back().get();
  }
  std::vector<float> host_floats(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (v.empty()) return v;
    if (t.is_cuda())
      FP4MOE_CUDA_CHECK(cudaMemcpy(v.data(), t.data, v.size() * 4, cudaMemcpyDeviceToHost));
    else
      std::memcpy(v.data(), t.data, v.size() * 4);
    return v;
  }
  const float* upload_floats(const std::vector<float>& v) {
    staged_.emplace_back(std::max<size_t>(v.size() * 4, 16));
    copy_to_device(staged_.back().get(), v.data(), v.size() * 4);
    return staged_.back().as<float>();
  }

  MoeLayerWeights collect(const nb::dict& weights) {
    const MoeConfig& c = cfg_;
    const int64_t E = c.num_experts, H = c.hidden, I = c.intermediate, Is = I * c.num_shared;
    const std::string dims = fmt::format("for config '{}' (E = {}, H = {}, I = {}{})", c.name, E, H, I,
                                         c.num_shared > 0 ? fmt::format(", shared width {}", Is) : "");
    auto get = [&](const char* key) -> std::optional<Tensor> {
      if (!weights.contains(key)) return std::nullopt;
      nb::handle v = weights[key];
      if (v.is_none()) return std::nullopt;
      Tensor t = tensor_of(v, key);
      if (!t.row_major())
        value_error("weights['{}']: strides {} of shape {} are not row-major contiguous; pass a contiguous tensor", key,
                    strides_str(t), shape_str(t));
      return t;
    };
    auto need = [&](const char* key) -> Tensor {
      std::optional<Tensor> t = get(key);
      if (!t) value_error("weights['{}'] is missing; it is required {}", key, dims);
      return *t;
    };
    auto forbid = [&](const char* key, const std::string& why) {
      if (get(key)) value_error("weights['{}'] was given, but {}", key, why);
    };
    auto name = [](const char* key) { return fmt::format("weights['{}']", key); };
    auto codes = [&](const char* key, std::initializer_list<int64_t> shape) {
      Tensor t = need(key);
      if (!is_u8(t.dtype)) type_error("{}: dtype {}; packed E2M1 codes are uint8", name(key), dtype_name(t.dtype));
      require_shape(t, name(key).c_str(), shape, dims);
      return static_cast<const uint8_t*>(device_bytes(t, key));
    };
    auto scales = [&](const char* key, std::initializer_list<int64_t> shape) {
      Tensor t = need(key);
      if (!is_e4m3(t.dtype))
        type_error("{}: dtype {}; block scales are float8_e4m3fn (or their uint8 bits)", name(key),
                   dtype_name(t.dtype));
      require_shape(t, name(key).c_str(), shape, dims);
      return static_cast<const uint8_t*>(device_bytes(t, key));
    };
    auto floats = [&](const char* key, std::initializer_list<int64_t> shape, bool required) -> const float* {
      std::optional<Tensor> t = required ? std::optional<Tensor>(need(key)) : get(key);
      if (!t) return nullptr;
      if (!is_f32(t->dtype)) type_error("{}: dtype {}; pass float32", name(key), dtype_name(t->dtype));
      require_shape(*t, name(key).c_str(), shape, dims);
      return static_cast<const float*>(device_bytes(*t, key));
    };
    // Global scales: [n] (gate and up share one), or [n, 2] (gate, up) as engines that keep the w1 and w3
    // shards' scales apart hold them.
    auto globals = [&](const char* key, int64_t n, bool allow_pair, const float** gate, const float** up) {
      Tensor t = need(key);
      if (!is_f32(t.dtype)) type_error("{}: dtype {}; pass float32", name(key), dtype_name(t.dtype));
      const bool pair = allow_pair && t.numel() == 2 * n && t.ndim >= 1 && t.shape[t.ndim - 1] == 2;
      if (!pair && t.numel() != n)
        value_error("{}: shape {} must hold {} float32 value(s){} {}", name(key), shape_str(t), n,
                    allow_pair ? fmt::format(" (or {} x 2: gate, up)", n) : "", dims);
      std::vector<float> v = host_floats(t);
      if (!pair) {
        *gate = upload_floats(v);
        return;
      }
      std::vector<float> g(n), u(n);
      for (int64_t i = 0; i < n; ++i) g[i] = v[2 * i], u[i] = v[2 * i + 1];
      *gate = upload_floats(g);
      *up = upload_floats(u);
    };

    MoeLayerWeights w;
    w.w13_codes = codes("w13_weight", {E, 2 * I, H / 2});
    w.w13_scales = scales("w13_weight_scale", {E, 2 * I, H / 16});
    globals("w13_weight_scale_2", E, true, &w.w13_global, &w.w13_global_up);
    w.w2_codes = codes("w2_weight", {E, H, I / 2});
    w.w2_scales = scales("w2_weight_scale", {E, H, I / 16});
    globals("w2_weight_scale_2", E, false, &w.w2_global, nullptr);
    if (c.expert_bias) {
      w.b13 = floats("w13_bias", {E, 2 * I}, true);
      w.b2 = floats("w2_bias", {E, H}, true);
    } else {
      forbid("w13_bias", fmt::format("config '{}' has expert_bias = False", c.name));
      forbid("w2_bias", fmt::format("config '{}' has expert_bias = False", c.name));
    }
    if (c.router == RouterKind::kSoftmaxTopK)
      forbid("router_bias", fmt::format("config '{}' uses the softmax router, which takes no bias", c.name));
    else
      w.router_bias = floats("router_bias", {E}, false);
    if (std::optional<Tensor> rw = get("router_weight")) {
      if (!is_bf16(rw->dtype)) type_error("weights['router_weight']: dtype {}; pass bfloat16", dtype_name(rw->dtype));
      require_shape(*rw, "weights['router_weight']", {E, H}, dims);
      w.router_weight = device_bytes(*rw, "router_weight");
    }
    const char* shared_keys[] = {"shared_w13_weight", "shared_w13_weight_scale", "shared_w13_weight_scale_2",
                                 "shared_w2_weight",  "shared_w2_weight_scale",  "shared_w2_weight_scale_2",
                                 "shared_w13_bias",   "shared_w2_bias"};
    if (c.num_shared == 0) {
      for (const char* k : shared_keys)
        forbid(k, fmt::format("config '{}' has no shared expert (num_shared = 0)", c.name));
      return w;
    }
    // The shared expert: [N, K/2] or with a leading expert dimension of 1.
    auto shared_codes = [&](const char* key, int64_t n, int64_t k) {
      Tensor t = need(key);
      if (t.ndim == 3) require_shape(t, name(key).c_str(), {1, n, k}, dims);
      return t;
    };
    {
      Tensor t = shared_codes("shared_w13_weight", 2 * Is, H / 2);
      if (!is_u8(t.dtype)) type_error("weights['shared_w13_weight']: dtype {}; pass uint8", dtype_name(t.dtype));
      if (t.ndim != 3) require_shape(t, "weights['shared_w13_weight']", {2 * Is, H / 2}, dims);
      w.shared_w13_codes = static_cast<const uint8_t*>(device_bytes(t, "shared_w13_weight"));
      Tensor s = shared_codes("shared_w13_weight_scale", 2 * Is, H / 16);
      if (!is_e4m3(s.dtype))
        type_error("weights['shared_w13_weight_scale']: dtype {}; pass float8_e4m3fn", dtype_name(s.dtype));
      if (s.ndim != 3) require_shape(s, "weights['shared_w13_weight_scale']", {2 * Is, H / 16}, dims);
      w.shared_w13_scales = static_cast<const uint8_t*>(device_bytes(s, "shared_w13_weight_scale"));
      globals("shared_w13_weight_scale_2", 1, true, &w.shared_w13_global, &w.shared_w13_global_up);
    }
    {
      Tensor t = shared_codes("shared_w2_weight", H, Is / 2);
      if (!is_u8(t.dtype)) type_error("weights['shared_w2_weight']: dtype {}; pass uint8", dtype_name(t.dtype));
      if (t.ndim != 3) require_shape(t, "weights['shared_w2_weight']", {H, Is / 2}, dims);
      w.shared_w2_codes = static_cast<const uint8_t*>(device_bytes(t, "shared_w2_weight"));
      Tensor s = shared_codes("shared_w2_weight_scale", H, Is / 16);
      if (!is_e4m3(s.dtype))
        type_error("weights['shared_w2_weight_scale']: dtype {}; pass float8_e4m3fn", dtype_name(s.dtype));
      if (s.ndim != 3) require_shape(s, "weights['shared_w2_weight_scale']", {H, Is / 16}, dims);
      w.shared_w2_scales = static_cast<const uint8_t*>(device_bytes(s, "shared_w2_weight_scale"));
      globals("shared_w2_weight_scale_2", 1, false, &w.shared_w2_global, nullptr);
    }
    if (c.expert_bias) {
      w.shared_b13 = floats("shared_w13_bias", {2 * Is}, true);
      w.shared_b2 = floats("shared_w2_bias", {H}, true);
    } else {
      forbid("shared_w13_bias", fmt::format("config '{}' has expert_bias = False", c.name));
      forbid("shared_w2_bias", fmt::format("config '{}' has expert_bias = False", c.name));
    }
    return w;
  }

  MoeConfig cfg_;
  Shape shape_;
  int device_ = 0;
  int64_t max_tokens_ = 0;
  std::unique_ptr<MoeLayer> layer_;
  std::vector<DeviceBuffer<uint8_t>> staged_;
  DeviceBuffer<uint8_t> workspace_;
  DeviceBuffer<float> logits_f32_;  // [max_tokens, E]: bf16 router logits converted for the router
};

// ------------------------------------------------------------------------------------------------
// Format helpers (CPU)
// ------------------------------------------------------------------------------------------------

template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, const std::vector<size_t>& shape) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(heap->data(), shape.size(), shape.data(), owner);
}

Tensor host_tensor(nb::handle obj, const char* name) {
  Tensor t = tensor_of(obj, name);
  if (!t.is_host())
    value_error("{}: on {}; the format helpers run on the CPU (pass a host array, e.g. .cpu())", name,
                device_str(t.device_type, t.device_id));
  require_row_major(t, name);
  if (t.ndim < 1) value_error("{}: a scalar; pass an array whose last dimension is K", name);
  return t;
}
std::vector<size_t> lead_shape(const Tensor& t, int64_t last) {
  std::vector<size_t> s;
  for (int i = 0; i + 1 < t.ndim; ++i) s.push_back(static_cast<size_t>(t.shape[i]));
  s.push_back(static_cast<size_t>(last));
  return s;
}

std::tuple<nb::ndarray<nb::numpy, uint8_t>, nb::ndarray<nb::numpy, uint8_t>, float> quantize_nvfp4_py(
    nb::handle x, std::optional<float> global_scale) {
  Tensor t = host_tensor(x, "x");
  const int64_t K = t.shape[t.ndim - 1], rows = K > 0 ? t.numel() / K : 0;
  if (K % kNvfp4Block != 0) value_error("x: last dimension K = {} must be a multiple of 16 (the NVFP4 block)", K);
  Nvfp4Tensor q;
  if (is_f32(t.dtype)) {
    q = quantize_nvfp4(std::span<const float>(static_cast<const float*>(t.data), t.numel()), rows, K, global_scale);
  } else if (is_bf16(t.dtype)) {
    q = quantize_nvfp4_bf16(std::span<const uint16_t>(static_cast<const uint16_t*>(t.data), t.numel()), rows, K,
                            global_scale);
  } else {
    type_error("x: dtype {}; pass float32 or bfloat16", dtype_name(t.dtype));
  }
  const float g = q.global_scale;
  return {to_numpy(std::move(q.codes), lead_shape(t, K / 2)), to_numpy(std::move(q.scales), lead_shape(t, K / 16)), g};
}

// row_global: one float32 multiplier per row of codes (the Python wrapper broadcasts a scalar / [E]).
nb::ndarray<nb::numpy, float> dequantize_nvfp4_py(nb::handle codes, nb::handle scales, nb::handle row_global) {
  Tensor c = host_tensor(codes, "codes"), s = host_tensor(scales, "scales"),
         g = host_tensor(row_global, "global_scale");
  if (!is_u8(c.dtype)) type_error("codes: dtype {}; packed E2M1 codes are uint8", dtype_name(c.dtype));
  if (!is_e4m3(s.dtype))
    type_error("scales: dtype {}; NVFP4 block scales are float8_e4m3fn (or uint8)", dtype_name(s.dtype));
  if (!is_f32(g.dtype)) type_error("global_scale: dtype {}; pass float32", dtype_name(g.dtype));
  const int64_t K = 2 * c.shape[c.ndim - 1], rows = K > 0 ? c.numel() * 2 / K : 0;
  if (s.ndim != c.ndim || K % kNvfp4Block != 0 || s.shape[s.ndim - 1] != K / kNvfp4Block)
    value_error("scales: shape {} must be codes' shape {} with the last dimension K/16 = {} (K = {})", shape_str(s),
                shape_str(c), K / kNvfp4Block, K);
  for (int i = 0; i + 1 < c.ndim; ++i)
    if (s.shape[i] != c.shape[i])
      value_error("scales: shape {} must match codes' shape {} except in the last dimension", shape_str(s),
                  shape_str(c));
  if (g.numel() != rows) value_error("global_scale: {} values for {} rows", g.numel(), rows);
  const auto* cp = static_cast<const uint8_t*>(c.data);
  const auto* sp = static_cast<const uint8_t*>(s.data);
  const auto* gp = static_cast<const float*>(g.data);
  std::vector<float> out(static_cast<size_t>(rows * K));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = r * K + k;
      out[i] = nvfp4_dequantize_element(packed_code(cp, i), sp[i / kNvfp4Block], gp[r]);
    }
  return to_numpy(std::move(out), lead_shape(c, K));
}

std::pair<nb::ndarray<nb::numpy, uint8_t>, nb::ndarray<nb::numpy, uint8_t>> quantize_mxfp4_py(nb::handle x) {
  Tensor t = host_tensor(x, "x");
  if (!is_f32(t.dtype)) type_error("x: dtype {}; pass float32", dtype_name(t.dtype));
  const int64_t K = t.shape[t.ndim - 1], rows = K > 0 ? t.numel() / K : 0;
  if (K % kMxfp4Block != 0) value_error("x: last dimension K = {} must be a multiple of 32 (the MXFP4 block)", K);
  Mxfp4Tensor q = quantize_mxfp4(std::span<const float>(static_cast<const float*>(t.data), t.numel()), rows, K);
  return {to_numpy(std::move(q.codes), lead_shape(t, K / 2)), to_numpy(std::move(q.scales), lead_shape(t, K / 32))};
}

nb::ndarray<nb::numpy, float> dequantize_mxfp4_py(nb::handle codes, nb::handle scales) {
  Tensor c = host_tensor(codes, "codes"), s = host_tensor(scales, "scales");
  if (!is_u8(c.dtype)) type_error("codes: dtype {}; packed E2M1 codes are uint8", dtype_name(c.dtype));
  if (!is_u8(s.dtype)) type_error("scales: dtype {}; MXFP4 scales are E8M0 bytes (uint8)", dtype_name(s.dtype));
  const int64_t K = 2 * c.shape[c.ndim - 1], rows = K > 0 ? c.numel() * 2 / K : 0;
  if (s.ndim != c.ndim || K % kMxfp4Block != 0 || s.shape[s.ndim - 1] != K / kMxfp4Block)
    value_error("scales: shape {} must be codes' shape {} with the last dimension K/32 = {} (K = {})", shape_str(s),
                shape_str(c), K / kMxfp4Block, K);
  Mxfp4Tensor m;
  m.rows = rows;
  m.cols = K;
  m.codes.assign(static_cast<const uint8_t*>(c.data), static_cast<const uint8_t*>(c.data) + c.numel());
  m.scales.assign(static_cast<const uint8_t*>(s.data), static_cast<const uint8_t*>(s.data) + s.numel());
  return to_numpy(dequantize_mxfp4(m), lead_shape(c, K));
}

nb::ndarray<nb::numpy, uint8_t> swizzle_py(nb::handle scales) {
  Tensor s = host_tensor(scales, "scales");
  if (s.dtype.bits != 8 || s.ndim != 2) value_error("scales: a 2-D array of 8-bit scales [rows, K/16] is required");
  const int64_t rows = s.shape[0], kb = s.shape[1];
  std::vector<uint8_t> out =
      swizzle_scales_128x4(std::span<const uint8_t>(static_cast<const uint8_t*>(s.data), s.numel()), rows, kb);
  return to_numpy(std::move(out),
                  {static_cast<size_t>((rows + 127) / 128 * 128), static_cast<size_t>((kb + 3) / 4 * 4)});
}

nb::ndarray<nb::numpy, uint8_t> unswizzle_py(nb::handle swizzled, int64_t rows, int64_t kblocks) {
  Tensor s = host_tensor(swizzled, "swizzled");
  if (s.dtype.bits != 8) value_error("swizzled: 8-bit scales are required");
  if (rows < 1 || kblocks < 1) value_error("rows = {} and kblocks = {} must be >= 1", rows, kblocks);
  const int64_t need = swizzled_128x4_size(rows, kblocks);
  if (s.numel() != need)
    value_error("swizzled: {} bytes; the 128x4 layout of [{}, {}] holds {}", s.numel(), rows, kblocks, need);
  std::vector<uint8_t> out =
      unswizzle_scales_128x4(std::span<const uint8_t>(static_cast<const uint8_t*>(s.data), s.numel()), rows, kblocks);
  return to_numpy(std::move(out), {static_cast<size_t>(rows), static_cast<size_t>(kblocks)});
}

// ------------------------------------------------------------------------------------------------
// explain: the planner's verdict as a dict
// ------------------------------------------------------------------------------------------------

nb::dict make_dict(std::initializer_list<std::pair<const char*, nb::object>> items) {
  nb::dict d;
  for (const auto& [k, v] : items) d[k] = v;
  return d;
}

nb::list lines_of(const std::vector<SmemLine>& lines) {
  nb::list l;
  for (const SmemLine& s : lines)
    l.append(make_dict({{"what", nb::cast(s.what)}, {"formula", nb::cast(s.formula)}, {"bytes", nb::cast(s.bytes)}}));
  return l;
}
nb::dict verdict_of(const Verdict& v) {
  return make_dict({{"valid", nb::cast(v.valid)}, {"reason", nb::cast(v.reason)}, {"failures", nb::cast(v.failures)}});
}
nb::dict arch_of(const ArchInfo& a) {
  return make_dict({{"name", nb::cast(a.name)},
                    {"cc", nb::cast(a.cc())},
                    {"smem_optin_per_block", nb::cast(a.smem_optin_per_block)},
                    {"smem_per_sm", nb::cast(a.smem_per_sm)},
                    {"reserved_smem_per_block", nb::cast(a.reserved_smem_per_block)},
                    {"regs_per_sm", nb::cast(a.regs_per_sm)},
                    {"max_threads_per_sm", nb::cast(a.max_threads_per_sm)},
                    {"max_ctas_per_sm", nb::cast(a.max_ctas_per_sm)},
                    {"num_sms", nb::cast(a.num_sms)},
                    {"sms_source", nb::cast(a.sms_source)},
                    {"mma_families", nb::cast(a.families_string())},
                    {"from_device", nb::cast(a.from_device)},
                    {"device_name", nb::cast(a.device_name)}});
}
nb::dict tile_of(const TileConfig& c) {
  return make_dict({{"name", nb::cast(c.name())},
                    {"bn", nb::cast(c.bn)},
                    {"bt", nb::cast(c.bt)},
                    {"bk", nb::cast(c.bk)},
                    {"stages", nb::cast(c.stages)},
                    {"warps", nb::cast(c.warps)},
                    {"mma", nb::cast(c.mma == 0   ? std::string("mma.sync")
                                     : c.mma == 1 ? std::string("wgmma")
                                     : c.mma == 2 ? std::string("stream")
                                     : c.mma == 3 ? std::string("tma")
                                                  : fmt::format("mma kind {}", c.mma))},
                    {"ctas", nb::cast(c.ctas)}});
}

TuneProblem gemm_problem(const MoeConfig& m, int g) {
  TuneProblem pr;
  pr.experts = m.num_experts;
  pr.top_k = m.top_k;
  pr.n = g == 1 ? m.gemm1_n() : m.gemm2_n();
  pr.k = g == 1 ? m.gemm1_k() : m.gemm2_k();
  pr.epilogue = g == 1
                    ? (m.activation == Activation::kGptOssSwiGLU ? GemmEpilogue::kGptOssSwiGLU : GemmEpilogue::kSwiGLU)
                    : GemmEpilogue::kPlain;
  return pr;
}

int parse_tile(const std::string& s, int (&v)[3]) {
  if (std::sscanf(s.c_str(), "%dx%dx%d", &v[0], &v[1], &v[2]) != 3)
    value_error("tile = '{}' is not 'AxBxC' (e.g. '128x64x128')", s);
  return 0;
}

nb::dict explain_py(std::optional<std::string> tile, std::optional<std::string> arch_name, const std::string& kernel,
                    int stages, int warps, bool wgmma, std::optional<MoeConfig> model, int64_t tokens, int sms,
                    int64_t epilogue_bytes) {
  ArchInfo arch = arch_name ? arch_from_name(*arch_name) : default_arch();
  if (sms > 0) arch.num_sms = sms, arch.sms_source = "sms argument";
  const int64_t T = tokens > 0 ? tokens : 1;
  nb::dict r;
  r["arch"] = arch_of(arch);
  r["kernel"] = kernel;
  if (kernel == kFamilySm80Grouped) {
    if (tile) {
      int t[3];
      parse_tile(*tile, t);
      TileConfig cfg{t[0], t[1], t[2], 4, 8, wgmma ? 1 : 0};
      for (const TileConfig& c : kGemmConfigs)
        if (c.bn == cfg.bn && c.bt == cfg.bt && c.bk == cfg.bk && c.mma == cfg.mma) {
          cfg.stages = c.stages;
          cfg.warps = c.warps;
          break;
        }
      if (stages > 0) cfg.stages = stages;
      if (warps > 0) cfg.warps = warps;
      const Sm80Plan p = plan_sm80(cfg, arch);
      Verdict v = p.verdict;
      r["config"] = tile_of(cfg);
      r["well_formed"] = tile_config_well_formed(cfg);
      if (tile_config_well_formed(cfg)) {
        r["smem"] = make_dict({{"lines", nb::cast(lines_of(p.smem.lines))},
                               {"stage_bytes", nb::cast(p.smem.stage_bytes)},
                               {"sched_bytes", nb::cast(p.smem.sched_bytes)},
                               {"total_bytes", nb::cast(p.smem.total_bytes)},
                               {"padding_bytes", nb::cast(p.smem.padding_bytes)},
                               {"max_stages_that_fit", nb::cast(p.max_stages_that_fit)}});
        r["registers"] = make_dict({{"estimate", nb::cast(p.regs.estimate)},
                                    {"launch_bounds_cap", nb::cast(p.regs.launch_bounds_cap)},
                                    {"expected", nb::cast(p.regs.expected)},
                                    {"min_blocks", nb::cast(p.regs.min_blocks)},
                                    {"formula", nb::cast(p.regs.formula)}});
        r["occupancy"] = make_dict({{"by_smem", nb::cast(p.occ.by_smem)},
                                    {"by_registers", nb::cast(p.occ.by_registers)},
                                    {"by_threads", nb::cast(p.occ.by_threads)},
                                    {"by_cta_cap", nb::cast(p.occ.by_cta_cap)},
                                    {"ctas_per_sm", nb::cast(p.occ.ctas_per_sm)},
                                    {"limiter", nb::cast(p.occ.limiter)}});
        if (model) {
          const MoeConfig& m = *model;
          const double rows = static_cast<double>(T) * m.top_k / m.num_experts;
          const auto rr = static_cast<int64_t>(std::ceil(rows));
          nb::list gemms;
          for (int g = 1; g <= 2; ++g) {
            const TuneProblem pr = gemm_problem(m, g);
            const Verdict pv = check_problem_sm80(cfg, pr.n, pr.k, m.num_experts);
            const WorkEstimate w = work_estimate(GemmProblem::uniform(m.num_experts, rr, pr.n, pr.k), cfg.bn, cfg.bt,
                                                 arch.num_sms, p.occ.ctas_per_sm);
            for (const auto& f : pv.failures) v.fail(fmt::format("GEMM{}: {}", g, f));
            gemms.append(make_dict({{"gemm", nb::cast(g)},
                                    {"n", nb::cast(pr.n)},
                                    {"k", nb::cast(pr.k)},
                                    {"tiles", nb::cast(w.tiles)},
                                    {"slots", nb::cast(w.slots)},
                                    {"waves", nb::cast(w.waves)},
                                    {"full_waves", nb::cast(w.full_waves)},
                                    {"last_wave_fill", nb::cast(w.last_wave_fill)},
                                    {"verdict", nb::cast(verdict_of(pv))}}));
          }
          r["problem"] = make_dict({{"model", nb::cast(m.name)},
                                    {"tokens", nb::cast(T)},
                                    {"rows_per_expert", nb::cast(rows)},
                                    {"gemms", nb::cast(gemms)}});
        }
      }
      r["verdict"] = verdict_of(v);
      return r;
    }
    nb::list configs;
    int valid = 0;
    for (const TileConfig& c : kGemmConfigs) {
      const Sm80Plan p = plan_sm80(c, arch);
      valid += p.verdict.valid;
      nb::dict d = tile_of(c);
      d["smem_bytes"] = p.smem.total_bytes;
      d["registers"] = p.regs.expected;
      d["ctas_per_sm"] = p.occ.ctas_per_sm;
      d["verdict"] = verdict_of(p.verdict);
      configs.append(d);
    }
    r["configs"] = configs;
    r["valid_configs"] = valid;
    Verdict v;
    if (valid == 0) v.fail(fmt::format("no config of {} is valid on {}", kFamilySm80Grouped, arch.name));
    if (model) {
      nb::list picks;
      for (int g = 1; g <= 2; ++g) {
        const TuneProblem pr = gemm_problem(*model, g);
        const TuneLookup l = choose_config(pr, T, arch);
        const Sm80Plan p = plan_sm80(*l.config, arch, 0, l.config->mma == 2 ? pr.k : 0);
        const Verdict pv = check_problem_sm80(*l.config, pr.n, pr.k, pr.experts, &arch);
        picks.append(make_dict({{"gemm", nb::cast(g)},
                                {"n", nb::cast(pr.n)},
                                {"k", nb::cast(pr.k)},
                                {"config", nb::cast(tile_of(*l.config))},
                                {"source", nb::cast(l.source)},
                                {"reason", nb::cast(l.reason)},
                                {"valid_here", nb::cast(p.verdict.valid && pv.valid)}}));
      }
      r["picks"] = picks;
      r["model"] = model->name;
      r["tokens"] = T;
    }
    r["verdict"] = verdict_of(v);
    return r;
  }
  if (kernel == kFamilyCutlassSm120) {
    std::vector<CutlassTile> tiles;
    if (tile) {
      int t[3];
      parse_tile(*tile, t);
      tiles.push_back({t[0], t[1], t[2]});
    } else {
      tiles = {{128, 128, 128}, {128, 128, 256}, {128, 256, 128}, {256, 128, 128}};
    }
    nb::list plans;
    Verdict all;
    for (const CutlassTile& t : tiles) {
      CutlassSm120Options o;
      o.stages = stages;
      if (epilogue_bytes >= 0) o.carveout = static_cast<size_t>(epilogue_bytes);
      o.capacity = arch.smem_optin_per_block;
      const CutlassSm120Plan p = plan_cutlass_sm120(t, o);
      if (tiles.size() == 1 && !p.verdict.valid) all = p.verdict;
      plans.append(make_dict({{"tile", nb::cast(fmt::format("{}x{}x{}", t.m, t.n, t.k))},
                              {"stages", nb::cast(p.stages)},
                              {"auto_stages", nb::cast(p.auto_stages)},
                              {"per_stage_bytes", nb::cast(p.mainloop.auto_stage_bytes)},
                              {"footprint_bytes", nb::cast(p.kernel.footprint)},
                              {"carveout_bytes", nb::cast(p.carveout)},
                              {"fix", nb::cast(p.fix)},
                              {"capacity_bytes", nb::cast(p.capacity)},
                              {"over_by_bytes", nb::cast(p.over_by)},
                              {"ignored_by_auto_bytes", nb::cast(p.ignored_by_auto)},
                              {"max_stages_that_fit", nb::cast(p.max_stages_that_fit)},
                              {"lines", nb::cast(lines_of(p.lines))},
                              {"verdict", nb::cast(verdict_of(p.verdict))}}));
    }
    r["plans"] = plans;
    r["verdict"] = verdict_of(all);
    return r;
  }
  value_error("kernel = '{}' is not a kernel family (known: '{}', '{}')", kernel, kFamilySm80Grouped,
              kFamilyCutlassSm120);
}

}  // namespace
}  // namespace fp4moe::py

NB_MODULE(_ext, m) {
  using namespace fp4moe;
  using namespace fp4moe::py;
  m.doc() = "fp4moe's C++ core (private; use the fp4moe package)";
  m.attr("__version__") = FP4MOE_VERSION;
  // Layers kept alive until interpreter exit (module globals of user code) are not leaks worth a warning.
  nb::set_leak_warnings(false);

  // fp4moe.Error: a bad config or a CUDA failure from the library. Both a ValueError and a
  // RuntimeError, so that `except ValueError` around bad input and `except RuntimeError` both work.
  nb::object bases = nb::make_tuple(nb::handle(PyExc_ValueError), nb::handle(PyExc_RuntimeError));
  g_error_type = PyErr_NewExceptionWithDoc("fp4moe.Error",
                                           "An error reported by the fp4moe library (a bad config or weight, a "
                                           "launch that does not fit, a CUDA failure).",
                                           bases.ptr(), nullptr);
  m.attr("Error") = nb::handle(g_error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyErr_SetString(g_error_type, user_message(e.what()).c_str());
    }
  });

  nb::class_<MoeConfig>(m, "Config", "An MoE layer's shape and routing (fp4moe::MoeConfig).")
      .def(nb::init<>())
      .def_rw("name", &MoeConfig::name)
      .def_rw("hidden", &MoeConfig::hidden)
      .def_rw("intermediate", &MoeConfig::intermediate)
      .def_rw("num_experts", &MoeConfig::num_experts)
      .def_rw("top_k", &MoeConfig::top_k)
      .def_rw("num_shared", &MoeConfig::num_shared)
      .def_rw("renormalize", &MoeConfig::renormalize)
      .def_rw("n_group", &MoeConfig::n_group)
      .def_rw("topk_group", &MoeConfig::topk_group)
      .def_rw("routed_scaling", &MoeConfig::routed_scaling)
      .def_rw("swiglu_alpha", &MoeConfig::swiglu_alpha)
      .def_rw("swiglu_limit", &MoeConfig::swiglu_limit)
      .def_rw("expert_bias", &MoeConfig::expert_bias)
      .def_prop_rw(
          "router", [](const MoeConfig& c) { return std::string(router_name(c.router)); },
          [](MoeConfig& c, const std::string& s) { c.router = router_from(s); },
          "'softmax', 'sigmoid_grouped' or 'gpt_oss'")
      .def_prop_rw(
          "activation", [](const MoeConfig& c) { return std::string(activation_name(c.activation)); },
          [](MoeConfig& c, const std::string& s) { c.activation = activation_from(s); }, "'swiglu' or 'gpt_oss_swiglu'")
      .def_prop_rw(
          "format", [](const MoeConfig& c) { return std::string(format_name(c.format)); },
          [](MoeConfig& c, const std::string& s) { c.format = format_from(s); }, "'nvfp4' or 'mxfp4'")
      .def(
          "validate", [](const MoeConfig& c) { validate_moe_layer_config(c); },
          "Raises fp4moe.Error naming the field and the rule when the GPU layer cannot run this config.")
      .def("__copy__", [](const MoeConfig& c) { return c; });

  m.def(
      "preset", [](const std::string& name) { return preset(name); }, "name"_a,
      "A copy of a model preset (fp4moe.preset_names()).");
  m.def("preset_names", &preset_names);
  m.def("gpu_available", &gpu_available, "True when a CUDA device is usable by this process.");
  m.def("device_count", []() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  });
  m.def("current_device", []() {
    require_gpu("fp4moe.current_device");
    int d = 0;
    FP4MOE_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  });
  m.def(
      "workspace_layout_bytes",
      [](const MoeConfig& c, int64_t max_tokens, bool router_gemm) {
        return moe_workspace_layout(c, max_tokens, router_gemm).total;
      },
      "config"_a, "max_tokens"_a, "router_weight"_a = false);

  nb::class_<Layer>(m, "Layer")
      .def(nb::init<const MoeConfig&, const nb::dict&, int64_t, int, int64_t>(), "config"_a, "weights"_a,
           "max_tokens"_a, "device"_a, "stream"_a)
      .def(nb::init<const std::string&, int, int64_t, int, bool>(), "checkpoint_dir"_a, "layer"_a, "max_tokens"_a,
           "device"_a, "routed_only"_a)
      .def("forward", &Layer::forward, "hidden"_a.none(), "router_logits"_a.none(), "topk_ids"_a.none(),
           "topk_weights"_a.none(), "out"_a.none(), "stream"_a)
      .def("route", &Layer::route, "router_logits"_a.none(), "topk_ids"_a.none(), "topk_weights"_a.none(), "stream"_a)
      .def("take_routing_error", &Layer::take_routing_error)
      .def("bench_cpp_forward", &Layer::bench_cpp_forward, "hidden"_a.none(), "router_logits"_a.none(),
           "topk_ids"_a.none(), "topk_weights"_a.none(), "out"_a.none(), "stream"_a, "iters"_a)
      .def_prop_ro("config", &Layer::config)
      .def_prop_ro("device", &Layer::device)
      .def_prop_ro("max_tokens", &Layer::max_tokens)
      .def_prop_ro("workspace_bytes", &Layer::workspace_bytes)
      .def_prop_ro("has_router_weight", &Layer::has_router_weight);

  m.def(
      "_check_forward_args",
      [](const MoeConfig& cfg, int64_t max_tokens, bool has_router_weight, nb::handle hidden, nb::handle router_logits,
         nb::handle topk_ids, nb::handle topk_weights, nb::handle out) {
        Shape sh{cfg, max_tokens, -1, has_router_weight};
        const Call c = prepare_call(sh, hidden, router_logits, topk_ids, topk_weights, out, 0);
        return c.tokens;
      },
      "config"_a, "max_tokens"_a, "has_router_weight"_a, "hidden"_a.none(), "router_logits"_a.none(),
      "topk_ids"_a.none(), "topk_weights"_a.none(), "out"_a.none(),
      "forward()'s argument checks without a layer or a GPU (device checks skipped); returns T. For tests.");
  m.def("quantize_nvfp4", &quantize_nvfp4_py, "x"_a, "global_scale"_a.none() = nb::none());
  m.def("dequantize_nvfp4", &dequantize_nvfp4_py, "codes"_a, "scales"_a, "row_global"_a);
  m.def("quantize_mxfp4", &quantize_mxfp4_py, "x"_a);
  m.def("dequantize_mxfp4", &dequantize_mxfp4_py, "codes"_a, "scales"_a);
  m.def("swizzle_scales_128x4", &swizzle_py, "scales"_a);
  m.def("unswizzle_scales_128x4", &unswizzle_py, "swizzled"_a, "rows"_a, "kblocks"_a);
  m.def("explain", &explain_py, "tile"_a.none(), "arch"_a.none(), "kernel"_a, "stages"_a, "warps"_a, "wgmma"_a,
        "model"_a.none(), "tokens"_a, "sms"_a, "epilogue_bytes"_a);
}
