// Proof, against CUTLASS itself, of the arithmetic `fp4moe explain --kernel cutlass-sm120-nvfp4-grouped`
// prints. The sm_120 block-scaled NVFP4 grouped GEMM is instantiated from the pinned CUTLASS 4.2.0
// headers (scripts/setup.sh installs nvidia-cutlass==4.2.0.0) the way TensorRT-LLM's MoE launcher
// builds it: ArchTag Sm120, OpClassBlockScaledTensorOp, nv_float4_t<float_e2m1_t> A and B (TN, 32-element
// alignment, pointer layouts = grouped), GroupProblemShape, 1x1x1 cluster, KernelScheduleAuto (which
// is the cooperative ptr-array schedule) or an explicit pingpong/cooperative schedule, a TMA
// warp-specialized epilogue with ElementC = ElementD = bf16 in column-major layout, and
// StageCountAutoCarveout<sizeof(CollectiveEpilogue::SharedStorage)> or an explicit StageCount<S>.
//
// Only host-side types are used (sizeof, the builder's constexpr stage count): nothing is launched and
// no GPU is needed. Compile time: static_asserts; run time: the planner's plan (what explain prints).
#include <gtest/gtest.h>

#include <cstddef>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "fp4moe/cutlass_sm120_model.hpp"
#include "fp4moe/planner.hpp"

namespace {

namespace cm = fp4moe::cutlass_sm120;
using cute::Int;
using cute::Shape;

using Auto = cutlass::gemm::collective::KernelScheduleAuto;
using Pingpong = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using Cooperative = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using ColMajor = cutlass::layout::ColumnMajor;
using RowMajor = cutlass::layout::RowMajor;
using Bf16 = cutlass::bfloat16_t;

// Stages = 0: StageCountAutoCarveout<sizeof(epilogue SharedStorage)>, as TensorRT-LLM passes it.
template <int M, int N, int K, class Schedule, int Stages, class ElementC = Bf16, class LayoutCD = ColMajor>
struct Sm120Nvfp4Grouped {
  using Tile = Shape<Int<M>, Int<N>, Int<K>>;
  using Cluster = Shape<cute::_1, cute::_1, cute::_1>;
  using Element = cutlass::nv_float4_t<cutlass::float_e2m1_t>;
  static constexpr int kAlignAB = 128 / cutlass::sizeof_bits<cutlass::float_e2m1_t>::value;  // 32
  static constexpr int kAlignC = 32;  // TensorRT-LLM: 128 bits of its (FP4) activation type
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<Bf16>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutCD*,
      std::is_void_v<ElementC> ? kAlignD : kAlignC, Bf16, LayoutCD*, kAlignD,
      cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;
  using StageCount = std::conditional_t<
      Stages == 0,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::collective::StageCount<Stages>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm120, cutlass::arch::OpClassBlockScaledTensorOp, Element, RowMajor*, kAlignAB, Element,
      ColMajor*, kAlignAB, float, Tile, Cluster, StageCount, Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<
      cutlass::gemm::GroupProblemShape<Shape<int64_t, int64_t, int64_t>>, Mainloop, Epilogue, void, void>;

  static constexpr fp4moe::CutlassTile kTile{M, N, K};
  static constexpr fp4moe::CutlassSchedule kSchedule =
      std::is_same_v<Schedule, Pingpong> ? fp4moe::CutlassSchedule::kPingpong : fp4moe::CutlassSchedule::kCooperative;
  static constexpr fp4moe::CutlassEpilogueSpec spec() {
    fp4moe::CutlassEpilogueSpec e;
    e.has_c = !std::is_void_v<ElementC>;
    e.column_major = std::is_same_v<LayoutCD, ColMajor>;
    return e;
  }
  static constexpr fp4moe::CutlassEpilogueLayout kEpi = cm::epilogue(kTile, spec());
  static constexpr int kStages = Stages == 0 ? cm::auto_stages(kTile, kEpi.shared_storage) : Stages;
  static constexpr fp4moe::CutlassMainloopLayout kMain = cm::mainloop(kTile, kStages);
  static constexpr fp4moe::CutlassKernelLayout kKernel = cm::kernel(kTile, kStages, kEpi, kSchedule);

  // What CUTLASS itself says, for the run-time test's messages.
  static constexpr int kCutlassStages = Mainloop::DispatchPolicy::Stages;
  static constexpr size_t kCutlassKernelBytes = sizeof(typename Kernel::SharedStorage);
  static constexpr size_t kCutlassEpilogueBytes = sizeof(typename Epilogue::SharedStorage);

  static_assert(kCutlassStages == kStages,
                "the builder's stage count differs from cutlass_sm120::auto_stages: fix the model's per-stage "
                "bytes or carveout");
  static_assert(sizeof(typename Epilogue::TensorStorage) == kEpi.tensor_bytes,
                "epilogue TensorStorage differs from cutlass_sm120::epilogue (tile, stages, swizzle alignment)");
  static_assert(sizeof(typename Epilogue::PipelineStorage) == kEpi.pipeline_bytes,
                "epilogue PipelineStorage differs from the model (16 B per C stage)");
  static_assert(kCutlassEpilogueBytes == kEpi.shared_storage,
                "sizeof(CollectiveEpilogue::SharedStorage), TensorRT-LLM's carveout, differs from the model");
  static_assert(sizeof(typename Mainloop::TensorStorage) == kMain.tensor_bytes,
                "mainloop TensorStorage (A, B aligned to 1024; SFA, SFB) differs from cutlass_sm120::mainloop");
  static_assert(sizeof(typename Mainloop::PipelineStorage) == kMain.pipeline_bytes,
                "mainloop PipelineStorage differs from the model (16 B per stage)");
  static_assert(sizeof(typename Kernel::SharedStorage::TensorStorage) == kKernel.tensors,
                "kernel TensorStorage {mainloop; epilogue} differs from cutlass_sm120::kernel");
  static_assert(sizeof(typename Kernel::SharedStorage::PipelineStorage) == kKernel.pipelines,
                "kernel PipelineStorage (scheduler, mainloop, epilogue load, order barriers) differs from the model");
  static_assert(sizeof(typename Kernel::TileSchedulerResponse) * 8 == kKernel.responses,
                "scheduler responses differ from the model (8 x 16 B)");
  static_assert(sizeof(typename Kernel::SharedStorage::TensorMapStorage) == kKernel.tensormaps,
                "kernel TensorMapStorage differs from the model (4 mainloop + 3 epilogue descriptors)");
  static_assert(kCutlassKernelBytes == kKernel.footprint,
                "sizeof(GemmKernel::SharedStorage), the kernel's dynamic shared memory, differs from the model");
  static_assert(static_cast<size_t>(Kernel::SharedStorageSize) == kCutlassKernelBytes);
};

// The four tiles users ask for, with the automatic count (as TensorRT-LLM builds them) ...
using T128x128x128 = Sm120Nvfp4Grouped<128, 128, 128, Auto, 0>;
using T128x128x256 = Sm120Nvfp4Grouped<128, 128, 256, Auto, 0>;
using T128x256x128 = Sm120Nvfp4Grouped<128, 256, 128, Auto, 0>;
using T256x128x128 = Sm120Nvfp4Grouped<256, 128, 128, Auto, 0>;
// ... with explicit counts, including ones that do not fit (the type exists; the launch would fail) ...
using T128x128x128s2 = Sm120Nvfp4Grouped<128, 128, 128, Auto, 2>;
using T128x128x128s5 = Sm120Nvfp4Grouped<128, 128, 128, Auto, 5>;
using T128x128x256s3 = Sm120Nvfp4Grouped<128, 128, 256, Auto, 3>;
using T128x256x128s2 = Sm120Nvfp4Grouped<128, 256, 128, Auto, 2>;
using T128x256x128s4 = Sm120Nvfp4Grouped<128, 256, 128, Auto, 4>;
using T256x128x128s2 = Sm120Nvfp4Grouped<256, 128, 128, Cooperative, 2>;
// ... with the explicit schedules, and with the other epilogue variants the model covers.
using T128x128x128pp = Sm120Nvfp4Grouped<128, 128, 128, Pingpong, 0>;
using T128x256x128pp = Sm120Nvfp4Grouped<128, 256, 128, Pingpong, 0>;
using T128x256x128co = Sm120Nvfp4Grouped<128, 256, 128, Cooperative, 0>;
using T128x256x128noC = Sm120Nvfp4Grouped<128, 256, 128, Auto, 0, void>;
using T128x128x128row = Sm120Nvfp4Grouped<128, 128, 128, Auto, 0, Bf16, RowMajor>;
using T256x128x128rowNoC = Sm120Nvfp4Grouped<256, 128, 128, Auto, 0, void, RowMajor>;

// The planner's plan (what explain prints) against CUTLASS's own numbers.
template <class G>
void expect_plan_matches(int stages_override) {
  fp4moe::CutlassSm120Options o;
  o.stages = stages_override;
  o.schedule = G::kSchedule;
  o.epilogue = G::spec();
  const fp4moe::CutlassSm120Plan p = fp4moe::plan_cutlass_sm120(G::kTile, o);
  SCOPED_TRACE(testing::Message() << G::kTile.m << "x" << G::kTile.n << "x" << G::kTile.k << " stages "
                                  << stages_override);
  EXPECT_EQ(p.carveout, G::kCutlassEpilogueBytes);
  EXPECT_EQ(p.stages, G::kCutlassStages);
  if (stages_override == 0) {
    EXPECT_EQ(p.auto_stages, G::kCutlassStages);
  }
  EXPECT_EQ(p.epilogue.shared_storage, G::kCutlassEpilogueBytes);
  EXPECT_EQ(p.kernel.footprint, G::kCutlassKernelBytes);
  EXPECT_EQ(p.over_by, static_cast<int64_t>(G::kCutlassKernelBytes) - static_cast<int64_t>(fp4moe::kCutlassSm120SmemCapacity));
  EXPECT_EQ(p.verdict.valid, G::kCutlassKernelBytes <= fp4moe::kCutlassSm120SmemCapacity && G::kCutlassStages >= 2);
}

TEST(CutlassSm120Proof, PlannerEqualsCutlassForTheFourTiles) {
  expect_plan_matches<T128x128x128>(0);
  expect_plan_matches<T128x128x256>(0);
  expect_plan_matches<T128x256x128>(0);
  expect_plan_matches<T256x128x128>(0);
}

TEST(CutlassSm120Proof, PlannerEqualsCutlassForExplicitStageCounts) {
  expect_plan_matches<T128x128x128s2>(2);
  expect_plan_matches<T128x128x128s5>(5);
  expect_plan_matches<T128x128x256s3>(3);
  expect_plan_matches<T128x256x128s2>(2);
  expect_plan_matches<T128x256x128s4>(4);
  expect_plan_matches<T256x128x128s2>(2);
}

TEST(CutlassSm120Proof, PlannerEqualsCutlassForSchedulesAndEpilogues) {
  expect_plan_matches<T128x128x128pp>(0);
  expect_plan_matches<T128x256x128pp>(0);
  expect_plan_matches<T128x256x128co>(0);
  expect_plan_matches<T128x256x128noC>(0);
  expect_plan_matches<T128x128x128row>(0);
  expect_plan_matches<T256x128x128rowNoC>(0);
}

// The facts explain reports for the four tiles, pinned: with TensorRT-LLM's carveout every automatic
// count fits sm_120's 101,376 bytes, and it is already the largest count that fits.
TEST(CutlassSm120Proof, AutomaticCountsFitAndAreTheLargest) {
  EXPECT_EQ(T128x128x128::kCutlassStages, 4);
  EXPECT_EQ(T128x128x256::kCutlassStages, 2);
  EXPECT_EQ(T128x256x128::kCutlassStages, 3);
  EXPECT_EQ(T256x128x128::kCutlassStages, 3);
  EXPECT_EQ(T128x256x128::kCutlassKernelBytes, 98304u);
  EXPECT_GT(T128x256x128s4::kCutlassKernelBytes, fp4moe::kCutlassSm120SmemCapacity);
  EXPECT_GT(T128x128x128s5::kCutlassKernelBytes, fp4moe::kCutlassSm120SmemCapacity);
  for (const fp4moe::CutlassTile t : {T128x128x128::kTile, T128x128x256::kTile, T128x256x128::kTile, T256x128x128::kTile}) {
    const fp4moe::CutlassSm120Plan p = fp4moe::plan_cutlass_sm120(t);
    EXPECT_TRUE(p.verdict.valid) << p.verdict.reason;
    EXPECT_EQ(p.max_stages_that_fit, p.stages);
  }
}

}  // namespace
