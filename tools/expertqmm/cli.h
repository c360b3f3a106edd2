// Subcommand registry of the CLI. Each cmd_<name>.cpp defines one `int run_<name>(argc, argv)`.
#pragma once
#include <string>
#include <vector>

#define EXPERTQMM_VERSION_STRING "0.1.0"

namespace expertqmm::cli {

struct Command {
  const char* name;
  const char* help;
  int (*run)(int argc, char** argv);
};
const std::vector<Command>& commands();

// Minimal --key value / --flag parser shared by the subcommands.
class Args {
 public:
  Args(int argc, char** argv);
  bool has(const std::string& key) const;
  std::string get(const std::string& key, const std::string& fallback = "") const;
  long get_int(const std::string& key, long fallback) const;
  std::vector<long> get_int_list(const std::string& key, const std::vector<long>& fallback) const;
  // Throws if an option not in `known` was given.
  void check_known(const std::vector<std::string>& known) const;

 private:
  std::vector<std::pair<std::string, std::string>> kv_;
};

}  // namespace expertqmm::cli
