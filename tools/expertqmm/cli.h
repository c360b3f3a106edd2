// Subcommand registry of the CLI. Each cmd_<name>.cpp defines one `int run_<name>(argc, argv)`.
#pragma once
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "json_out.h"

#define EXPERTQMM_VERSION_STRING "0.1.0"

namespace expertqmm::cli {

struct Command {
  const char* name;
  const char* help;
  int (*run)(int argc, char** argv);
};
const std::vector<Command>& commands();

// A bad command line: main prints "expertqmm <command>: <what>" as one line and exits with 2.
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
[[noreturn]] void usage_error(const std::string& what);

// The --key value / --key=value / --flag parser shared by the subcommands (argv[0] is the
// subcommand). Every getter checks what it reads and throws UsageError naming the option and what
// it accepts: a number out of range is never clamped, wrapped or passed on to an allocation.
class Args {
 public:
  // Throws UsageError for a positional argument or an option given twice.
  Args(int argc, char** argv);
  bool has(const std::string& key) const;
  std::string get(const std::string& key, const std::string& fallback = "") const;
  // The value of an option that must be given, non-empty ("--out DIR is required").
  std::string get_required(const std::string& key, const char* value_name) const;
  // The value of an optional option, "" when absent; given, it must not be empty ("--json needs FILE").
  std::string get_optional(const std::string& key, const char* value_name) const;
  // An integer in [lo, hi]: "--key must be an integer in [lo, hi], got 'v'".
  int64_t get_int(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const;
  // Comma-separated integers, each in [lo, hi], at least one.
  std::vector<int64_t> get_int_list(const std::string& key, const std::vector<int64_t>& fallback, int64_t lo,
                                    int64_t hi) const;
  // One of `choices`: "--key expects a, b or c, got 'v'".
  std::string get_choice(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& choices) const;
  // A flag that takes no value (--force): "--force takes no value, got 'x'".
  bool get_flag(const std::string& key) const;
  // Throws UsageError if an option not in `known` (or --help) was given.
  void check_known(const std::vector<std::string>& known) const;

 private:
  std::vector<std::pair<std::string, std::string>> kv_;
};


// Stage messages on stderr ("generating weights ..."), so that a run of seconds is not silent.
struct Progress {
  bool on = true;
  void say(const char* what) const {
    if (!on) return;
    std::fprintf(stderr, "%s ...\n", what);
    std::fflush(stderr);
  }
};

}  // namespace expertqmm::cli
