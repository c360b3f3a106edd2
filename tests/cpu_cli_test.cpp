// Runs the built `expertqmm` CLI (build/expertqmm, next to build/tests/) as a user would.
// EXPERTQMM_CLI overrides where the binary is looked for.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "core/settings.h"
#include "expertqmm/backend.h"
#include "expertqmm/checkpoint.h"

namespace {

std::string cli_path() {
  if (const auto env = expertqmm::detail::environment_variable("EXPERTQMM_CLI"))
    if (!env->empty()) return *env;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "expertqmm";
  std::string dir(self, size_t(n));
  dir = dir.substr(0, dir.rfind('/'));  // build/tests
  dir = dir.substr(0, dir.rfind('/'));  // build
  return dir + "/expertqmm";
}

struct Result {
  int exit_code = -1;
  std::string output;  // stdout and stderr together
};

// Runs a shell command line: its stdout and exit code.
Result run_shell(const std::string& cmd) {
  Result r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, got);
  const int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// env: NAME=VALUE assignments for the child only (e.g. "EXPERTQMM_EXPERT_TILES=2"), or "".
Result run_cli(const std::string& args, const std::string& env = "") {
  return run_shell((env.empty() ? "" : "env " + env + " ") + "'" + cli_path() + "' " + args + " 2>&1");
}

// stdout and stderr apart (stderr through a temporary file).
struct Streams {
  int exit_code = -1;
  std::string out, err;
};

Streams run_cli_streams(const std::string& args) {
  char tmpl[] = "/tmp/expertqmm_cli_err_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd >= 0) close(fd);
  const Result r = run_shell("'" + cli_path() + "' " + args + " 2>'" + tmpl + "'");
  Streams s;
  s.exit_code = r.exit_code;
  s.out = r.output;
  std::ifstream f(tmpl);
  std::stringstream e;
  e << f.rdbuf();
  s.err = e.str();
  std::remove(tmpl);
  return s;
}

int count_of(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size())) ++n;
  return n;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The value column of a `run` table row ("name   value").
std::string field(const std::string& out, const std::string& name) {
  size_t at = 0;
  while ((at = out.find(name, at)) != std::string::npos) {
    const bool line_start = at == 0 || out[at - 1] == '\n';
    const size_t after = at + name.size();
    if (line_start && after < out.size() && out[after] == ' ') {
      size_t v = out.find_first_not_of(' ', after);
      return out.substr(v, out.find('\n', v) - v);
    }
    at = after;
  }
  return "";
}

class Cli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(access(cli_path().c_str(), X_OK), 0)
        << "the CLI is not built at " << cli_path() << " (build the expertqmm_cli target, or set EXPERTQMM_CLI)";
  }
};

// A fresh directory /tmp/expertqmm_cli_<tag>_XXXXXX for one test, removed with everything in it when
// the test leaves its scope (an ASSERT's early return included). path is empty if mkdtemp failed.
class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    std::string name = "/tmp/expertqmm_cli_" + tag + "_XXXXXX";
    if (mkdtemp(name.data()) != nullptr) path = name;
  }
  ~TempDir() {
    if (!path.empty()) std::system(("rm -rf '" + path + "'").c_str());
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string path;
};

TEST_F(Cli, TinyThreeTokensPassOnCpu) {
  Result r = run_cli("run --preset tiny --tokens 3 --backend cpu");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(field(r.output, "status"), "PASS") << r.output;
  EXPECT_EQ(field(r.output, "tokens"), "3") << r.output;
  EXPECT_EQ(field(r.output, "assignments"), "6") << r.output;  // top-2
  EXPECT_EQ(field(r.output, "backend"), "cpu") << r.output;
  EXPECT_EQ(field(r.output, "checked tokens"), "3") << r.output;
  const double err = std::atof(field(r.output, "rel error").c_str());
  EXPECT_GT(err, 0.0) << "bf16 rounding makes an exact match implausible: " << r.output;
  EXPECT_LE(err, 1e-2) << r.output;
}

// 40 tokens x top-2 = 80 assignments >= 64: the sorted SwitchGLU path.
TEST_F(Cli, TinyFortyTokensPassOnCpu) {
  Result r = run_cli("run --preset tiny --tokens 40 --backend cpu --check-tokens 40");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(field(r.output, "status"), "PASS") << r.output;
  EXPECT_EQ(field(r.output, "assignments"), "80") << r.output;
  EXPECT_EQ(field(r.output, "checked tokens"), "40") << r.output;
}

TEST_F(Cli, FusedGateUpAndZipfRoutingPassOnCpu) {
  Result fused = run_cli("run --preset tiny-fused --tokens 40 --backend cpu --seed 7");
  EXPECT_EQ(fused.exit_code, 0) << fused.output;
  EXPECT_EQ(field(fused.output, "status"), "PASS") << fused.output;
  Result zipf = run_cli("run --preset tiny --tokens 40 --backend cpu --routing zipf");
  EXPECT_EQ(zipf.exit_code, 0) << zipf.output;
  EXPECT_EQ(field(zipf.output, "status"), "PASS") << zipf.output;
  EXPECT_NE(field(zipf.output, "routing").find("zipf"), std::string::npos) << zipf.output;
}

// --tiled: the experts' tile layout made at load, on CUDA, where the wgmma expert kernels read it;
// the CPU backend accepts the flag and reads MLX's layout.
TEST_F(Cli, TiledExpertsPass) {
  Result cpu = run_cli("run --preset tiny --tokens 40 --backend cpu --check-tokens 40 --tiled");
  EXPECT_EQ(cpu.exit_code, 0) << cpu.output;
  EXPECT_EQ(field(cpu.output, "status"), "PASS") << cpu.output;
  if (!expertqmm::cuda_available()) GTEST_SKIP() << "SKIP: no CUDA device";
  Result gpu = run_cli("run --preset gemma4-26b-a4b --tokens 512 --backend cuda --check-tokens 8 --tiled");
  EXPECT_EQ(gpu.exit_code, 0) << gpu.output;
  EXPECT_EQ(field(gpu.output, "status"), "PASS") << gpu.output;
}

// Qwen3-MoE's router kind and SwiGLU experts through the same CLI: both SwitchGLU paths and Zipf
// routing (which steers a softmax_topk router) pass against the float64 reference.
TEST_F(Cli, Qwen3TinyPassesOnCpu) {
  for (const char* cmd : {"run --preset qwen3-tiny --tokens 3 --backend cpu",
                          "run --preset qwen3-tiny --tokens 40 --backend cpu --check-tokens 40",
                          "run --preset qwen3-tiny --tokens 40 --backend cpu --routing zipf"}) {
    Result r = run_cli(cmd);
    EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
    EXPECT_EQ(field(r.output, "status"), "PASS") << cmd << "\n" << r.output;
    EXPECT_EQ(field(r.output, "preset"), "qwen3-tiny") << r.output;
  }
}

// write-checkpoint --preset qwen3-tiny: mlx-lm's qwen3_moe names, read back as a Qwen3 checkpoint.
TEST_F(Cli, WriteCheckpointQwen3TinyReadsBackAsQwen3) {
  const TempDir tmp("qwen3");
  ASSERT_FALSE(tmp.path.empty());
  const std::string& dir = tmp.path;
  Result r = run_cli("write-checkpoint --preset qwen3-tiny --out " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const expertqmm::Gemma4Checkpoint ck = expertqmm::Gemma4Checkpoint::open(dir);
  EXPECT_EQ(ck.family(), expertqmm::ModelFamily::qwen3_moe);
  EXPECT_EQ(ck.num_layers(), 2);
  EXPECT_NE(read_file(dir + "/config.json").find("\"model_type\": \"qwen3_moe\""), std::string::npos);
  const expertqmm::Qwen3MoeFfnWeights w = ck.qwen3_moe_layer(1);
  EXPECT_EQ(w.moe.experts.gate.w.shape(), (expertqmm::Shape{8, 64, 128 * 4 / 32}));
}

TEST_F(Cli, SameSeedSameResultOtherSeedOtherResult) {
  const std::string a = field(run_cli("run --preset tiny --tokens 5 --backend cpu --seed 3").output, "rel error");
  const std::string b = field(run_cli("run --preset tiny --tokens 5 --backend cpu --seed 3").output, "rel error");
  const std::string c = field(run_cli("run --preset tiny --tokens 5 --backend cpu --seed 4").output, "rel error");
  EXPECT_FALSE(a.empty());
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST_F(Cli, UnknownPresetIsAnError) {
  Result r = run_cli("run --preset nope --tokens 3");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("unknown preset 'nope'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("gemma4-26b-a4b"), std::string::npos) << "the error lists the known presets: " << r.output;
}

// A bad command line gives exit code 2 and one line naming the option and what it accepts: numbers
// out of range were a std::bad_alloc, a "cannot create std::vector larger than max_size()", or
// clamped (--seed 2^64 became LONG_MAX); unknown options were accepted by some commands.
TEST_F(Cli, BadOptionsGiveOneLineAndExitCode2) {
  struct Case {
    const char* args;
    const char* message;
  };
  const Case cases[] = {
      {"run --preset tiny --tokens 0 --backend cpu", "--tokens must be an integer in [1, 65536], got '0'"},
      {"run --preset tiny --backend cpu", "--tokens N is required"},
      {"run --preset tiny --tokens 3 --backend tpu", "--backend expects auto, cpu or cuda"},
      {"run --preset tiny --tokens 3 --backend cpu --routing skewed", "--routing expects uniform or zipf"},
      {"run --preset tiny --tokens 3 --backend cpu --check-tokens 4", "--check-tokens must be an integer in [1, 3]"},
      {"run --preset tiny --tokens 3 --backend cpu --frobnicate 1", "unknown option --frobnicate"},
      {"bench --preset tiny --product neither", "--product expects fused, separate or both"},
      {"bench --preset tiny --tokens 1,0", "--tokens: every value must be an integer in [1, 65536], got '0'"},
      {"run --preset tiny --tokens 10000000000 --backend cpu", "expertqmm run: --tokens must be an integer in [1, 65536], got '10000000000'"},
      {"run --preset tiny --tokens 3 --backend cpu --seed 18446744073709551616",
       "--seed must be an integer in [0, 9223372036854775807], got '18446744073709551616'"},
      {"run --preset tiny --tokens 3 --backend cpu --seed -1", "--seed must be an integer in [0, "},
      {"run --preset tiny --tokens 3 --backend cpu --check-tokens 4611686018427387904", "--check-tokens must be an integer in [1, 3]"},
      {"run --preset tiny --tokens 3x --backend cpu", "--tokens must be an integer in [1, 65536], got '3x'"},
      {"run --preset tiny --tokens 3 --tokens 4 --backend cpu", "--tokens is given twice"},
      {"run --preset tiny 3", "unexpected argument '3'"},
      {"run --preset nope --tokens 3", "--preset: unknown preset 'nope'"},
      {"diag --preset tiny --tokens 4611686018427387904", "expertqmm diag: --tokens must be an integer in [1, 65536]"},
      {"diag --preset tiny --bogus", "expertqmm diag: unknown option --bogus"},
      {"bench --preset tiny --tokens 1,99999999999999999999", "--tokens: every value must be an integer in [1, 65536]"},
      {"bench --preset tiny --replays 0", "--replays must be an integer in [1, 100000], got '0'"},
      {"bench --preset tiny --json", "--json needs a file name"},
      {"bench --model /nonexistent --tokens 0", "--tokens: every value must be an integer in [1, 65536]"},
      {"bench --model /nonexistent --bogus 1", "unknown option --bogus"},
      {"bench --model /nonexistent --versus EXPERTQMM_CHAINED_LAUNCH", "--versus: 'EXPERTQMM_CHAINED_LAUNCH' is not VAR=VALUE"},
      {"bench --model /nonexistent --versus EXPERTQMM_CHAINED_LAUNCH=0,", "--versus: '' is not VAR=VALUE"},
      {"bench --model /nonexistent --versus EXPERTQMM_CHAINED_LAUNCH=2", "EXPERTQMM_CHAINED_LAUNCH='2' is not valid"},
      {"bench --model /nonexistent --versus EXPERTQMM_NOPE=1", "'EXPERTQMM_NOPE' is not a setting"},
      {"write-checkpoint --out /nonexistent/x --layers 5000", "--layers must be an integer in [1, 1000], got '5000'"},
      {"write-checkpoint --out /nonexistent/x --preset tiny --layers 2 --shards 3", "--shards must be an integer in [1, 2]"},
      {"write-checkpoint --out /nonexistent/x --seed 99999999999999999999", "--seed must be an integer in [0, "},
      {"write-checkpoint --out /nonexistent/x --force yes", "--force takes no value, got 'yes'"},
      {"write-checkpoint --preset tiny", "--out DIR is required"},
      {"write-checkpoint --out /nonexistent/x --preset big", "--preset expects gemma4-26b-a4b, tiny, qwen3-30b-a3b or qwen3-tiny, got 'big'"},
      {"info --verbose", "expertqmm info: unknown option --verbose"},
      {"run --preset tiny --tokens 3 --quant fp4", "--quant expects affine, mxfp4, mxfp8 or nvfp4, got 'fp4'"},
      {"write-checkpoint --out /nonexistent/x --quant mxfp4 --group-size 64",
       "--group-size: mode mxfp4 has one group size (32)"},
  };
  for (const Case& c : cases) {
    Result r = run_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\n" << r.output;
    EXPECT_NE(r.output.find(c.message), std::string::npos) << c.args << "\n" << r.output;
    EXPECT_EQ(count_of(r.output, "\n"), 1) << "one line: " << c.args << "\n" << r.output;
  }
}

// --group-size 128: the experts' down_proj (64 inputs in the tiny preset) stays bf16, as mlx-lm's
// quantize_model leaves it; the reader sees a 16-bit expert projection and a 4-bit g128 gate.
TEST_F(Cli, WriteCheckpointWithGroupSize128LeavesExpertsDownIn16Bit) {
  const TempDir tmp("ckpt");
  ASSERT_FALSE(tmp.path.empty());
  const std::string& dir = tmp.path;
  Result r = run_cli("write-checkpoint --preset tiny --layers 1 --group-size 128 --out " + dir);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const expertqmm::Gemma4Checkpoint ck = expertqmm::Gemma4Checkpoint::open(dir);
  const expertqmm::Gemma4FfnWeights w = ck.layer(0);
  EXPECT_TRUE(w.moe.experts.down_dense.defined());
  EXPECT_EQ(w.moe.experts.gate.group_size, 128);
  EXPECT_NE(read_file(dir + "/config.json").find("\"group_size\": 128"), std::string::npos);
  Result bad = run_cli("write-checkpoint --preset tiny --group-size 48 --out " + dir);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--group-size expects 32, 64 or 128, got '48'"), std::string::npos) << bad.output;
}

// --dense-mlp: the Gemma 4 dense MLP 8-bit g64 (the QAT upload, the default) or at the default
// quantization (4-bit g64, mlx-community's upload) with the router still 8-bit; refused for Qwen3-MoE.
TEST_F(Cli, WriteCheckpointDenseMlpQuantization) {
  for (const char* dense : {"8bit", "default"}) {
    const TempDir tmp("ckpt");
    ASSERT_FALSE(tmp.path.empty());
    const std::string& dir = tmp.path;
    Result r = run_cli(std::string("write-checkpoint --preset tiny --layers 1 --dense-mlp ") + dense + " --out " + dir);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const expertqmm::Gemma4FfnWeights w = expertqmm::Gemma4Checkpoint::open(dir).layer(0);
    const int bits = std::string(dense) == "8bit" ? 8 : 4;
    for (const expertqmm::Linear* l : {&w.mlp.gate, &w.mlp.up, &w.mlp.down}) {
      ASSERT_TRUE(l->is_quantized()) << dense;
      EXPECT_EQ(l->quantized.bits, bits) << dense;
      EXPECT_EQ(l->quantized.group_size, 64) << dense;
    }
    EXPECT_EQ(w.moe.router.proj.bits, 8) << dense;
    EXPECT_EQ(read_file(dir + "/config.json").find("mlp.gate_proj") != std::string::npos, bits == 8) << dense;
  }
  Result bad = run_cli("write-checkpoint --preset qwen3-tiny --dense-mlp default --out /nonexistent/x");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("--dense-mlp: the Qwen3-MoE presets have no dense MLP"), std::string::npos) << bad.output;
  Result odd = run_cli("write-checkpoint --preset tiny --dense-mlp 4bit --out /nonexistent/x");
  EXPECT_NE(odd.output.find("--dense-mlp expects 8bit or default, got '4bit'"), std::string::npos) << odd.output;
}

// --quant: the experts in each of MLX's modes, run and checked against the float64 reference
// (which decodes the fp codes itself), and a checkpoint whose config.json carries the mode.
TEST_F(Cli, QuantModesRunAndWriteCheckpoints) {
  for (const char* mode : {"affine", "mxfp4", "mxfp8", "nvfp4"}) {
    Result r = run_cli(std::string("run --preset tiny --tokens 8 --backend cpu --quant ") + mode);
    EXPECT_EQ(r.exit_code, 0) << mode << "\n" << r.output;
    EXPECT_EQ(field(r.output, "status"), "PASS") << r.output;
    EXPECT_EQ(field(r.output, "quant").rfind(mode, 0), 0u) << r.output;
  }
  EXPECT_EQ(field(run_cli("run --preset tiny --tokens 2 --backend cpu --quant nvfp4").output, "quant"), "nvfp4 4-bit g16");
  const TempDir tmp("ckpt");
  ASSERT_FALSE(tmp.path.empty());
  const std::string& dir = tmp.path;
  Result w = run_cli("write-checkpoint --preset tiny --layers 1 --quant mxfp8 --out " + dir);
  ASSERT_EQ(w.exit_code, 0) << w.output;
  EXPECT_NE(read_file(dir + "/config.json").find("\"group_size\": 32, \"bits\": 8, \"mode\": \"mxfp8\""),
            std::string::npos);
  const expertqmm::Gemma4FfnWeights layer = expertqmm::Gemma4Checkpoint::open(dir).layer(0);
  EXPECT_EQ(layer.moe.experts.gate.mode, expertqmm::QuantMode::mxfp8);
  EXPECT_EQ(layer.moe.router.proj.mode, expertqmm::QuantMode::affine);  // its 8-bit g64 entry
}

// bench and diag take the same --expert-tiles values (diag took auto|on|off, bench auto|off|both).
TEST_F(Cli, ExpertTilesTakeTheSameValuesInBenchAndDiag) {
  for (const char* v : {"auto", "on", "off", "both"}) {
    Result diag = run_cli(std::string("diag --preset tiny --backend cpu --tokens 3 --expert-tiles ") + v);
    EXPECT_EQ(diag.exit_code, 0) << v << "\n" << diag.output;
    EXPECT_EQ(count_of(diag.output, "expert tiles " + std::string(v == std::string("both") ? "off" : v) + ","), 1)
        << v << "\n" << diag.output;
    Result bench = run_cli(std::string("bench --preset tiny --tokens 1 --replays 1 --expert-tiles ") + v);
    EXPECT_NE(bench.exit_code, 2) << "bench must accept --expert-tiles " << v << "\n" << bench.output;
  }
  EXPECT_EQ(count_of(run_cli("diag --preset tiny --backend cpu --tokens 3 --expert-tiles both").output, ", expert tiles "),
            2);
  for (const char* cmd : {"diag", "bench"}) {
    Result r = run_cli(std::string(cmd) + " --preset tiny --expert-tiles sometimes");
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("--expert-tiles expects auto, on, off or both, got 'sometimes'"), std::string::npos)
        << r.output;
  }
}

// diag on the CPU says that its zeros are CUDA route counters, and a run of seconds (the 26B-A4B
// layer on the CPU) shows its stages on stderr, leaving stdout to the result.
TEST_F(Cli, DiagExplainsCpuZerosAndShowsProgressOnStderr) {
  const Streams r = run_cli_streams("diag --preset tiny --backend cpu --tokens 3");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("count the CUDA routes"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("generating weights ..."), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("running the layer on cpu"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find(" ..."), std::string::npos) << "progress belongs on stderr: " << r.out;
}

// The CLI side of the writer: a non-empty --out is refused (exit 1, nothing touched) unless --force;
// progress per layer goes to stderr.
TEST_F(Cli, WriteCheckpointRefusesANonEmptyTargetUnlessForced) {
  const TempDir tmp("ckpt");
  ASSERT_FALSE(tmp.path.empty());
  const std::string dir = tmp.path + "/ckpt";
  const Streams first = run_cli_streams("write-checkpoint --preset tiny --layers 2 --shards 2 --out " + dir);
  EXPECT_EQ(first.exit_code, 0) << first.err;
  EXPECT_NE(first.err.find("layer 2/2 written"), std::string::npos) << first.err;
  EXPECT_EQ(first.out.find("written"), std::string::npos) << first.out;
  const std::string config = read_file(dir + "/config.json");
  const Streams again = run_cli_streams("write-checkpoint --preset tiny --layers 1 --out " + dir);
  EXPECT_EQ(again.exit_code, 1) << again.err;
  EXPECT_NE(again.err.find("not empty"), std::string::npos) << again.err;
  EXPECT_EQ(read_file(dir + "/config.json"), config);
  EXPECT_EQ(access((dir + "/model-00002-of-00002.safetensors").c_str(), R_OK), 0);
  const Streams forced = run_cli_streams("write-checkpoint --preset tiny --layers 1 --force --out " + dir);
  EXPECT_EQ(forced.exit_code, 0) << forced.err;
  EXPECT_NE(access((dir + "/model-00002-of-00002.safetensors").c_str(), R_OK), 0) << "the old shards are gone";
  EXPECT_EQ(access((dir + "/model.safetensors").c_str(), R_OK), 0);
}

TEST_F(Cli, CudaOnlyCommandsExplainAMissingGpu) {
  if (expertqmm::cuda_available()) GTEST_SKIP() << "a CUDA device is present: the GPU tests cover bench";
  Result bench = run_cli("bench --preset tiny --tokens 1 --replays 1");
  EXPECT_NE(bench.exit_code, 0) << bench.output;
  EXPECT_NE(bench.output.find("CUDA"), std::string::npos) << bench.output;
  Result run = run_cli("run --preset tiny --tokens 1 --backend cuda");
  EXPECT_NE(run.exit_code, 0) << run.output;
  EXPECT_NE(run.output.find("--backend cuda"), std::string::npos) << run.output;
}

// On a machine with a GPU (scripts/gpu-check runs this binary there) the CLI's CUDA paths run too.
TEST_F(Cli, RunOnCudaPasses) {
  if (!expertqmm::cuda_available()) GTEST_SKIP() << "SKIP: no CUDA device";
  for (const char* args : {"run --preset tiny --tokens 40 --backend cuda",
                           "run --preset gemma4-26b-a4b --tokens 64 --backend cuda",
                           "run --preset gemma4-26b-a4b-fused --tokens 3 --backend cuda --routing zipf",
                           "run --preset qwen3-30b-a3b --tokens 8 --backend cuda",
                           "run --preset qwen3-30b-a3b --tokens 512 --backend cuda --check-tokens 8",
                           "run --preset qwen3-tiny --tokens 40 --backend cuda --routing zipf"}) {
    Result r = run_cli(args);
    EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.output;
    EXPECT_EQ(field(r.output, "status"), "PASS") << args << "\n" << r.output;
    EXPECT_EQ(field(r.output, "backend"), "cuda") << args << "\n" << r.output;
  }
}

TEST_F(Cli, BenchOnCudaWritesJsonAndExport) {
  if (!expertqmm::cuda_available()) GTEST_SKIP() << "SKIP: no CUDA device";
  const TempDir tmp("bench");
  ASSERT_FALSE(tmp.path.empty());
  const std::string& dir = tmp.path;
  Result uniform = run_cli("bench --preset tiny --tokens 1,64 --product both --replays 5 --json " + dir +
                           "/uniform.json --export-dir " + dir + "/export");
  EXPECT_EQ(uniform.exit_code, 0) << uniform.output;
  const std::string json = read_file(dir + "/uniform.json");
  EXPECT_EQ(count_of(json, "\"check\": \"PASS\""), 4) << json;  // 2 token counts x 2 products
  EXPECT_EQ(count_of(json, "\"product\": \"separate\""), 2) << json;
  EXPECT_EQ(count_of(json, "\"separate_minus_fused_us\""), 2) << json;
  EXPECT_NE(json.find("\"bf16_tflops\""), std::string::npos) << json;
  for (const char* f : {"/export/weights.safetensors", "/export/case_T1.safetensors", "/export/case_T64.safetensors"})
    EXPECT_EQ(access((dir + f).c_str(), R_OK), 0) << f;
  // The checked tokens travel with each case, for the torch peer's check of our output.
  EXPECT_NE(read_file(dir + "/export/case_T64.safetensors").find("\"checked_tokens\""), std::string::npos);

  Result zipf = run_cli("bench --preset tiny --tokens 64 --routing zipf --replays 5 --json " + dir + "/zipf.json");
  EXPECT_EQ(zipf.exit_code, 0) << zipf.output;
  const std::string zjson = read_file(dir + "/zipf.json");
  EXPECT_EQ(count_of(zjson, "\"check\": \"PASS\""), 1) << zjson;
  EXPECT_EQ(count_of(zjson, "\"tokens_off_plan\": 0,"), 1) << "the router must follow the Zipf plan: " << zjson;

  // --expert-tiles both: the same layer with the sorted tile route at its default and switched off.
  Result tiles = run_cli("bench --preset tiny --tokens 64 --expert-tiles both --replays 5 --json " + dir + "/tiles.json");
  EXPECT_EQ(tiles.exit_code, 0) << tiles.output;
  const std::string tjson = read_file(dir + "/tiles.json");
  EXPECT_EQ(count_of(tjson, "\"check\": \"PASS\""), 2) << tjson;
  EXPECT_EQ(count_of(tjson, "\"expert_tiles\": \"auto\""), 1) << tjson;
  EXPECT_EQ(count_of(tjson, "\"expert_tiles\": \"off\""), 1) << tjson;
}

// Qwen3-MoE on the GPU through the CLI: the preset's bench (its check against float64 passes at a
// decode and a sorted size), and bench --model on a synthetic qwen3_moe checkpoint.
TEST_F(Cli, Qwen3BenchAndBenchModelOnCuda) {
  if (!expertqmm::cuda_available()) GTEST_SKIP() << "SKIP: no CUDA device";
  const TempDir tmp("qwen3_bench");
  ASSERT_FALSE(tmp.path.empty());
  const std::string& dir = tmp.path;
  Result bench = run_cli("bench --preset qwen3-tiny --tokens 1,64 --replays 3 --json " + dir + "/bench.json");
  EXPECT_EQ(bench.exit_code, 0) << bench.output;
  const std::string json = read_file(dir + "/bench.json");
  EXPECT_EQ(count_of(json, "\"check\": \"PASS\""), 2) << json;
  Result write = run_cli("write-checkpoint --preset qwen3-tiny --layers 3 --out " + dir + "/ckpt");
  ASSERT_EQ(write.exit_code, 0) << write.output;
  Result model = run_cli("bench --model " + dir + "/ckpt --tokens 1,64 --product fused --replays 3 --json " + dir +
                         "/model.json");
  EXPECT_EQ(model.exit_code, 0) << model.output;
  const std::string mjson = read_file(dir + "/model.json");
  EXPECT_NE(mjson.find("\"family\": \"qwen3_moe\""), std::string::npos) << mjson;
  EXPECT_EQ(count_of(mjson, "\"us_per_layer\""), 2) << mjson;
  EXPECT_NE(model.output.find("(qwen3_moe): 3 layers"), std::string::npos) << model.output;
}

// bench --model --versus: each size measured as set and with the given settings in one process, the
// rows labelled in the JSON and the table (with the change), on a synthetic Gemma 4 checkpoint.
TEST_F(Cli, BenchModelVersusMeasuresBothConfigurationsOnCuda) {
  if (!expertqmm::cuda_available()) GTEST_SKIP() << "SKIP: no CUDA device";
  const TempDir tmp("versus");
  ASSERT_FALSE(tmp.path.empty());
  const std::string& dir = tmp.path;
  Result write = run_cli("write-checkpoint --preset tiny --layers 2 --out " + dir + "/ckpt");
  ASSERT_EQ(write.exit_code, 0) << write.output;
  const std::string versus = "EXPERTQMM_CHAINED_LAUNCH=0,EXPERTQMM_DECODE_ROUTE_IN_GATE_UP=1";
  Result model = run_cli("bench --model " + dir + "/ckpt --tokens 1,8 --product fused --replays 4 --versus " + versus +
                         " --json " + dir + "/model.json");
  EXPECT_EQ(model.exit_code, 0) << model.output;
  const std::string json = read_file(dir + "/model.json");
  EXPECT_NE(json.find("\"versus\": \"" + versus + "\""), std::string::npos) << json;
  EXPECT_EQ(count_of(json, "\"config\": \"default\""), 2) << json;
  EXPECT_EQ(count_of(json, "\"config\": \"versus\""), 2) << json;
  EXPECT_EQ(count_of(model.output, "  default\n"), 2) << model.output;
  EXPECT_EQ(count_of(model.output, "%\n"), 2) << model.output;
}

// A bad EXPERTQMM_* value stops a CPU run too, with one error naming the variable (the CPU path
// reads none of them; the settings check in the op front does).
TEST_F(Cli, BadSettingVariableIsAnErrorOnTheCpu) {
  for (const char* env : {"EXPERTQMM_EXPERT_TILES=2", "EXPERTQMM_DECODE_LAYER=yes", "EXPERTQMM_DETERMINISTIC=",
                          "EXPERTQMM_WGMMA=off", "EXPERTQMM_WGMMA_WIDTH=48"}) {
    const Result r = run_cli("run --preset tiny --tokens 2 --backend cpu", env);
    const std::string name = std::string(env).substr(0, std::string(env).find('='));
    EXPECT_NE(r.exit_code, 0) << env << "\n" << r.output;
    EXPECT_NE(r.output.find(name), std::string::npos) << env << "\n" << r.output;
  }
  const Result ok = run_cli("run --preset tiny --tokens 2 --backend cpu", "EXPERTQMM_EXPERT_TILES=0");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
}

}  // namespace
