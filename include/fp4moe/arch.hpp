// GPU architecture limits that decide whether a kernel configuration can launch: shared memory per
// block and per SM, registers, threads, CTAs per SM, and the matrix-instruction families. A table of
// vendor-documented figures (src/arch.cpp cites each) that the present GPU's own properties override.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace fp4moe {

// Matrix-instruction families (bit set).
enum MmaFamily : unsigned {
  kMmaSync = 1u << 0,                // mma.sync (sm_80+): bf16/fp16/int8 m16n8k16 ...
  kWgmma = 1u << 1,                  // wgmma.mma_async: sm_90a only
  kTcgen05 = 1u << 2,                // tcgen05.mma (tensor memory): sm_100a / sm_103a
  kMmaSyncBlockScaledFp4 = 1u << 3,  // mma.sync ... kind::mxf4nvf4.block_scale: sm_120a / sm_121a
};

struct ArchInfo {
  std::string name;                    // "sm_90"
  int cc_major = 0;
  int cc_minor = 0;
  size_t smem_optin_per_block = 0;     // bytes a block may use after cudaFuncSetAttribute (dynamic + static)
  size_t smem_per_sm = 0;              // bytes of shared memory per SM (the carveout maximum)
  size_t reserved_smem_per_block = 0;  // bytes the system reserves per resident block (counts per SM)
  int regs_per_thread_max = 255;
  int regs_per_sm = 65536;
  int regs_per_block_max = 65536;
  int reg_alloc_unit_per_warp = 256;   // registers are allocated per warp in units of 256
  int max_threads_per_block = 1024;
  int max_threads_per_sm = 0;
  int max_ctas_per_sm = 0;
  unsigned mma_families = 0;
  int num_sms = 0;                     // from the device; for a table entry: a representative product
  std::string sms_source;              // which product num_sms describes, or "device"
  bool from_device = false;
  std::string device_name;             // the GPU's name when from_device

  int cc() const { return cc_major * 10 + cc_minor; }
  bool has(MmaFamily f) const { return (mma_families & f) != 0; }
  std::string families_string() const;  // "mma.sync, wgmma"
};

// The table: sm_80, 86, 89, 90, 100, 103, 120, 121.
const std::vector<ArchInfo>& arch_table();

// "sm_90", "90", "sm90a", "sm_90a", "9.0", "compute_90" ... Throws fp4moe::Error naming the known ones.
ArchInfo arch_from_name(std::string_view name);

// The table entry of the device's compute capability (or the nearest lower one of the same major
// version), with every figure the device reports (cudaDeviceProp) overriding the table's.
ArchInfo arch_from_device(int device);

// The present GPU (device 0) when there is one, else sm_90.
ArchInfo default_arch();

}  // namespace fp4moe
