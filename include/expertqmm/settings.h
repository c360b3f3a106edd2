// Every process-wide setting of expertqmm, in one place. Each has an EXPERTQMM_* environment
// variable and an API setter that overrides it. The environment is read once, all variables at
// once and on every build (a CPU-only build too), the first time any op or getter runs; a bad value
// of any variable is an Error naming it, then and on every later call.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace expertqmm {

// A route forced on or off, or left to the measured default.
enum class RouteSwitch : uint8_t { automatic, off, on };

// How the GLU product is computed on CUDA (the fusion ladder, DESIGN.md): one kernel (fused) or
// gelu/silu then multiply as two kernels (separate), kept for comparison.
enum class ProductMode : uint8_t { fused, separate };

// EXPERTQMM_EXPERT_TILES=0|1: the expert tile route of gather_qmm off or on (unset: automatic).
void set_expert_tiles(RouteSwitch s);
RouteSwitch expert_tiles_setting();

// EXPERTQMM_DECODE_LAYER=0|1: the decode MoE layer (the whole moe_layer_into in three kernels, four
// with the down groups: EXPERTQMM_DECODE_DOWN_GROUPS, by default from 12 tokens; up to 16 tokens, src/cuda/moe_decode_layer.cu) off or on; `automatic` is on. Its selections are
// counted under "moe_decode_layer".
void set_decode_layer(RouteSwitch s);
RouteSwitch decode_layer_setting();

// EXPERTQMM_DECODE_ROUTE_IN_GATE_UP=0|1: at one token, the decode layer's gate/up CTAs rank the
// router's logits themselves (each CTA finds its expert; one writes the k indices and weights for
// the down kernel) and the router ends at its logits, without its last CTA's ticket, top-k and plan
// (bench/NOTES.md steps 33 and 36; Gemma's router and the softmax top-k one). `automatic` is on
// where the router is not chained behind the kernel ahead of it (the MoE layer alone: -3.1 us at
// T = 1) and off inside the Gemma 4 block at decode sizes, whose chained router's last CTA ranks
// beside the dense branch (there the gate/up CTAs' ranking cost 1.9-2.5 us).
void set_decode_route_in_gate_up(RouteSwitch s);
RouteSwitch decode_route_in_gate_up_setting();

// EXPERTQMM_DECODE_DOWN_GROUPS=0|1: from 2 tokens, the decode layer's 4-bit down product per (expert
// group, 128 columns), each expert's down rows read and dequantized once per group of up to 8 rows,
// then the weighted slot-order combine as a fourth kernel, instead of per (token, 16 columns) with
// one slot per warp (bench/NOTES.md steps 44-45). The same arithmetic, the same bytes out.
// `automatic` takes them from 12 tokens, where they measured faster (-2.6% / -5.1% at T = 12 / 16 on
// Gemma 4, +0.3% at 8).
void set_decode_down_groups(RouteSwitch s);
RouteSwitch decode_down_groups_setting();

// EXPERTQMM_CHAINED_LAUNCH=0|1: programmatic dependent launches (sm_90) at the Gemma 4 block's two
// boundaries that allow them at decode sizes: the router (which reads the block's input, not the
// entry norms' output) starts while the entry norms run, and the exit kernel loads its other inputs
// while the experts' down kernel finishes. `automatic` is on (where the device has it: sm_90+);
// bench/NOTES.md step 20 measured -9.3 us per 30-layer-block layer at T = 1 and -8 at T = 8.
void set_chained_launch(RouteSwitch s);
RouteSwitch chained_launch_setting();  // this thread's ChainedLaunchScope, else the API's, else the env
bool chained_launches();               // whether launches chain: the setting, `automatic` being on
// For its lifetime, chained_launch_setting() on this thread is `s` (other threads keep theirs), then
// what it was: for work recorded into a framework's graph whose programmatic edges are unverified
// (the MLX extension runs inside MLX's graph with chained launches off).
class ChainedLaunchScope {
 public:
  explicit ChainedLaunchScope(RouteSwitch s);
  ~ChainedLaunchScope();
  ChainedLaunchScope(const ChainedLaunchScope&) = delete;
  ChainedLaunchScope& operator=(const ChainedLaunchScope&) = delete;

 private:
  int previous_;
};

// EXPERTQMM_DETERMINISTIC=0|1: on, only kernels whose output bits are the same on every run. Every
// path of both backends is deterministic now (the CUDA layer's combine sums the k slots in order;
// its fp32-atomic form inside the down GEMM measured slower and was removed, bench/NOTES.md step
// 46), so the setting changes nothing today; it keeps any faster order-varying kernel added later
// off for the callers who need reproducible bits.
void set_deterministic(bool on);
bool deterministic();

// API only (no variable): the GLU product mode.
void set_product_mode(ProductMode mode);
ProductMode product_mode();

// EXPERTQMM_WGMMA=0|1: 0 turns the sm_90a wgmma kernels off (the mma.sync kernels run instead), for
// comparison; unset: the builds chosen by measurement, where the build and the device have them;
// 1: also where the measured rules do not choose them (the 8-bit codes' build below 32 rows per
// expert: kWgmma8BitMinRowsPerExpert), for their A/B.
void set_wgmma(RouteSwitch s);
RouteSwitch wgmma_setting();

// EXPERTQMM_WGMMA_WS=0|1: 1 runs the 4-bit affine wgmma expert GEMM's wide build (128 tokens; every
// form, the down GEMM's combine included) as the warp-specialized kernel
// (gather_qmm_expert_tiles_ws.cu: a producer warpgroup feeding an mbarrier ring, persistent CTAs; it
// reads a projection's tile layout where there is one); unset / 0: the two-CTA kernel (bench/NOTES.md
// step 47: until measured).
void set_wgmma_ws(RouteSwitch s);
RouteSwitch wgmma_ws_setting();

// EXPERTQMM_GROUP_ROWS=0|1: the MoE layer's rows (the sorted path, T * k >= 64) grouped by expert,
// with the expert tile plan, by group_rows.cu: one kernel of one CTA up to 8192 rows (T = 1024 at
// k = 8), its grid form past that (three launches over 1024-row chunks); 0: CUB's stable sort, the
// inverse and the plan builder (five to seven launches). The same bits either way. Unset or 1:
// wherever it fits (256 experts, 2^18 rows); both forms measured faster than CUB's path
// (bench/NOTES.md steps 54 and 58).
void set_group_rows(RouteSwitch s);
RouteSwitch group_rows_setting();

// EXPERTQMM_DENSE_CUBLAS=0|1: the Gemma 4 block's quantized dense MLP at prefill as its weights
// dequantized to 16 bits (one fma rounded once, as the tensor-core routes) and cuBLAS's GEMM, gate
// and up as one GEMM, then the GLU product and down. 1: at every size the decode kernels leave (2
// tokens up); 0: never (the expert tile route from 512 tokens, rhs_tiles below). Unset: from 512
// tokens, where it measured faster in the block (bench/NOTES.md steps 59 and 60).
void set_dense_cublas(RouteSwitch s);
RouteSwitch dense_cublas_setting();

// EXPERTQMM_WGMMA_WIDTH=32|64|128 pins one build of the wgmma expert-tile GEMM (its token width);
// 0 / unset: the measured table picks per call.
void set_wgmma_width(int width);
int wgmma_width();

// EXPERTQMM_DOWN_WINDOW_MIB=1..4096: the most MiB of the prefill MoE layer's down output ([T * k, D],
// sorted rows) held at once. Past it the layer runs down and the combine per window of columns (a
// multiple of 128) that fits, so its scratch stays bounded; the output bits are the same. Unset / 0:
// 24 MiB (bench/NOTES.md step 46: the layer's scratch under 64 MB at 2048 tokens).
void set_down_window_mib(int mib);
int down_window_mib();

// One row per environment variable: its name, the values it takes, the value in force (after API
// overrides) and what it does. `expertqmm info` prints it; the settings tests iterate it.
struct SettingInfo {
  std::string variable;  // "EXPERTQMM_EXPERT_TILES"
  std::string values;    // "0|1"
  std::string current;   // "auto", "0", "1", "64", ...
  std::string what;
};
std::vector<SettingInfo> settings_table();
// Overrides the setting of an EXPERTQMM_* `variable` as if the environment said `value` (the same
// values, the same Error for a bad one or an unknown name); nullopt drops the override, so the
// environment decides again. For tools that compare settings in one process (`bench --versus`).
void set_setting(const std::string& variable, const std::optional<std::string>& value);

}  // namespace expertqmm
