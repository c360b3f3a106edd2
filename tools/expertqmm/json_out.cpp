// The bench commands' JSON helpers (`expertqmm bench`, `bench --model` and the peer programs under
// bench/peers): a writer small enough to read.
#include <cstdio>
#include <ctime>

#include "core/settings.h"
#include "json_out.h"

namespace expertqmm::cli {

std::string json_string(const std::string& s) {
  std::string r = "\"";
  for (char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      r += '\\';
      r += ch;
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\u%04x", c);
      r += buf;
    } else {
      r += ch;
    }
  }
  return r + "\"";
}

std::string json_number(double v) {
  if (!(v == v) || v > 1e300 || v < -1e300) return "null";  // JSON has no NaN / Inf
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string utc_now() {
  std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string commit_id() {
  if (const auto env = detail::environment_variable("EXPERTQMM_COMMIT"))
    if (!env->empty()) return *env;
  std::string out;
  if (FILE* p = popen("git rev-parse --verify -q HEAD 2>/dev/null", "r")) {
    char buf[128];
    while (std::fgets(buf, sizeof(buf), p)) out += buf;
    pclose(p);
  }
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out.empty() ? "unknown" : out;
}

}  // namespace expertqmm::cli
