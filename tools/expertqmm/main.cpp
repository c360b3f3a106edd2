// expertqmm command-line tool: one subcommand per file (cmd_*.cpp), dispatched here.
#include <cstdio>
#include <cstring>
#include <exception>

#include "cli.h"
#include "expertqmm/backend.h"
#include "expertqmm/error.h"
#include "expertqmm/settings.h"

namespace {

int cmd_info(int argc, char** argv) {
  const expertqmm::cli::Args args(argc, argv);
  if (args.has("help")) return std::printf("usage: expertqmm info\nPrints the build and the devices found.\n"), 0;
  args.check_known({});
  std::printf("expertqmm %s\n", EXPERTQMM_VERSION_STRING);
  std::printf("cuda backend built: %s\n", expertqmm::cuda_built() ? "yes" : "no");
  std::printf("cuda device: %s\n", expertqmm::cuda_available() ? expertqmm::cuda_device_name() : "none");
  std::printf("settings (environment variable, values, in force):\n");
  for (const expertqmm::SettingInfo& s : expertqmm::settings_table())  // throws on a bad value
    std::printf("  %-24s %-10s %-5s %s\n", s.variable.c_str(), s.values.c_str(), s.current.c_str(), s.what.c_str());
  return 0;
}

void usage() {
  std::fprintf(stderr,
               "usage: expertqmm <command> [options]\n"
               "commands:\n");
  for (const expertqmm::cli::Command& c : expertqmm::cli::commands())
    std::fprintf(stderr, "  %-8s %s\n", c.name, c.help);
  std::fprintf(stderr, "  %-8s %s\n", "info", "print the build and the devices found");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "-h") || !std::strcmp(argv[1], "--help")) {
    usage();
    return argc < 2 ? 2 : 0;
  }
  try {
    if (!std::strcmp(argv[1], "info")) return cmd_info(argc - 1, argv + 1);
    for (const expertqmm::cli::Command& c : expertqmm::cli::commands())
      if (!std::strcmp(argv[1], c.name)) return c.run(argc - 1, argv + 1);
  } catch (const expertqmm::cli::UsageError& e) {
    std::fprintf(stderr, "expertqmm %s: %s\n", argv[1], e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  std::fprintf(stderr, "unknown command '%s'\n", argv[1]);
  usage();
  return 2;
}
