// expertqmm_cutlass_peer: CUTLASS's Hopper mixed-input grouped GEMM (example 69's kernel: TMA
// warp-specialized cooperative, 4-bit codes x bf16 activations, group-wise bf16 scales) at our
// layer's shapes, on the weights and the routing that `expertqmm bench --export-dir` wrote: one group
// per expert hit, with that expert's real row count. Each GEMM is checked against a float reference
// before it is timed, and timed with the benchmark protocol (bench/README.md): CUDA graphs over 4
// weight copies replayed round robin, L2 flushed before each replay, median of the replays.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "expertqmm/error.h"
#include "json_out.h"
#include "kernels.h"
#include "layer_data.h"
#include "peer_gemm.h"
#include "replay_timing.h"

namespace expertqmm::peer {

namespace {

constexpr double kTolerance = 1e-2;  // docs/numerics.md: bf16 GEMMs against a float reference
constexpr int kForms = 2;

const char* const kUsage =
    "usage: expertqmm_cutlass_peer --export-dir DIR [--export-dir DIR2 ...] [--tokens 1,8,64,512,1024,2048]\n"
    "                              [--instances affine-t32,scale-t128,...] [--replays 100] [--json FILE]\n"
    "DIR: an `expertqmm bench --export-dir` directory (weights.safetensors, case_T<T>.safetensors).\n"
    "Without --tokens every case of DIR runs; without --instances every compiled instance.\n";

const char* form_name(QuantForm f) { return f == QuantForm::affine ? "affine" : "scale"; }

struct Options {
  std::vector<std::string> export_dirs;
  std::vector<int64_t> tokens;
  std::vector<std::string> instances;
  int replays = 100;
  std::string json_path;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "expertqmm_cutlass_peer: %s\n%s", message.c_str(), kUsage);
  std::exit(2);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  for (std::string p; std::getline(in, p, ',');)
    if (!p.empty()) parts.push_back(p);
  return parts;
}

Options parse_options(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (key == "--help") std::printf("%s", kUsage), std::exit(0);
    if (i + 1 >= argc) usage_error(key + " needs a value");
    const std::string value = argv[++i];
    if (key == "--export-dir") {
      o.export_dirs.push_back(value);
    } else if (key == "--tokens") {
      for (const std::string& t : split(value)) {
        char* end = nullptr;
        const long long v = std::strtoll(t.c_str(), &end, 10);
        if (*end || v < 1) usage_error("--tokens takes positive integers, not '" + t + "'");
        o.tokens.push_back(v);
      }
    } else if (key == "--instances") {
      o.instances = split(value);
      for (const std::string& name : o.instances) {
        bool known = false;
        for (const Instance& inst : instances()) known = known || name == inst.name;
        if (!known) usage_error("--instances: '" + name + "' is not compiled into this binary");
      }
    } else if (key == "--replays") {
      o.replays = std::atoi(value.c_str());
      if (o.replays < 1) usage_error("--replays takes a positive integer");
    } else if (key == "--json") {
      o.json_path = value;
    } else {
      usage_error("unknown option " + key);
    }
  }
  if (o.export_dirs.empty()) usage_error("--export-dir is required");
  return o;
}

template <class T>
bool contains(const std::vector<T>& v, const T& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

// The arguments of one GEMM of one weight copy: one group per expert hit.
GroupedProblem make_problem(const GemmWeights& w, const Case& c, int copy, QuantForm form, const void* x,
                            const void* bias_term, void* d) {
  GroupedProblem p;
  p.n = w.n;
  p.k = w.k;
  p.group_size = w.group_size;
  const GemmWeights::Copy& weights = w.copies[copy];
  const DeviceBuffer& codes = form == QuantForm::affine ? weights.codes_unsigned : weights.codes_signed;
  for (size_t g = 0; g < c.group_expert.size(); ++g) {
    const size_t e = size_t(c.group_expert[g]), first = size_t(c.group_first_row[g]);
    p.rows.push_back(c.group_rows[g]);
    p.x.push_back(static_cast<const char*>(x) + first * w.k * 2);
    p.w.push_back(codes.as<char>() + e * w.code_bytes_per_expert());
    p.scales.push_back(weights.scales_t.as<char>() + e * w.groups() * w.n * 2);
    p.c.push_back(static_cast<const char*>(bias_term) + first * w.n * 2);
    p.d.push_back(static_cast<char*>(d) + first * w.n * 2);
  }
  return p;
}

// The buffers of one case, shared by every instance.
struct CaseBuffers {
  DeviceBuffer ref13[kForms], ref2[kForms];  // fp32 references per form
  DeviceBuffer act;                          // bf16 [rows, I]: the down GEMM's input
  DeviceBuffer d13, d2, c13, c2, sums13, sums2;

  CaseBuffers(const LayerWeights& l, const Case& c, cudaStream_t stream) {
    const size_t rows = size_t(c.rows), n13 = size_t(l.w13.n), n2 = size_t(l.w2.n);
    for (QuantForm f : {QuantForm::scale, QuantForm::affine}) {
      ref13[int(f)] = DeviceBuffer(rows * n13 * 4);
      ref2[int(f)] = DeviceBuffer(rows * n2 * 4);
    }
    act = DeviceBuffer(rows * l.intermediate * 2);
    d13 = DeviceBuffer(rows * n13 * 2);
    c13 = DeviceBuffer(rows * n13 * 2);
    d2 = DeviceBuffer(rows * n2 * 2);
    c2 = DeviceBuffer(rows * n2 * 2);
    sums13 = DeviceBuffer(rows * l.w13.groups() * 4);
    sums2 = DeviceBuffer(rows * l.w2.groups() * 4);
    auto reference = [&](const GemmWeights& w, const void* x, QuantForm f, DeviceBuffer& out) {
      reference_gemm(static_cast<const uint16_t*>(x), c.expert_of_row.as<int32_t>(), c.rows, w.mlx_codes.as<uint32_t>(),
                     w.mlx_scales.as<uint16_t>(), w.mlx_biases.as<uint16_t>(), w.n, w.k, w.group_size, f,
                     out.as<float>(), stream);
    };
    // The down GEMM's input is the GLU of the MLX-exact gate/up product, as in the layer.
    for (QuantForm f : {QuantForm::scale, QuantForm::affine}) reference(l.w13, c.x13.ptr, f, ref13[int(f)]);
    glu_rows(ref13[int(QuantForm::affine)].as<float>(), c.rows, l.intermediate, l.swiglu, act.as<uint16_t>(), stream);
    for (QuantForm f : {QuantForm::scale, QuantForm::affine}) reference(l.w2, act.ptr, f, ref2[int(f)]);
    EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
};

struct Measured {
  double rel_error = NAN;
  bool pass = false;
  std::optional<timing::Stats> us;  // empty when the check failed: no time for a wrong result
};

// Captures body(copy) for each weight copy, replays every graph twice, checks the outputs (error()
// after reset() filled them with NaN), and only then times `replays` replays.
Measured measure(cudaStream_t stream, const DeviceBuffer& flush, int replays, const std::function<void(int)>& body,
                 const std::function<void()>& reset, const std::function<double()>& error) {
  reset();
  timing::Graphs g;
  for (int copy = 0; copy < kWeightCopies; ++copy)
    timing::capture_into(g, stream, "the CUTLASS peer's GEMMs", [&] { body(copy); });
  for (int r = 0; r < 2 * kWeightCopies; ++r) EXPERTQMM_CUDA_CHECK(cudaGraphLaunch(g.execs[r % kWeightCopies], stream));
  EXPERTQMM_CUDA_CHECK(cudaStreamSynchronize(stream));
  Measured m;
  m.rel_error = error();
  m.pass = m.rel_error <= kTolerance;  // NaN fails
  if (m.pass) m.us = timing::stats_of(timing::timed_replays(g.execs, replays, stream, flush));
  return m;
}

std::string fixed(double v, int decimals) {
  if (v != v) return "-";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.*f", decimals, v);
  return buf;
}

struct Report {
  std::vector<std::string> rows;
  bool all_pass = true;
  // The fastest instance's w13+w2 per (preset routing, tokens, form): the summary at the end.
  std::map<std::tuple<std::string, int64_t, std::string>, std::pair<double, std::string>> best;

  void add(const LayerWeights& l, const Case& c, const std::string& instance, const std::string& form, int token_tile,
           const std::string& gemm, double flops, const Measured& m, int replays) {
    all_pass = all_pass && m.pass;
    const double med = m.us ? m.us->median : NAN;
    std::printf("  %-12s %-8s %10s %9s %9s %10.2e %s\n", instance.c_str(), gemm.c_str(), fixed(med, 1).c_str(),
                fixed(m.us ? m.us->p10 : NAN, 1).c_str(), fixed(flops > 0 ? flops / (med * 1e-6) / 1e12 : NAN, 1).c_str(),
                m.rel_error, m.pass ? "PASS" : "FAIL (not timed)");
    if (m.us && gemm == "w13+w2") {
      auto& b = best[{l.preset + " " + l.routing, c.tokens, form}];
      if (b.second.empty() || med < b.first) b = {med, instance};
    }
    std::ostringstream s;
    s << "{\"peer\": \"cutlass_grouped\", \"name\": " << cli::json_string("cutlass " + instance + " " + gemm)
      << ", \"instance\": " << cli::json_string(instance)
      << ", \"form\": " << cli::json_string(form) << ", \"token_tile\": " << token_tile
      << ", \"gemm\": " << cli::json_string(gemm) << ", \"preset\": " << cli::json_string(l.preset)
      << ", \"routing\": " << cli::json_string(l.routing) << ", \"tokens\": " << c.tokens
      << ", \"assignments\": " << c.rows << ", \"groups\": " << c.group_expert.size()
      << ", \"max_group_rows\": " << c.max_group_rows() << ", \"replays\": " << (m.us ? replays : 0)
      << ", \"us_median\": " << cli::json_number(med)
      << ", \"us_p10\": " << cli::json_number(m.us ? m.us->p10 : NAN)
      << ", \"us_p90\": " << cli::json_number(m.us ? m.us->p90 : NAN) << ", \"flops\": " << cli::json_number(flops)
      << ", \"tflops\": " << cli::json_number(flops / (med * 1e-6) / 1e12)
      << ", \"rel_error\": " << cli::json_number(m.rel_error) << ", \"check\": \"" << (m.pass ? "PASS" : "FAIL")
      << "\"}";
    rows.push_back(s.str());
    std::fflush(stdout);
  }

  void print_summary() const {
    std::printf("\nCUTLASS gate/up + down (w13+w2), fastest instance, median us:\n");
    for (const auto& [key, value] : best)
      std::printf("  %-32s tokens %5lld  %-6s %9.1f  (%s)\n", std::get<0>(key).c_str(), (long long)std::get<1>(key),
                  std::get<2>(key).c_str(), value.first, value.second.c_str());
  }
};

// Every selected instance on one case: w13, w2 and both, each checked and then timed; for the
// affine form also the bias term's two kernels alone (what an epilogue-fused bias would save).
void run_case(const LayerWeights& l, const Case& c, const std::vector<const Instance*>& selected, const Options& o,
              cudaStream_t stream, const DeviceBuffer& flush, Report& report) {
  CaseBuffers b(l, c, stream);
  const double flops13 = 2.0 * c.rows * l.w13.n * l.w13.k, flops2 = 2.0 * c.rows * l.w2.n * l.w2.k;
  const size_t out13 = size_t(c.rows) * l.w13.n, out2 = size_t(c.rows) * l.w2.n;
  std::printf("\n%s %s, tokens %lld: %d rows in %zu groups (largest %d)\n", l.preset.c_str(), l.routing.c_str(),
              (long long)c.tokens, c.rows, c.group_expert.size(), c.max_group_rows());
  std::printf("  %-12s %-8s %10s %9s %9s %10s %s\n", "instance", "gemm", "median us", "p10", "TFLOP/s", "rel error",
              "check");
  bool bias_timed = false;
  for (const Instance* inst : selected) {
    const bool affine = inst->form == QuantForm::affine;
    std::vector<std::unique_ptr<PeerGemm>> g13, g2;
    for (int copy = 0; copy < kWeightCopies; ++copy) {
      g13.push_back(inst->make());
      g13.back()->prepare(make_problem(l.w13, c, copy, inst->form, c.x13.ptr, b.c13.ptr, b.d13.ptr), affine, stream);
      g2.push_back(inst->make());
      g2.back()->prepare(make_problem(l.w2, c, copy, inst->form, b.act.ptr, b.c2.ptr, b.d2.ptr), affine, stream);
    }
    auto bias13 = [&](int copy) {
      group_sums(c.x13.as<uint16_t>(), c.rows, l.w13.k, l.group_size, b.sums13.as<float>(), stream);
      bias_term(b.sums13.as<float>(), c.expert_of_row.as<int32_t>(), l.w13.copies[copy].biases_t.as<uint16_t>(), c.rows,
                l.w13.n, l.w13.groups(), b.c13.as<uint16_t>(), stream);
    };
    auto bias2 = [&](int copy) {
      group_sums(b.act.as<uint16_t>(), c.rows, l.w2.k, l.group_size, b.sums2.as<float>(), stream);
      bias_term(b.sums2.as<float>(), c.expert_of_row.as<int32_t>(), l.w2.copies[copy].biases_t.as<uint16_t>(), c.rows,
                l.w2.n, l.w2.groups(), b.c2.as<uint16_t>(), stream);
    };
    auto w13 = [&](int copy) {
      if (affine) bias13(copy);
      g13[copy]->run(stream);
    };
    auto w2 = [&](int copy) {
      if (affine) bias2(copy);
      g2[copy]->run(stream);
    };
    auto reset13 = [&] { fill_nan(b.d13.as<uint16_t>(), out13, stream); };
    auto reset2 = [&] { fill_nan(b.d2.as<uint16_t>(), out2, stream); };
    auto err13 = [&] { return rel_error(b.d13.as<uint16_t>(), b.ref13[int(inst->form)].as<float>(), out13, stream); };
    auto err2 = [&] { return rel_error(b.d2.as<uint16_t>(), b.ref2[int(inst->form)].as<float>(), out2, stream); };
    auto worst = [](double a, double e) { return (a != a || e != e) ? NAN : std::max(a, e); };

    const Measured m13 = measure(stream, flush, o.replays, w13, reset13, err13);
    report.add(l, c, inst->name, form_name(inst->form), inst->token_tile, "w13", flops13, m13, o.replays);
    const Measured m2 = measure(stream, flush, o.replays, w2, reset2, err2);
    report.add(l, c, inst->name, form_name(inst->form), inst->token_tile, "w2", flops2, m2, o.replays);
    const Measured pair = measure(
        stream, flush, o.replays,
        [&](int copy) {
          w13(copy);
          w2(copy);
        },
        [&] {
          reset13();
          reset2();
        },
        [&] { return worst(err13(), err2()); });
    report.add(l, c, inst->name, form_name(inst->form), inst->token_tile, "w13+w2", flops13 + flops2, pair,
               o.replays);
    if (affine && !bias_timed && m13.pass && m2.pass) {
      // The bias kernels' output is inside the w13 and w2 results just checked: these rows carry
      // that check (the same kernels, the same inputs).
      bias_timed = true;
      Measured b13 = measure(stream, flush, o.replays, bias13, [] {}, [&] { return m13.rel_error; });
      report.add(l, c, "bias-term", "affine", 0, "w13-bias", 0, b13, o.replays);
      Measured b2 = measure(stream, flush, o.replays, bias2, [] {}, [&] { return m2.rel_error; });
      report.add(l, c, "bias-term", "affine", 0, "w2-bias", 0, b2, o.replays);
    }
  }
}

int run(int argc, char** argv) {
  const Options o = parse_options(argc, argv);
  int device = 0;
  EXPERTQMM_CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp prop{};
  EXPERTQMM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  EXPERTQMM_CHECK(prop.major == 9 && prop.minor == 0, "cutlass peer", "the kernels are sm_90a (Hopper) code; device ",
                  prop.name, " is sm_", prop.major, prop.minor);
  std::vector<const Instance*> selected;
  for (const Instance& inst : instances())
    if (o.instances.empty() || contains(o.instances, std::string(inst.name))) selected.push_back(&inst);

  cudaStream_t stream = nullptr;
  EXPERTQMM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const DeviceBuffer flush(timing::l2_flush_bytes());
  Report report;
  for (const std::string& dir : o.export_dirs) {
    std::fprintf(stderr, "loading and converting %s/weights.safetensors ...\n", dir.c_str());
    const LayerWeights layer = load_layer(dir);
    for (int64_t t : export_token_counts(dir)) {
      if (!o.tokens.empty() && !contains(o.tokens, t)) continue;
      run_case(layer, load_case(dir, t, layer), selected, o, stream, flush, report);
    }
  }
  EXPERTQMM_CUDA_CHECK(cudaStreamDestroy(stream));
  report.print_summary();

  if (!o.json_path.empty()) {
    std::ofstream f(o.json_path);
    EXPERTQMM_CHECK(f.good(), "cutlass peer", "cannot write --json file '", o.json_path, "'");
    f << "{\n  \"peer\": \"cutlass_grouped\",\n  \"commit\": " << cli::json_string(cli::commit_id())
      << ",\n  \"gpu\": " << cli::json_string(prop.name) << ",\n  \"date\": " << cli::json_string(cli::utc_now())
      << ",\n  \"cutlass\": " << cli::json_string(cutlass_version())
      << ",\n  \"kernel\": \"KernelPtrArrayTmaWarpSpecializedCooperative, tile 128 x token_tile x 64, cluster 1x1x1, "
         "bf16 x 4-bit with bf16 group scales, shuffled codes\""
      << ",\n  \"protocol\": {\"weight_copies\": " << kWeightCopies << ", \"l2_flush_bytes\": " << flush.bytes
      << ", \"replays\": " << o.replays << ", \"statistic\": \"median\", \"tolerance\": " << kTolerance << "}"
      << ",\n  \"rows\": [\n    ";
    for (size_t i = 0; i < report.rows.size(); ++i) f << (i ? ",\n    " : "") << report.rows[i];
    f << "\n  ]\n}\n";
    EXPERTQMM_CHECK(f.good(), "cutlass peer", "writing --json file '", o.json_path, "' failed");
  }
  if (!report.all_pass) std::fprintf(stderr, "cutlass peer: some results differ from the reference by more than %g\n", kTolerance);
  return report.all_pass ? 0 : 1;
}

}  // namespace

}  // namespace expertqmm::peer

int main(int argc, char** argv) {
  try {
    return expertqmm::peer::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "expertqmm_cutlass_peer: %s\n", e.what());
    return 1;
  }
}
