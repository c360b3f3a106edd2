// The checkpoint writer never loses or mixes data (issue 18): a non-empty target is refused unless
// forced, and then only when it holds nothing but checkpoint files; everything is written into a
// temporary directory that one rename publishes, so a failure at any point (an exception from the
// layer source, a write error, too little free space) leaves the old checkpoint loading as before
// and no temporary behind; a second writer of the same target fails at once.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <stdexcept>

#include "expertqmm/checkpoint.h"
#include "support/checkpoint_files.h"
#include "support/test_util.h"

namespace expertqmm {
namespace {

using test::expect_error;
using test::list_dir;
using test::tiny_config;

// A fresh, empty parent directory per test; the checkpoint goes to <parent>/ckpt.
struct Parent {
  std::string path;
  explicit Parent(const std::string& tag) : path(test::fresh_dir("writer_" + tag)) {
    EXPECT_EQ(::mkdir(path.c_str(), 0755), 0) << path;
  }
  ~Parent() { std::system(("rm -rf '" + path + "'").c_str()); }
  std::string target() const { return path + "/ckpt"; }
};

// Writes a tiny checkpoint of `layers` layers with `seed`; `fail_at` >= 0 makes the layer source throw there.
void write(const std::string& dir, int layers, int shards, uint64_t seed, const CheckpointWriteOptions& options = {},
           int fail_at = -1) {
  const Gemma4Config c = tiny_config(layers);
  write_gemma4_checkpoint(
      dir, c, shards,
      [&](int n) {
        if (n == fail_at) throw std::runtime_error("layer source failed");
        return synthetic_gemma4_layer(c, n, seed);
      },
      options);
}

CheckpointWriteOptions forced() {
  CheckpointWriteOptions o;
  o.force = true;
  return o;
}

// Every layer of the checkpoint at `dir` is the synthetic one of `seed`.
void expect_checkpoint(const std::string& dir, int layers, uint64_t seed) {
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(dir);
  ASSERT_EQ(ck.num_layers(), layers);
  const Gemma4Config c = tiny_config(layers);
  for (int n = 0; n < layers; ++n)
    test::expect_same_layer(ck.layer(n), synthetic_gemma4_layer(c, n, seed), "layer " + std::to_string(n));
}

const std::vector<std::string> kThreeShards = {"config.json", "model-00001-of-00003.safetensors",
                                               "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                                               "model.safetensors.index.json"};

TEST(CheckpointWriter, ANonEmptyTargetIsRefusedWithoutForce) {
  Parent p("noforce");
  write(p.target(), 3, 3, 7);
  expect_error([&] { write(p.target(), 3, 1, 8); }, {p.target(), "not empty", "force"});
  EXPECT_EQ(list_dir(p.target()), kThreeShards);
  expect_checkpoint(p.target(), 3, 7);
  // An empty directory is fine without force (rename replaces it).
  const std::string empty = p.path + "/empty";
  ASSERT_EQ(::mkdir(empty.c_str(), 0755), 0);
  write(empty, 1, 1, 7);
  expect_checkpoint(empty, 1, 7);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt", "empty"})) << "no lock or temporary left behind";
}

// --force replaces the whole directory: fewer shards leave none of the old ones behind.
TEST(CheckpointWriter, ForceReplacesTheWholeCheckpoint) {
  Parent p("force");
  write(p.target(), 3, 3, 7);
  write(p.target(), 2, 1, 8, forced());
  EXPECT_EQ(list_dir(p.target()), (std::vector<std::string>{"config.json", "model.safetensors"}));
  expect_checkpoint(p.target(), 2, 8);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"}));
}

// Even with force, a directory holding something a checkpoint does not is left alone.
TEST(CheckpointWriter, ForceNeverDeletesForeignFiles) {
  Parent p("foreign");
  write(p.target(), 1, 1, 7);
  test::write_all(p.target() + "/notes.txt", "mine");
  expect_error([&] { write(p.target(), 1, 1, 8, forced()); }, {"notes.txt", "refusing to delete"});
  EXPECT_EQ(test::read_all(p.target() + "/notes.txt"), "mine");
  expect_checkpoint(p.target(), 1, 7);
  const std::string file = p.path + "/file";
  test::write_all(file, "x");
  expect_error([&] { write(file, 1, 1, 8, forced()); }, {file, "is a regular file, not a directory"});
  const std::string link = p.path + "/link";
  ASSERT_EQ(::symlink("ckpt", link.c_str()), 0);
  expect_error([&] { write(link, 1, 1, 8, forced()); }, {link, "symbolic link"});
}

// A failure part-way (here the layer source throws at layer 2 of 3, after shard 1 of 3 is written)
// leaves the old checkpoint complete and loading with its own weights, and no temporary behind.
TEST(CheckpointWriter, AFailurePartWayLeavesTheOldCheckpoint) {
  Parent p("partway");
  write(p.target(), 3, 3, 7);
  int progress_calls = 0;
  CheckpointWriteOptions o = forced();
  o.progress = [&](int, int, uint64_t, uint64_t) { ++progress_calls; };
  EXPECT_THROW(write(p.target(), 3, 3, 8, o, 2), std::runtime_error);
  EXPECT_EQ(progress_calls, 2) << "layers 0 and 1 were written before the failure";
  EXPECT_EQ(list_dir(p.target()), kThreeShards);
  expect_checkpoint(p.target(), 3, 7);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"}));
  // A new target: nothing at all is left.
  EXPECT_THROW(write(p.path + "/new", 3, 3, 8, {}, 1), std::runtime_error);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"}));
}

// A real write error (the file size limit stands in for a full disk mid-shard): the error names the
// file and the reason, and neither a *.tmp nor a half checkpoint remains.
TEST(CheckpointWriter, AWriteErrorLeavesNoTemporary) {
  Parent p("eio");
  write(p.target(), 2, 2, 7);
  struct rlimit saved;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto* old_handler = std::signal(SIGXFSZ, SIG_IGN);  // write() then fails with EFBIG instead
  struct rlimit small = saved;
  small.rlim_cur = 64 << 10;  // a tiny shard is ~200 KB
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  expect_error([&] { write(p.target(), 2, 2, 8, forced()); }, {"model-00001-of-00002.safetensors", "File too large"});
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"}));
  EXPECT_EQ(list_dir(p.target()), (std::vector<std::string>{"config.json", "model-00001-of-00002.safetensors",
                                                            "model-00002-of-00002.safetensors",
                                                            "model.safetensors.index.json"}));
  expect_checkpoint(p.target(), 2, 7);
}

// The free space is checked before anything is written (the default preset writes 13.4 GB).
TEST(CheckpointWriter, TooLittleFreeSpaceIsRefusedUpFront) {
  Parent p("full");
  write(p.target(), 2, 1, 7);
  const uint64_t need = 2 * synthetic_gemma4_layer(tiny_config(2), 0, 7).nbytes();
  CheckpointWriteOptions o = forced();
  std::string asked;
  o.free_bytes = [&](const std::string& parent) {
    asked = parent;
    return uint64_t(1000);
  };
  int layers_written = 0;
  o.progress = [&](int, int, uint64_t, uint64_t) { ++layers_written; };
  expect_error([&] { write(p.target(), 2, 1, 8, o); }, {p.target(), "needs", "1000 bytes) free"});
  EXPECT_EQ(asked, p.path);
  EXPECT_EQ(layers_written, 0);
  expect_checkpoint(p.target(), 2, 7);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"}));
  o.free_bytes = [&](const std::string&) { return need + (1 << 20); };  // enough
  write(p.target(), 2, 1, 8, o);
  expect_checkpoint(p.target(), 2, 8);
}

// A second writer of the same target fails at once instead of interleaving with the first; the
// first one completes.
TEST(CheckpointWriter, ASecondWriterIsLockedOut) {
  Parent p("lock");
  bool second_refused = false;
  CheckpointWriteOptions o;
  o.progress = [&](int done, int, uint64_t, uint64_t) {
    if (done != 1) return;
    expect_error([&] { write(p.target(), 2, 1, 8, forced()); }, {p.target(), "another writer", "ckpt.lock"});
    second_refused = true;
  };
  write(p.target(), 2, 2, 7, o);
  EXPECT_TRUE(second_refused);
  expect_checkpoint(p.target(), 2, 7);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"})) << "the lock file goes with the writer";
}

// What a killed writer leaves (its temporary directory, a stale lock file) does not stop the next one.
TEST(CheckpointWriter, LeftoversOfAKilledWriterAreCleanedUp) {
  Parent p("killed");
  const std::string tmp = p.path + "/.ckpt.tmp-123-0-0";
  ASSERT_EQ(::mkdir(tmp.c_str(), 0755), 0);
  test::write_all(tmp + "/model-00001-of-00002.safetensors", "partial");
  test::write_all(p.target() + ".lock", "");
  write(p.target(), 1, 1, 7);
  EXPECT_EQ(list_dir(p.path), (std::vector<std::string>{"ckpt"}));
  expect_checkpoint(p.target(), 1, 7);
}

TEST(CheckpointWriter, ProgressCountsLayersAndBytes) {
  Parent p("progress");
  std::vector<int> layers;
  uint64_t last = 0, total = 0;
  CheckpointWriteOptions o;
  o.progress = [&](int done, int all, uint64_t written, uint64_t in_all) {
    EXPECT_EQ(all, 3);
    EXPECT_GT(written, last);
    layers.push_back(done);
    last = written;
    total = in_all;
  };
  write(p.target(), 3, 2, 7, o);
  EXPECT_EQ(layers, (std::vector<int>{1, 2, 3}));
  uint64_t on_disk = 0;
  for (const std::string& f : list_dir(p.target())) {
    struct stat st;
    ASSERT_EQ(::stat((p.target() + "/" + f).c_str(), &st), 0);
    on_disk += uint64_t(st.st_size);
  }
  EXPECT_EQ(total, on_disk) << "the free-space estimate is the exact size";
  EXPECT_LE(last, total);
}

// A layer whose structure differs from layer 0 names layer 0's tensor by layer 0's name.
TEST(CheckpointWriter, AStructureMismatchNamesBothLayersTensors) {
  Parent p("shape");
  const Gemma4Config c = tiny_config(2);
  const auto odd = [&](int n) {
    Gemma4FfnWeights w = synthetic_gemma4_layer(c, n, 1);
    if (n == 1) w.pre_feedforward_layernorm = test::from_float(std::vector<float>(64, 1.0f), {64}, DType::bf16);
    return w;
  };
  expect_error([&] { write_gemma4_checkpoint(p.target(), c, 1, odd); },
               {"layer 1: tensor 'model.layers.1.pre_feedforward_layernorm.weight' bfloat16[64]",
                "layer 0's 'model.layers.0.pre_feedforward_layernorm.weight' bfloat16[128]"});
  EXPECT_EQ(list_dir(p.path), std::vector<std::string>{});
}

// A Qwen3-MoE checkpoint (mlx-lm's qwen3_moe names) written in shards reads back layer for layer,
// and its layers run as Qwen3 blocks.
TEST(CheckpointWriter, Qwen3MoeCheckpointRoundTrips) {
  Parent p("qwen3");
  Gemma4Config c = Gemma4Config::qwen3_30b_a3b(3);
  c.hidden_size = 128;
  c.moe_intermediate_size = 64;
  c.num_experts = 8;
  c.top_k_experts = 2;
  c.norm_topk_prob = false;
  write_qwen3_moe_checkpoint(p.target(), c, 3, [&](int n) { return synthetic_qwen3_moe_layer(c, n, 5); });
  EXPECT_EQ(list_dir(p.target()), kThreeShards);
  const Gemma4Checkpoint ck = Gemma4Checkpoint::open(p.target());
  ASSERT_EQ(ck.family(), ModelFamily::qwen3_moe);
  ASSERT_EQ(ck.num_layers(), 3);
  EXPECT_TRUE(ck.has("model.layers.2.mlp.switch_mlp.down_proj.scales"));
  EXPECT_TRUE(ck.has("model.layers.0.mlp.gate.biases"));
  for (int n = 0; n < 3; ++n) {
    const Qwen3MoeFfnWeights w = ck.qwen3_moe_layer(n);
    test::expect_same_layer(w, synthetic_qwen3_moe_layer(c, n, 5), "layer " + std::to_string(n));
    EXPECT_EQ(w.moe.router.proj.bits, 8);
    EXPECT_FALSE(w.moe.router.norm_topk_prob);
  }
  // The families' writers refuse each other's configs instead of writing the wrong names.
  expect_error([&] { write_gemma4_checkpoint(p.path + "/g", c, 1, [&](int n) { return Gemma4FfnWeights(); }); },
               {"write_gemma4_checkpoint", "qwen3_moe"});
}

}  // namespace
}  // namespace expertqmm
