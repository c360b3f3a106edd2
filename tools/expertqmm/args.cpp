#include <cstdlib>
#include <sstream>

#include "cli.h"
#include "expertqmm/error.h"

namespace expertqmm::cli {

Args::Args(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    EXPERTQMM_CHECK(a.rfind("--", 0) == 0, "cli", "unexpected argument '", a, "'");
    std::string key = a.substr(2), value;
    size_t eq = key.find('=');
    if (eq != std::string::npos) {
      value = key.substr(eq + 1);
      key = key.substr(0, eq);
    } else if (i + 1 < argc && std::string(argv[i + 1]).rfind("--", 0) != 0) {
      value = argv[++i];
    }
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

long Args::get_int(const std::string& key, long fallback) const {
  if (!has(key)) return fallback;
  std::string v = get(key);
  char* end = nullptr;
  long r = std::strtol(v.c_str(), &end, 10);
  EXPERTQMM_CHECK(end && *end == 0 && !v.empty(), "cli", "--", key, " expects an integer, got '", v, "'");
  return r;
}

std::vector<long> Args::get_int_list(const std::string& key, const std::vector<long>& fallback) const {
  if (!has(key)) return fallback;
  std::vector<long> out;
  std::stringstream ss(get(key));
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    long r = std::strtol(item.c_str(), &end, 10);
    EXPERTQMM_CHECK(end && *end == 0 && !item.empty(), "cli", "--", key, " expects integers, got '", item, "'");
    out.push_back(r);
  }
  return out;
}

void Args::check_known(const std::vector<std::string>& known) const {
  for (auto& kv : kv_) {
    bool ok = false;
    for (auto& k : known) ok = ok || k == kv.first;
    EXPERTQMM_CHECK(ok, "cli", "unknown option --", kv.first);
  }
}

}  // namespace expertqmm::cli
