// The safetensors reader and the checkpoint loaders on bad input: every malformed file, header, index,
// config or tensor is refused with an fp4moe::Error that names the file (relative to the checkpoint,
// never the absolute path) and the tensor or key.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "checkpoint_test_util.hpp"
#include "fp4moe/checkpoint.hpp"
#include "fp4moe/safetensors.hpp"

namespace fp4moe {
namespace {

using test::bytes_of;
using test::expect_error;
using test::f32_bytes;
using test::ScratchDir;
using test::StTensor;

std::span<const uint8_t> as_span(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

// Parses `bytes` as a file called "bad.safetensors", expecting an error mentioning `must`.
void expect_header_error(const std::string& bytes, const std::vector<std::string>& must) {
  std::vector<std::string> m = must;
  m.push_back("bad.safetensors");
  expect_error([&] { parse_safetensors_header(as_span(bytes), "bad.safetensors"); }, m);
}

std::vector<StTensor> two_tensors() {
  return {{"a.weight", "BF16", {2, 3}, bytes_of(12)}, {"b.scale", "F32", {}, f32_bytes(0.5f)}};
}

TEST(Safetensors, ParsesAWellFormedFile) {
  const std::string f = test::safetensors_bytes(two_tensors());
  const SafetensorsHeader h = parse_safetensors_header(as_span(f), "ok.safetensors");
  ASSERT_EQ(h.tensors.size(), 2u);
  const SafetensorsTensorInfo* a = h.find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, SafetensorsDtype::kBF16);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->end - a->begin, 12u);
  EXPECT_EQ(h.find("b.scale")->numel(), 1);
  EXPECT_EQ(h.find("missing"), nullptr);
  EXPECT_EQ(h.data_offset + h.data_bytes, f.size());
}

TEST(Safetensors, ReadsTensorBytesThroughTheMapping) {
  ScratchDir d;
  test::write_file(d.file("model.safetensors"), test::safetensors_bytes(two_tensors()));
  SafetensorsCheckpoint ck(d.str());
  EXPECT_FALSE(ck.sharded());
  const TensorRef t = ck.tensor("a.weight");
  EXPECT_EQ(std::vector<uint8_t>(t.data, t.data + t.bytes()), bytes_of(12));
  EXPECT_EQ(t.file, "model.safetensors");
  float v;
  std::memcpy(&v, ck.tensor("b.scale").data, 4);
  EXPECT_EQ(v, 0.5f);
}

TEST(SafetensorsBadFile, Truncated) {
  expect_header_error("", {"0 bytes", "8-byte header length"});
  expect_header_error("abc", {"3 bytes"});
  // a whole file cut in its data: the last tensor's offsets now run past the end
  std::string f = test::safetensors_bytes(two_tensors());
  f.resize(f.size() - 2);
  expect_header_error(f, {"b.scale", "past the end of the data"});
}

TEST(SafetensorsBadFile, HeaderLengthPastTheEnd) {
  std::string f = test::safetensors_bytes(two_tensors());
  f[0] = static_cast<char>(0xff);  // length grows by 255 - (old low byte)
  f[1] = static_cast<char>(0x7f);
  expect_header_error(f, {"header length", "runs past the end of the file"});
}

TEST(SafetensorsBadFile, HeaderLengthOverTheCap) {
  std::string f(8, '\0');
  f[7] = 0x01;  // 2^56 bytes
  expect_header_error(f, {"exceeds the limit"});
}

TEST(SafetensorsBadFile, MalformedJson) {
  expect_header_error(test::safetensors_bytes({}, "{\"a\": {\"dtype\": "), {"not well-formed JSON"});
  expect_header_error(test::safetensors_bytes({}, "[1, 2]"), {"must be a JSON object"});
  expect_header_error(test::safetensors_bytes({}, "{\"a\": 5}"), {"tensor \"a\"", "must be an object"});
  expect_header_error(
      test::safetensors_bytes({}, R"({"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 0]},
                                     "a": {"dtype": "F32", "shape": [], "data_offsets": [0, 0]}})"),
      {"names \"a\" twice"});
  expect_header_error(test::safetensors_bytes({}, R"({"__metadata__": {"k": 5}})"), {"__metadata__", "string"});
}

TEST(SafetensorsBadFile, UnknownDtypeAndBadShape) {
  expect_header_error(test::safetensors_bytes({}, R"({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}})"),
                      {"tensor \"w\"", "unknown dtype \"F4\""});
  expect_header_error(test::safetensors_bytes({}, R"({"w": {"dtype": "U8", "shape": [-2], "data_offsets": [0, 0]}})"),
                      {"tensor \"w\"", "non-negative integers"});
  expect_header_error(
      test::safetensors_bytes({}, R"({"w": {"dtype": "U8", "shape": [4294967296, 4294967296, 4294967296],
                                        "data_offsets": [0, 0]}})"),
      {"tensor \"w\"", "overflows"});
}

TEST(SafetensorsBadFile, OffsetsOutOfRange) {
  std::string f = test::safetensors_bytes(
      {}, R"({"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4000]}})");
  f += std::string(4, 'x');
  expect_header_error(f, {"tensor \"w\"", "[0, 4000]", "past the end of the data (4 bytes"});
  expect_header_error(test::safetensors_bytes({}, R"({"w": {"dtype": "U8", "shape": [0], "data_offsets": [3, 1]}})"),
                      {"tensor \"w\"", "end before they begin"});
  expect_header_error(test::safetensors_bytes({}, R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0]}})"),
                      {"tensor \"w\"", "data_offsets must be [begin, end]"});
}

TEST(SafetensorsBadFile, OverlappingTensors) {
  std::string f = test::safetensors_bytes(
      {}, R"({"x": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
              "y": {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]}})");
  f += std::string(12, 'x');
  expect_header_error(f, {"\"x\" [0, 8]", "\"y\" [4, 12]", "overlap"});
}

TEST(SafetensorsBadFile, DtypeTimesShapeMismatch) {
  std::string f = test::safetensors_bytes(
      {}, R"({"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}})");
  f += std::string(8, 'x');
  expect_header_error(f, {"tensor \"w\"", "dtype BF16 x shape [2, 3] = 12 bytes", "hold 8 bytes"});
}

TEST(SafetensorsBadFile, IndexErrors) {
  expect_error([] { parse_safetensors_index("{", "model.safetensors.index.json"); },
               {"model.safetensors.index.json", "not well-formed"});
  expect_error([] { parse_safetensors_index(R"({"metadata": {}})", "model.safetensors.index.json"); },
               {"missing weight_map"});
  expect_error([] { parse_safetensors_index(R"({"weight_map": {"w": "/etc/passwd"}})", "i.json"); },
               {"weight_map[\"w\"]", "relative path inside the checkpoint"});
  expect_error([] { parse_safetensors_index(R"({"weight_map": {"w": "../x.safetensors"}})", "i.json"); },
               {"weight_map[\"w\"]", "relative path"});
  expect_error([] { parse_safetensors_index(R"({"weight_map": {"w": 3}})", "i.json"); }, {"weight_map[\"w\"]"});
  const SafetensorsIndex ok =
      parse_safetensors_index(R"({"weight_map": {"a": "s2.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"}})",
                              "i.json");
  EXPECT_EQ(ok.files, (std::vector<std::string>{"s1.safetensors", "s2.safetensors"}));
}

TEST(SafetensorsBadFile, DirectoryProblems) {
  ScratchDir d;
  const std::string abs = d.str();
  expect_error([&] { SafetensorsCheckpoint ck(d.str()); }, {"no model.safetensors.index.json and no *.safetensors"});
  test::write_file(d.file("a.safetensors"), test::safetensors_bytes(two_tensors()));
  test::write_file(d.file("b.safetensors"), test::safetensors_bytes(two_tensors()));
  expect_error([&] { SafetensorsCheckpoint ck(d.str()); }, {"2 .safetensors files", "index"});
  // a file that is not safetensors: named by its basename, never by the absolute path
  ScratchDir d2;
  test::write_file(d2.file("model.safetensors"), "0123");
  expect_error([&] { SafetensorsCheckpoint ck(d2.str()); }, {"model.safetensors", "4 bytes"}, d2.str());
}

// ---- Bad checkpoints derived from the exporter-written fixtures ----

// Rewrites one file of a copied fixture: the header edited by `edit_header`, the data by `edit_data`
// (byte offsets are relative to the data buffer).
template <class EditHeader, class EditData>
void rewrite(const std::string& path, EditHeader&& edit_header, EditData&& edit_data) {
  const std::string f = test::read_file(path);
  const SafetensorsHeader h = parse_safetensors_header(as_span(f), "x");
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(f.substr(8, h.header_bytes));
  std::string data = f.substr(h.data_offset);
  edit_header(j);
  edit_data(h, data);
  test::write_file(path, test::safetensors_bytes({}, j.dump()) + data);
}
void no_data_edit(const SafetensorsHeader&, std::string&) {}

HostMoeLayer load_dir(const std::string& dir, int layer) {
  SafetensorsCheckpoint ck(dir);
  const CheckpointInfo info = inspect_checkpoint(ck);
  LoadOptions o;
  o.warn = [](const std::string&) {};
  return load_moe_layer(ck, info, layer, o);
}

const char* kQwen = "modelopt-qwen3-moe-nvfp4";

TEST(CheckpointBadFile, FixtureLoadsUnmodified) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, kQwen);
  EXPECT_NO_THROW(load_dir(dir, 1));
}

TEST(CheckpointBadFile, MissingTensor) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, kQwen);
  const std::string name = "model.layers.1.mlp.experts.3.up_proj.weight_scale";
  rewrite(dir + "/model.safetensors", [&](auto& j) { j.erase(name); }, no_data_edit);
  expect_error([&] { load_dir(dir, 1); }, {"model.safetensors", "'" + name + "' is missing"}, d.str());
}

void set_f32(const std::string& dir, const std::string& file, const std::string& name, float v) {
  rewrite(dir + "/" + file, [](auto&) {}, [&](const SafetensorsHeader& h, std::string& data) {
    const SafetensorsTensorInfo* t = h.find(name);
    ASSERT_NE(t, nullptr) << name;
    std::memcpy(data.data() + t->begin, &v, 4);
  });
}

TEST(CheckpointBadFile, NaNAndNegativeGlobalScales) {
  const std::string name = "model.layers.1.mlp.experts.2.down_proj.weight_scale_2";
  for (float v : {std::numeric_limits<float>::quiet_NaN(), -0.25f, 0.0f, std::numeric_limits<float>::infinity()}) {
    ScratchDir d;
    const std::string dir = test::copy_fixture(d, kQwen);
    set_f32(dir, "model.safetensors", name, v);
    expect_error([&] { load_dir(dir, 1); }, {"model.safetensors", name, "finite, positive global scale"}, d.str());
  }
  // compressed-tensors stores the reciprocal: the same rule on weight_global_scale
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, "llmcompressor-qwen3-moe-nvfp4");
  const std::string ct = "model.layers.1.mlp.experts.5.gate_proj.weight_global_scale";
  set_f32(dir, "model.safetensors", ct, -3.0f);
  expect_error([&] { load_dir(dir, 1); }, {"model.safetensors", ct, "finite, positive"}, d.str());
}

TEST(CheckpointBadFile, DtypeAndShapeMismatch) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, kQwen);
  const std::string name = "model.layers.1.mlp.experts.1.gate_proj.weight_scale";
  rewrite(dir + "/model.safetensors", [&](auto& j) { j[name]["dtype"] = "U8"; }, no_data_edit);
  expect_error([&] { load_dir(dir, 1); }, {"model.safetensors", name, "dtype U8; expected F8_E4M3"}, d.str());

  ScratchDir d2;
  const std::string dir2 = test::copy_fixture(d2, kQwen);
  const std::string w = "model.layers.1.mlp.experts.6.down_proj.weight";
  // [128, 32] -> [64, 64]: same bytes, the wrong shape for down (N = H = 128, K/2 = 32)
  rewrite(dir2 + "/model.safetensors", [&](auto& j) { j[w]["shape"] = {64, 64}; }, no_data_edit);
  expect_error([&] { load_dir(dir2, 1); }, {"model.safetensors", w, "shape [64, 64]; expected [128, 32]"}, d2.str());
}

TEST(CheckpointBadFile, WrongGroupSize) {
  // a scale per 32 elements in the tensor itself
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, kQwen);
  const std::string name = "model.layers.1.mlp.experts.0.gate_proj.weight_scale";
  rewrite(dir + "/model.safetensors", [&](auto& j) {
    j[name]["shape"] = {64, 4};
    const uint64_t b = j[name]["data_offsets"][0].template get<uint64_t>();
    j[name]["data_offsets"] = {b, b + 256};
  }, no_data_edit);
  expect_error([&] { load_dir(dir, 1); }, {"model.safetensors", name, "group size of 32"}, d.str());
  // and in the quantization config
  ScratchDir d2;
  const std::string dir2 = test::copy_fixture(d2, kQwen);
  auto q = nlohmann::json::parse(test::read_file(dir2 + "/hf_quant_config.json"));
  q["quantization"]["group_size"] = 32;
  test::write_file(dir2 + "/hf_quant_config.json", q.dump());
  expect_error([&] { SafetensorsCheckpoint ck(dir2); inspect_checkpoint(ck); },
               {"hf_quant_config.json", "group_size = 32"}, d2.str());
  ScratchDir d3;
  const std::string dir3 = test::copy_fixture(d3, "llmcompressor-qwen3-moe-nvfp4");
  auto c = nlohmann::json::parse(test::read_file(dir3 + "/config.json"));
  c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 128;
  test::write_file(dir3 + "/config.json", c.dump());
  expect_error([&] { SafetensorsCheckpoint ck(dir3); inspect_checkpoint(ck); }, {"config.json", "group_size 128"});
}

// ModelOpt MIXED_PRECISION: the experts must be listed as NVFP4 / 16 in quantized_layers.
TEST(CheckpointBadFile, MixedPrecisionNeedsNvfp4Experts) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, kQwen);
  auto q = nlohmann::json::parse(test::read_file(dir + "/hf_quant_config.json"));
  q["quantization"]["quant_algo"] = "MIXED_PRECISION";
  q["quantization"].erase("group_size");
  nlohmann::json layers = nlohmann::json::object();
  for (int e = 0; e < 8; ++e)
    for (const char* p : {"gate_proj", "up_proj", "down_proj"})
      layers[fmt::format("model.layers.1.mlp.experts.{}.{}", e, p)] = {{"quant_algo", "NVFP4"}, {"group_size", 16}};
  layers["model.layers.0.mlp.down_proj"] = {{"quant_algo", "FP8"}};
  q["quantization"]["quantized_layers"] = layers;
  test::write_file(dir + "/hf_quant_config.json", q.dump());
  EXPECT_NO_THROW(load_dir(dir, 1));
  const std::string bad = "model.layers.1.mlp.experts.6.up_proj";
  q["quantization"]["quantized_layers"][bad] = {{"quant_algo", "FP8"}};
  test::write_file(dir + "/hf_quant_config.json", q.dump());
  expect_error([&] { load_dir(dir, 1); }, {"hf_quant_config.json", bad, "FP8/0"});
  q["quantization"]["quantized_layers"].erase(bad);
  test::write_file(dir + "/hf_quant_config.json", q.dump());
  expect_error([&] { load_dir(dir, 1); }, {"hf_quant_config.json", "does not list '" + bad + "'"});
}

TEST(CheckpointBadFile, UnknownFormat) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, "llmcompressor-qwen3-moe-nvfp4");
  auto c = nlohmann::json::parse(test::read_file(dir + "/config.json"));
  c["quantization_config"]["quant_method"] = "gptq";
  test::write_file(dir + "/config.json", c.dump());
  expect_error([&] { SafetensorsCheckpoint ck(dir); inspect_checkpoint(ck); }, {"config.json", "'gptq'"});
  c["quantization_config"]["quant_method"] = "compressed-tensors";
  c["quantization_config"]["format"] = "float-quantized";
  test::write_file(dir + "/config.json", c.dump());
  expect_error([&] { SafetensorsCheckpoint ck(dir); inspect_checkpoint(ck); }, {"config.json", "'float-quantized'"});
  c.erase("quantization_config");
  test::write_file(dir + "/config.json", c.dump());
  expect_error([&] { SafetensorsCheckpoint ck(dir); inspect_checkpoint(ck); }, {"config.json", "unquantized"});
  c["model_type"] = "llama";
  c["architectures"] = {"LlamaForCausalLM"};
  test::write_file(dir + "/config.json", c.dump());
  expect_error([&] { SafetensorsCheckpoint ck(dir); inspect_checkpoint(ck); }, {"config.json", "'llama'"});
}

TEST(CheckpointBadFile, NaNE8M0Scale) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, "gptoss-mxfp4");
  const std::string name = "model.layers.1.mlp.experts.down_proj_scales";  // [8, 128, 2]
  rewrite(dir + "/model.safetensors", [](auto&) {}, [&](const SafetensorsHeader& h, std::string& data) {
    data[h.find(name)->begin + (5 * 128 + 17) * 2 + 1] = static_cast<char>(0xff);
  });
  expect_error([&] { load_dir(dir, 1); }, {"model.safetensors", name, "expert 5, row 17, block 1", "NaN"}, d.str());
}

TEST(CheckpointBadFile, ShardProblems) {
  ScratchDir d;
  const std::string dir = test::copy_fixture(d, "modelopt-qwen3-moe-nvfp4-sharded");
  test::fs::remove(dir + "/model-00007-of-00009.safetensors");
  expect_error([&] { load_dir(dir, 1); }, {"model-00007-of-00009.safetensors", "missing"}, d.str());
  // the index places a tensor in a shard that does not hold it
  ScratchDir d2;
  const std::string dir2 = test::copy_fixture(d2, "modelopt-qwen3-moe-nvfp4-sharded");
  auto idx = nlohmann::json::parse(test::read_file(dir2 + "/model.safetensors.index.json"));
  const std::string name = "model.layers.1.mlp.experts.4.down_proj.weight";
  idx["weight_map"][name] = "model-00001-of-00009.safetensors";
  test::write_file(dir2 + "/model.safetensors.index.json", idx.dump());
  expect_error([&] { load_dir(dir2, 1); }, {"model-00001-of-00009.safetensors", name, "missing"}, d2.str());
  idx["weight_map"].erase(name);
  test::write_file(dir2 + "/model.safetensors.index.json", idx.dump());
  expect_error([&] { load_dir(dir2, 1); }, {"model.safetensors.index.json", name, "missing from the weight_map"});
}

TEST(CheckpointBadFile, LayerThatIsNotMoe) {
  expect_error([] { load_dir(test::fixture(kQwen), 0); }, {"layer 0 is not an MoE layer", "MoE layers: 1"});
  expect_error([] { load_dir(test::fixture(kQwen), 7); }, {"layer 7 is not an MoE layer"});
}

}  // namespace
}  // namespace fp4moe
