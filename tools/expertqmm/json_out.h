// The bench commands' JSON helpers (json_out.cpp).
#pragma once
#include <string>

namespace expertqmm::cli {

// A quoted, escaped JSON string.
std::string json_string(const std::string& s);
// A JSON number (%.6g), or null for NaN and infinities (JSON has neither).
std::string json_number(double v);
// Now, as "YYYY-MM-DDTHH:MM:SSZ".
std::string utc_now();
// The commit the results belong to (EXPERTQMM_COMMIT, else git HEAD, else "unknown").
std::string commit_id();

}  // namespace expertqmm::cli
