#include <sstream>

#include "cli.h"
#include "expertqmm/error.h"

namespace expertqmm::cli {

namespace {

// A decimal integer with an optional '-', nothing else (no spaces, '+', hex or suffix); false when
// it is not one or does not fit in int64.
bool parse_int64(const std::string& s, int64_t* out) {
  size_t i = s.size() > 1 && s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  int64_t v = 0;
  for (; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') return false;
    const int64_t d = s[i] - '0';
    if (__builtin_mul_overflow(v, int64_t(10), &v) || __builtin_add_overflow(v, s[0] == '-' ? -d : d, &v))
      return false;
  }
  *out = v;
  return true;
}

std::string or_list(const std::vector<std::string>& choices) {
  std::string s;
  for (size_t i = 0; i < choices.size(); ++i)
    s += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i];
  return s;
}

int64_t checked_int(const std::string& key, const std::string& v, int64_t lo, int64_t hi, const char* what) {
  int64_t r = 0;
  if (!parse_int64(v, &r) || r < lo || r > hi)
    usage_error(detail::cat("--", key, what, " must be an integer in [", lo, ", ", hi, "], got '", v, "'"));
  return r;
}

}  // namespace

void usage_error(const std::string& what) { throw UsageError(what); }

Args::Args(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0 || a.size() == 2) usage_error("unexpected argument '" + a + "'");
    std::string key = a.substr(2), value;
    size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      value = argv[++i];
    }
    if (has(key)) usage_error("--" + key + " is given twice");
    kv_.emplace_back(key, value);
  }
}

bool Args::has(const std::string& key) const {
  for (auto& kv : kv_)
    if (kv.first == key) return true;
  return false;
}

std::string Args::get(const std::string& key, const std::string& fallback) const {
  for (auto& kv : kv_)
    if (kv.first == key) return kv.second;
  return fallback;
}

std::string Args::get_required(const std::string& key, const char* value_name) const {
  const std::string v = get(key);
  if (v.empty()) usage_error(detail::cat("--", key, " ", value_name, " is required"));
  return v;
}

std::string Args::get_optional(const std::string& key, const char* value_name) const {
  const std::string v = get(key);
  if (has(key) && v.empty()) usage_error(detail::cat("--", key, " needs ", value_name));
  return v;
}

int64_t Args::get_int(const std::string& key, int64_t fallback, int64_t lo, int64_t hi) const {
  return has(key) ? checked_int(key, get(key), lo, hi, "") : fallback;
}

std::vector<int64_t> Args::get_int_list(const std::string& key, const std::vector<int64_t>& fallback, int64_t lo,
                                        int64_t hi) const {
  if (!has(key)) return fallback;
  std::vector<int64_t> out;
  std::stringstream ss(get(key));
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(checked_int(key, item, lo, hi, ": every value"));
  if (out.empty()) usage_error("--" + key + " needs at least one value");
  return out;
}

std::string Args::get_choice(const std::string& key, const std::string& fallback,
                             const std::vector<std::string>& choices) const {
  const std::string v = get(key, fallback);
  for (const std::string& c : choices)
    if (v == c) return v;
  usage_error("--" + key + " expects " + or_list(choices) + ", got '" + v + "'");
}

bool Args::get_flag(const std::string& key) const {
  if (!has(key)) return false;
  if (!get(key).empty()) usage_error("--" + key + " takes no value, got '" + get(key) + "'");
  return true;
}

void Args::check_known(const std::vector<std::string>& known) const {
  for (auto& kv : kv_) {
    bool ok = false;
    for (auto& k : known) ok = ok || k == kv.first;
    if (!ok) usage_error("unknown option --" + kv.first + " (see --help)");
  }
}

}  // namespace expertqmm::cli
