#include "commands.hpp"

namespace fp4moe::cli {
// Not implemented yet: registers nothing, so it does not appear in --help.
void register_info(CLI::App&) {}
}  // namespace fp4moe::cli
