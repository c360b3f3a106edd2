// Used only when no {fmt} headers are found: MLX's CUDA headers (lru_cache.h) include
// <fmt/format.h>, which the mlx wheel does not ship, for an error message inside a template member
// the primitives never instantiate. Declared, not defined: a use would fail to link, not misbehave.
#pragma once
#include <string>

namespace fmt {
template <class... Args>
std::string format(const char* pattern, Args&&... args);
}  // namespace fmt
