// Each subcommand of the `fp4moe` tool lives in its own file and adds itself to the app.
#pragma once
#include <CLI/CLI.hpp>

namespace fp4moe::cli {
void register_info(CLI::App& app);     // cmd_info.cpp
void register_run(CLI::App& app);      // cmd_run.cpp
void register_bench(CLI::App& app);    // cmd_bench.cpp
void register_explain(CLI::App& app);  // cmd_explain.cpp
void register_tune(CLI::App& app);     // cmd_tune.cpp
}  // namespace fp4moe::cli
