// `fp4moe info`: the CUDA GPUs found and the limits that decide which kernels fit. Exit code 0 when a
// GPU is present, 1 otherwise (scripts/run.sh picks the GPU benchmark or the CPU reference by it).
#include <cstdio>

#include <cuda_runtime.h>
#include <fmt/format.h>

#include "checkpoint_cli.hpp"
#include "commands.hpp"
#include "fp4moe/cuda_check.hpp"

namespace fp4moe::cli {

namespace {

std::string cuda_version(int v) { return v > 0 ? fmt::format("{}.{}", v / 1000, (v % 1000) / 10) : "none"; }

void print_device(int dev) {
  cudaDeviceProp p{};
  FP4MOE_CUDA_CHECK(cudaGetDeviceProperties(&p, dev));
  // CUDA 13 dropped the clock fields from cudaDeviceProp; the attributes remain.
  int mem_clock_khz = 0;
  FP4MOE_CUDA_CHECK(cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, dev));
  // DDR: two transfers per clock.
  const double peak_gbs = 2.0 * mem_clock_khz * 1e3 * (p.memoryBusWidth / 8.0) / 1e9;
  fmt::print("GPU {}: {}\n", dev, p.name);
  fmt::print("  compute capability         {}.{} (sm_{}{})\n", p.major, p.minor, p.major, p.minor);
  fmt::print("  SMs                        {}\n", p.multiProcessorCount);
  fmt::print("  shared memory per block    {} bytes opt-in ({} default)\n", p.sharedMemPerBlockOptin,
             p.sharedMemPerBlock);
  fmt::print("  shared memory per SM       {} bytes\n", p.sharedMemPerMultiprocessor);
  fmt::print("  registers per SM           {} (per block {})\n", p.regsPerMultiprocessor, p.regsPerBlock);
  fmt::print("  L2 cache                   {:.1f} MiB\n", p.l2CacheSize / 1048576.0);
  fmt::print("  memory                     {:.1f} GiB\n", static_cast<double>(p.totalGlobalMem) / (1ull << 30));
  fmt::print("  memory clock / bus width   {} MHz / {} bits (theoretical {:.0f} GB/s)\n", mem_clock_khz / 1000,
             p.memoryBusWidth, peak_gbs);
}

void run_info(bool quiet) {
  if (!gpu_available()) {
    if (!quiet) fmt::print("no CUDA GPU found\n");
    throw CLI::RuntimeError(1);
  }
  if (quiet) return;
  int n = 0, driver = 0, runtime = 0;
  FP4MOE_CUDA_CHECK(cudaGetDeviceCount(&n));
  FP4MOE_CUDA_CHECK(cudaDriverGetVersion(&driver));
  FP4MOE_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  fmt::print("CUDA driver {}, runtime {}, {} GPU{}\n", cuda_version(driver), cuda_version(runtime), n,
             n == 1 ? "" : "s");
  for (int d = 0; d < n; ++d) print_device(d);
}

}  // namespace

void register_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Show the CUDA GPU(s) and their limits; exit code 1 without a GPU. With "
                                         "--checkpoint: the checkpoint's format, MoE layers and shapes (no GPU needed)");
  auto quiet = std::make_shared<bool>(false);
  auto checkpoint = std::make_shared<std::string>();
  cmd->add_flag("-q,--quiet", *quiet, "Print nothing; only the exit code tells whether a GPU is present");
  cmd->add_option("--checkpoint", *checkpoint, "A checkpoint directory (config.json + safetensors)");
  cmd->callback([quiet, checkpoint] {
    if (!checkpoint->empty()) return print_checkpoint_info(*checkpoint);
    run_info(*quiet);
  });
}

}  // namespace fp4moe::cli
