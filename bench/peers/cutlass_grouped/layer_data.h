// What the peer reads from an `expertqmm bench --export-dir` directory and prepares on the device:
// the layer's two GEMMs' weights (MLX layout for the reference, converted for CUTLASS, 4 copies)
// and, per case, the routing the layer computed, sorted by expert into groups.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "device_upload.h"
#include "peer_gemm.h"

namespace expertqmm::peer {

constexpr int kWeightCopies = 4;  // distinct weight copies replayed round robin (the protocol's)

// One GEMM of the layer over all experts: W [experts, n, k], 4-bit affine, MLX layout.
struct GemmWeights {
  std::string name;  // "w13" (gate and up as one [E, 2I, H]) or "w2" (down [E, H, I])
  int experts = 0, n = 0, k = 0, group_size = 0;
  DeviceBuffer mlx_codes, mlx_scales, mlx_biases;  // uint32 [E, n, k/8]; bf16 [E, n, k/g]
  struct Copy {
    DeviceBuffer codes_unsigned;  // reordered MLX codes q (the affine form)
    DeviceBuffer codes_signed;    // reordered q - 8 as int4 (the scale form)
    DeviceBuffer scales_t, biases_t;  // bf16 [E, k/g, n]
  };
  std::vector<Copy> copies;
  int groups() const { return k / group_size; }
  size_t code_bytes_per_expert() const { return size_t(n) * k / 2; }
};

struct LayerWeights {
  std::string preset, routing;
  int experts = 0, top_k = 0, hidden = 0, intermediate = 0, group_size = 0;
  bool swiglu = false;  // the GLU between the GEMMs (GeGLU otherwise)
  GemmWeights w13, w2;
};

// Reads DIR/weights.safetensors (4-bit affine GeGLU or SwiGLU experts; anything else is an error)
// and prepares both GEMMs.
LayerWeights load_layer(const std::string& export_dir);

// One token count of the export (DIR/case_T<T>.safetensors): rows sorted by expert (a stable sort
// of the flat expert ids, as the layer's gather_sort), groups = the experts hit in ascending order.
struct Case {
  int64_t tokens = 0;
  int rows = 0;                      // tokens * top_k
  std::vector<int> group_expert, group_rows, group_first_row;
  DeviceBuffer x13;                  // bf16 [rows, hidden]: the gathered token rows
  DeviceBuffer expert_of_row;        // int32 [rows]
  int max_group_rows() const;
};

// The token counts DIR holds (case_T*.safetensors), ascending.
std::vector<int64_t> export_token_counts(const std::string& export_dir);
Case load_case(const std::string& export_dir, int64_t tokens, const LayerWeights& layer);

}  // namespace expertqmm::peer
