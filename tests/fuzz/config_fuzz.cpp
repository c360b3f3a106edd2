// libFuzzer target for config.json (parse_gemma4_config): the strict JSON parser under it, then the
// range checks of every size and count and the quantization table. Any expertqmm::Error is an
// accepted outcome; a crash, a sanitizer report (a narrowing or overflow included) or another
// exception is a bug. A parsed config is also written back and parsed again: it must round-trip.
// Run: expertqmm_config_fuzz <corpus dir> tests/fuzz/corpus/config
#include <cstdint>
#include <string>

#include "expertqmm/checkpoint.h"
#include "expertqmm/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  expertqmm::Gemma4Config c;
  try {
    c = expertqmm::parse_gemma4_config(text, "config.json");
  } catch (const expertqmm::Error&) {
    return 0;
  }
  const expertqmm::Gemma4Config back = expertqmm::parse_gemma4_config(c.to_json(), "round-trip.json");
  if (back.num_hidden_layers != c.num_hidden_layers || back.hidden_size != c.hidden_size ||
      back.num_experts != c.num_experts || back.overrides.size() != c.overrides.size() || back.family != c.family ||
      back.top_k_experts != c.top_k_experts || back.norm_topk_prob != c.norm_topk_prob)
    __builtin_trap();
  return 0;
}
