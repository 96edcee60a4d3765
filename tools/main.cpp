// fp4moe: command-line front end. Subcommands register themselves (tools/cmd_*.cpp).
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include "commands.hpp"
#include "fp4moe/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"fp4moe: Mixture-of-Experts layers with NVFP4/MXFP4 expert weights"};
  app.require_subcommand(1);
  fp4moe::cli::register_info(app);
  fp4moe::cli::register_run(app);
  fp4moe::cli::register_bench(app);
  fp4moe::cli::register_explain(app);
  fp4moe::cli::register_tune(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const fp4moe::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fp4moe: %s\n", e.what());
    return 1;
  }
  return 0;
}
