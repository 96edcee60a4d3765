// MoeLayer::forward_routed's host-only checks and the wording of a bad-id record (no GPU needed).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "fp4moe/error.hpp"
#include "fp4moe/moe_layer.hpp"

namespace fp4moe {
namespace {

template <class T>
T* fake(uintptr_t slot) {
  return reinterpret_cast<T*>(0x10000 + slot * 0x100);
}

std::string error_of(auto&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

struct Args {
  const void* hidden = fake<void>(1);
  int64_t tokens = 4;
  const int32_t* ids = fake<int32_t>(2);
  const float* weights = fake<float>(3);
  void* out = fake<void>(4);
  void* workspace = fake<void>(5);
  size_t workspace_size = 4096;
};

std::string check(const Args& a, int64_t max_tokens = 16, size_t workspace_bytes = 4096) {
  return error_of([&] {
    validate_moe_routed_args(preset("tiny"), max_tokens, workspace_bytes, a.hidden, a.tokens, a.ids, a.weights, a.out,
                             a.workspace, a.workspace_size);
  });
}

TEST(MoeRoutedArgs, AcceptsValidArguments) {
  EXPECT_EQ(check(Args{}), "");
  Args a;
  a.tokens = 16;
  EXPECT_EQ(check(a), "");
  a.ids = reinterpret_cast<const int32_t*>(0x10004);  // 4-byte alignment is enough for ids and weights
  a.weights = reinterpret_cast<const float*>(0x10008);
  EXPECT_EQ(check(a), "");
}

TEST(MoeRoutedArgs, NamesTheArgumentAndTheRule) {
  Args a;
  a.tokens = 0;
  EXPECT_NE(check(a).find("tokens = 0 must be in [1, max_tokens = 16]"), std::string::npos) << check(a);
  a.tokens = 17;
  EXPECT_NE(check(a).find("tokens = 17"), std::string::npos);
  a = Args{};
  a.ids = nullptr;
  EXPECT_NE(check(a).find("topk_ids"), std::string::npos);
  EXPECT_NE(check(a).find("int32 [T, top_k = 2]"), std::string::npos) << check(a);
  a = Args{};
  a.ids = reinterpret_cast<const int32_t*>(0x10002);
  EXPECT_NE(check(a).find("topk_ids"), std::string::npos);
  a = Args{};
  a.weights = nullptr;
  EXPECT_NE(check(a).find("topk_weights"), std::string::npos);
  a = Args{};
  a.hidden = reinterpret_cast<const void*>(0x10008);
  EXPECT_NE(check(a).find("hidden"), std::string::npos);
  a = Args{};
  a.out = nullptr;
  EXPECT_NE(check(a).find("out = "), std::string::npos);
  a = Args{};
  a.workspace = reinterpret_cast<void*>(0x10004);
  EXPECT_NE(check(a).find("workspace"), std::string::npos);
  a = Args{};
  a.workspace_size = 4095;
  EXPECT_NE(check(a).find("workspace_size = 4095"), std::string::npos) << check(a);
}

TEST(MoeRoutedArgs, DescribesABadIdRecord) {
  EXPECT_EQ(describe_routing_error(0, 8, 256), "");
  // flat entry 13 with k = 8: token 1, slot 5
  const uint64_t rec = (uint64_t{13 + 1} << 32) | 300u;
  const std::string s = describe_routing_error(rec, 8, 256);
  EXPECT_NE(s.find("topk_ids[1, 5] = 300"), std::string::npos) << s;
  EXPECT_NE(s.find("num_experts = 256"), std::string::npos) << s;
  const uint64_t neg = (uint64_t{1} << 32) | static_cast<uint32_t>(-7);
  EXPECT_NE(describe_routing_error(neg, 2, 8).find("topk_ids[0, 0] = -7"), std::string::npos);
}

// moe_route with the CTA-per-token kernel forced where it does not apply (k > 8): refused before any
// launch, with the config's top_k and the rule (the GPU test checks both kernels agree where it applies).
TEST(MoeRoutedArgs, RoutingCtaPathRefusedWhereItDoesNotApply) {
  auto route = [](const MoeConfig& c) {
    return error_of([&] {
      moe_route(c, fake<float>(1), nullptr, 1, fake<int32_t>(2), fake<float>(3), nullptr, RoutingPath::kCtaPerToken);
    });
  };
  MoeConfig wide = preset("qwen3-30b");
  wide.top_k = 16;
  const std::string k16 = route(wide);
  EXPECT_NE(k16.find("top_k = 16"), std::string::npos) << k16;
  EXPECT_NE(k16.find("top_k <= 8"), std::string::npos) << k16;
  EXPECT_NE(k16.find("kCtaPerToken"), std::string::npos) << k16;
}

}  // namespace
}  // namespace fp4moe
