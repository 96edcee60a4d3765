// Architecture table. Sources of the figures (all per compute capability, not per product):
//  [PG]  CUDA C++ Programming Guide, appendix "Compute Capabilities", table "Technical Specifications
//        per Compute Capability": max threads per block (1024), max resident threads / blocks per SM,
//        32-bit registers per SM (64K) and per thread (255), shared memory per SM and the maximum per
//        block (opt-in). cc 8.0: 164 KB/SM, 163 KB/block; 8.6 and 8.9: 100 KB/SM, 99 KB/block;
//        9.0, 10.0, 10.3: 228 KB/SM, 227 KB/block; 12.0, 12.1: 100 KB/SM, 99 KB/block.
//        Resident threads per SM: 2048 (8.0, 9.0, 10.x), 1536 (8.6, 8.9, 12.x). Resident blocks per SM:
//        32 (8.0, 9.0, 10.x), 16 (8.6), 24 (8.9, 12.x; an RTX 5090 reports 24 and 102,400 B per SM).
//  [PG-SM] same guide, "Shared Memory" of cc 8.x/9.0: "the system reserves 1 KB of shared memory per
//        thread block", which is why the opt-in maximum is the per-SM size minus 1 KB.
//  [CUTLASS] cutlass/arch/arch.h (CUTLASS 3.8+/4.x): sm90_smem_capacity_bytes = 232448 (227 KB),
//        sm100_smem_capacity_bytes = 232448, sm120_smem_capacity_bytes = 101376 (99 KB).
//  [PTX] PTX ISA: wgmma.mma_async needs sm_90a; tcgen05.mma needs sm_100a/sm_103a (family 10x "a"/"f");
//        mma.sync with kind::mxf4nvf4 and block scales needs sm_120a/sm_121a.
//  [PG-REG] the guide's occupancy section / CUDA occupancy calculator: registers are allocated per warp
//        in units of 256 on cc 5.x and newer.
// num_sms of a table entry is a representative product (named in sms_source); the device overrides it.
#include "fp4moe/arch.hpp"

#include <algorithm>
#include <cctype>
#include <cuda_runtime.h>

#include "fp4moe/cuda_check.hpp"
#include "fp4moe/error.hpp"

namespace fp4moe {

namespace {

constexpr size_t KB = 1024;

ArchInfo make(const char* name, int major, int minor, size_t optin_kb, size_t per_sm_kb, int threads_sm,
              int ctas_sm, unsigned families, int sms, const char* sms_product) {
  ArchInfo a;
  a.name = name;
  a.cc_major = major;
  a.cc_minor = minor;
  a.smem_optin_per_block = optin_kb * KB;  // [PG], [CUTLASS]
  a.smem_per_sm = per_sm_kb * KB;          // [PG]
  a.reserved_smem_per_block = 1 * KB;      // [PG-SM]
  a.regs_per_thread_max = 255;             // [PG]
  a.regs_per_sm = 65536;                   // [PG]
  a.regs_per_block_max = 65536;            // [PG]
  a.reg_alloc_unit_per_warp = 256;         // [PG-REG]
  a.max_threads_per_block = 1024;          // [PG]
  a.max_threads_per_sm = threads_sm;       // [PG]
  a.max_ctas_per_sm = ctas_sm;             // [PG]
  a.mma_families = families;               // [PTX]
  a.num_sms = sms;
  a.sms_source = sms_product;
  return a;
}

}  // namespace

std::string ArchInfo::families_string() const {
  std::string s;
  auto add = [&](MmaFamily f, const char* n) {
    if (!has(f)) return;
    if (!s.empty()) s += ", ";
    s += n;
  };
  add(kMmaSync, "mma.sync");
  add(kWgmma, "wgmma");
  add(kTcgen05, "tcgen05");
  add(kMmaSyncBlockScaledFp4, "mma.sync block-scaled FP4 (mxf4nvf4)");
  return s;
}

const std::vector<ArchInfo>& arch_table() {
  static const std::vector<ArchInfo> table = {
      make("sm_80", 8, 0, 163, 164, 2048, 32, kMmaSync, 108, "A100 SXM"),
      make("sm_86", 8, 6, 99, 100, 1536, 16, kMmaSync, 84, "A40 / RTX A6000"),
      make("sm_89", 8, 9, 99, 100, 1536, 24, kMmaSync, 128, "RTX 4090"),
      make("sm_90", 9, 0, 227, 228, 2048, 32, kMmaSync | kWgmma, 132, "H100 / H200 SXM"),
      make("sm_100", 10, 0, 227, 228, 2048, 32, kMmaSync | kTcgen05, 148, "B200"),
      make("sm_103", 10, 3, 227, 228, 2048, 32, kMmaSync | kTcgen05, 148, "B300"),
      make("sm_120", 12, 0, 99, 100, 1536, 24, kMmaSync | kMmaSyncBlockScaledFp4, 188,
           "RTX PRO 6000 Blackwell"),
      make("sm_121", 12, 1, 99, 100, 1536, 24, kMmaSync | kMmaSyncBlockScaledFp4, 48, "DGX Spark (GB10)"),
  };
  return table;
}

ArchInfo arch_from_name(std::string_view name) {
  std::string s;
  for (char c : name)
    if (c != '_' && c != '.' && c != ' ') s += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* prefix : {"compute", "sm"})
    if (s.rfind(prefix, 0) == 0) s = s.substr(std::string(prefix).size());
  while (!s.empty() && (s.back() == 'a' || s.back() == 'f')) s.pop_back();  // sm_90a, sm_100f
  for (const ArchInfo& a : arch_table())
    if (s == std::to_string(a.cc())) return a;
  std::string known;
  for (const ArchInfo& a : arch_table()) known += (known.empty() ? "" : ", ") + a.name;
  FP4MOE_FAIL("architecture '{}' is not in the table (known: {}; forms: sm_90, 90, sm90a, 9.0)", name, known);
}

ArchInfo arch_from_device(int device) {
  cudaDeviceProp p{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, device));
  const int cc = p.major * 10 + p.minor;
  // Table entry: exact cc, else the highest lower one of the same major version, else the highest lower.
  const ArchInfo* base = nullptr;
  for (const ArchInfo& a : arch_table())
    if (a.cc() <= cc && (base == nullptr || a.cc() > base->cc())) base = &a;
  ArchInfo a = base != nullptr ? *base : arch_table().front();
  a.name = "sm_" + std::to_string(cc);
  a.cc_major = p.major;
  a.cc_minor = p.minor;
  a.smem_optin_per_block = p.sharedMemPerBlockOptin;
  a.smem_per_sm = p.sharedMemPerMultiprocessor;
  a.reserved_smem_per_block = p.reservedSharedMemPerBlock;
  a.regs_per_sm = p.regsPerMultiprocessor;
  a.regs_per_block_max = p.regsPerBlock;
  a.max_threads_per_block = p.maxThreadsPerBlock;
  a.max_threads_per_sm = p.maxThreadsPerMultiProcessor;
  a.max_ctas_per_sm = p.maxBlocksPerMultiProcessor;
  a.num_sms = p.multiProcessorCount;
  a.sms_source = "device";
  a.from_device = true;
  a.device_name = p.name;
  return a;
}

ArchInfo default_arch() {
  if (gpu_available()) return arch_from_device(0);
  return arch_from_name("sm_90");
}

}  // namespace fp4moe
