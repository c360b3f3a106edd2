// Reading an `expertqmm bench` export and preparing it for the CUTLASS instances (layer_data.h).
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>

#include "expertqmm/error.h"
#include "expertqmm/safetensors.h"
#include "kernels.h"
#include "layer_data.h"

namespace expertqmm::peer {

namespace {

int metadata_int(const SafetensorsFile& f, const std::string& key) {
  const auto& m = f.metadata();
  const auto it = m.find(key);
  EXPERTQMM_CHECK(it != m.end(), "cutlass peer", f.path(), ": metadata has no '", key, "'");
  return std::stoi(it->second);
}

std::string metadata_string(const SafetensorsFile& f, const std::string& key) {
  const auto it = f.metadata().find(key);
  return it == f.metadata().end() ? std::string() : it->second;
}

// Uploads [experts, rows_p, cols] tensors as one [experts, sum rows_p, cols] device array (the
// parts' rows one after another within each expert: gate rows before up rows).
DeviceBuffer upload_expert_rows(const std::vector<Tensor>& parts, int experts) {
  size_t per_expert = 0;
  for (const Tensor& t : parts) per_expert += t.nbytes() / experts;
  DeviceBuffer d(per_expert * experts);
  for (int e = 0; e < experts; ++e) {
    size_t offset = e * per_expert;
    for (const Tensor& t : parts) {
      const size_t part = t.nbytes() / experts;
      EXPERTQMM_CUDA_CHECK(cudaMemcpy(static_cast<char*>(d.ptr) + offset, static_cast<const char*>(t.data()) + e * part,
                                      part, cudaMemcpyHostToDevice));
      offset += part;
    }
  }
  return d;
}

DeviceBuffer device_copy(const DeviceBuffer& src) {
  DeviceBuffer d(src.bytes);
  EXPERTQMM_CUDA_CHECK(cudaMemcpy(d.ptr, src.ptr, src.bytes, cudaMemcpyDeviceToDevice));
  return d;
}

// Converts the MLX layout once (copy 0), then makes the other copies on the device.
void prepare_copies(GemmWeights& g) {
  GemmWeights::Copy c0;
  const size_t expert_bytes = g.code_bytes_per_expert();
  c0.codes_unsigned = DeviceBuffer(expert_bytes * g.experts);
  for (int e = 0; e < g.experts; ++e)
    reorder_codes(g.mlx_codes.as<char>() + e * expert_bytes, c0.codes_unsigned.as<char>() + e * expert_bytes, g.n, g.k);
  c0.codes_signed = device_copy(c0.codes_unsigned);
  flip_code_sign(c0.codes_signed.as<uint32_t>(), c0.codes_signed.bytes / 4, nullptr);
  c0.scales_t = DeviceBuffer(g.mlx_scales.bytes);
  c0.biases_t = DeviceBuffer(g.mlx_biases.bytes);
  transpose_groups(g.mlx_scales.as<uint16_t>(), c0.scales_t.as<uint16_t>(), g.experts, g.n, g.groups(), nullptr);
  transpose_groups(g.mlx_biases.as<uint16_t>(), c0.biases_t.as<uint16_t>(), g.experts, g.n, g.groups(), nullptr);
  EXPERTQMM_CUDA_CHECK(cudaDeviceSynchronize());
  g.copies.push_back(std::move(c0));
  for (int c = 1; c < kWeightCopies; ++c) {
    GemmWeights::Copy copy;
    copy.codes_unsigned = device_copy(g.copies[0].codes_unsigned);
    copy.codes_signed = device_copy(g.copies[0].codes_signed);
    copy.scales_t = device_copy(g.copies[0].scales_t);
    copy.biases_t = device_copy(g.copies[0].biases_t);
    g.copies.push_back(std::move(copy));
  }
}

// One GEMM from its MLX tensors: `prefixes` are the projections whose rows it stacks.
GemmWeights load_gemm(const SafetensorsFile& f, const std::string& name, const std::vector<std::string>& prefixes,
                      int experts, int k, int group_size) {
  GemmWeights g;
  g.name = name;
  g.experts = experts;
  g.k = k;
  g.group_size = group_size;
  std::vector<Tensor> codes, scales, biases;
  for (const std::string& p : prefixes) {
    const std::string base = "switch_glu." + p;
    EXPERTQMM_CHECK(f.has(base + ".weight") && f.has(base + ".scales") && f.has(base + ".biases"), "cutlass peer",
                    f.path(), ": needs ", base, ".{weight,scales,biases} (4-bit affine experts)");
    codes.push_back(f.get(base + ".weight"));
    scales.push_back(f.get(base + ".scales"));
    biases.push_back(f.get(base + ".biases"));
    const Shape& s = codes.back().shape();
    EXPERTQMM_CHECK(codes.back().dtype() == DType::u32 && s.size() == 3 && s[0] == experts && s[2] * 8 == k &&
                        scales.back().dtype() == DType::bf16 && biases.back().dtype() == DType::bf16 &&
                        scales.back().numel() == s[0] * s[1] * (k / group_size) &&
                        biases.back().numel() == scales.back().numel(),
                    "cutlass peer", f.path(), ": ", base, " is not a 4-bit affine [", experts, ", N, ", k,
                    "] weight with bf16 scales and biases of group ", group_size);
    g.n += int(s[1]);
  }
  g.mlx_codes = upload_expert_rows(codes, experts);
  g.mlx_scales = upload_expert_rows(scales, experts);
  g.mlx_biases = upload_expert_rows(biases, experts);
  prepare_copies(g);
  return g;
}

}  // namespace

LayerWeights load_layer(const std::string& export_dir) {
  const SafetensorsFile f = SafetensorsFile::open(export_dir + "/weights.safetensors");
  LayerWeights l;
  l.preset = metadata_string(f, "preset");
  l.routing = metadata_string(f, "routing");
  l.experts = metadata_int(f, "experts");
  l.top_k = metadata_int(f, "top_k");
  l.hidden = metadata_int(f, "hidden");
  l.intermediate = metadata_int(f, "intermediate");
  l.group_size = metadata_int(f, "group_size");
  const std::string mode = metadata_string(f, "mode");
  const std::string activation = metadata_string(f, "activation");
  EXPERTQMM_CHECK(metadata_int(f, "bits") == 4 && (mode.empty() || mode == "affine") &&
                      (activation == "geglu" || activation == "swiglu"),
                  "cutlass peer", f.path(), ": the peer runs 4-bit affine GeGLU or SwiGLU experts; this export has bits=",
                  metadata_int(f, "bits"), " mode=", mode, " activation=", activation);
  l.swiglu = activation == "swiglu";
  const bool fused = metadata_string(f, "fused_gate_up") == "1";
  l.w13 = load_gemm(f, "w13", fused ? std::vector<std::string>{"gate_up_proj"}
                                    : std::vector<std::string>{"gate_proj", "up_proj"},
                    l.experts, l.hidden, l.group_size);
  l.w2 = load_gemm(f, "w2", {"down_proj"}, l.experts, l.intermediate, l.group_size);
  EXPERTQMM_CHECK(l.w13.n == 2 * l.intermediate && l.w2.n == l.hidden, "cutlass peer", f.path(),
                  ": gate/up have ", l.w13.n, " rows and down ", l.w2.n, "; expected ", 2 * l.intermediate, " and ",
                  l.hidden);
  return l;
}

std::vector<int64_t> export_token_counts(const std::string& export_dir) {
  std::vector<int64_t> counts;
  for (const auto& entry : std::filesystem::directory_iterator(export_dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("case_T", 0) == 0 && name.size() > 18 && name.substr(name.size() - 12) == ".safetensors")
      counts.push_back(std::stoll(name.substr(6, name.size() - 18)));
  }
  std::sort(counts.begin(), counts.end());
  return counts;
}

int Case::max_group_rows() const { return group_rows.empty() ? 0 : *std::max_element(group_rows.begin(), group_rows.end()); }

Case load_case(const std::string& export_dir, int64_t tokens, const LayerWeights& layer) {
  const std::string path = export_dir + "/case_T" + std::to_string(tokens) + ".safetensors";
  const SafetensorsFile f = SafetensorsFile::open(path);
  const Tensor x = f.get("x"), indices = f.get("indices");
  const int k = layer.top_k, h = layer.hidden;
  const Shape x_shape{tokens, h}, indices_shape{tokens, k};
  EXPERTQMM_CHECK(x.dtype() == DType::bf16 && x.shape() == x_shape && indices.dtype() == DType::i32 &&
                      indices.shape() == indices_shape,
                  "cutlass peer", path, ": needs x bf16 [", tokens, ", ", h, "] and indices int32 [", tokens, ", ", k,
                  "]");
  Case c;
  c.tokens = tokens;
  c.rows = int(tokens * k);
  const int32_t* ids = indices.data_as<int32_t>();
  for (int i = 0; i < c.rows; ++i)
    EXPERTQMM_CHECK(ids[i] >= 0 && ids[i] < layer.experts, "cutlass peer", path, ": expert id ", ids[i], " at ", i,
                    " is outside [0, ", layer.experts, ")");
  std::vector<int> order(c.rows);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return ids[a] < ids[b]; });
  std::vector<uint16_t> x13(size_t(c.rows) * h);
  std::vector<int32_t> expert_of_row(c.rows);
  const uint16_t* xs = x.data_as<uint16_t>();
  for (int r = 0; r < c.rows; ++r) {
    const int flat = order[r], e = ids[flat];
    std::memcpy(&x13[size_t(r) * h], xs + size_t(flat / k) * h, size_t(h) * 2);
    expert_of_row[r] = e;
    if (c.group_expert.empty() || c.group_expert.back() != e) {
      c.group_expert.push_back(e);
      c.group_rows.push_back(0);
      c.group_first_row.push_back(r);
    }
    ++c.group_rows.back();
  }
  c.x13 = upload(x13);
  c.expert_of_row = upload(expert_of_row);
  return c;
}

}  // namespace expertqmm::peer
