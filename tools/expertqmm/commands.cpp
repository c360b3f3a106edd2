#include "cli.h"

namespace expertqmm::cli {

int run_run(int argc, char** argv);
int run_bench(int argc, char** argv);
int run_diag(int argc, char** argv);
int run_write_checkpoint(int argc, char** argv);

const std::vector<Command>& commands() {
  static const std::vector<Command> cmds = {
      {"run", "run the MoE layer of a preset on a backend and check it against the reference", run_run},
      {"bench", "time the MoE layer per the benchmark protocol (CUDA)", run_bench},
      {"diag", "print the route selector's counters after a run", run_diag},
      {"write-checkpoint", "write a synthetic Gemma 4 checkpoint in mlx-lm's format", run_write_checkpoint},
  };
  return cmds;
}

}  // namespace expertqmm::cli
