#include "support/golden.h"

#include <cstdlib>
#include <cstring>
#include <iomanip>
#include <sstream>
#include <sys/stat.h>

#include "core/settings.h"
#include "expertqmm/error.h"

namespace expertqmm::test {

std::string golden_dir() {
  if (const auto env = expertqmm::detail::environment_variable("EXPERTQMM_GOLDEN_DIR"); env && !env->empty()) return *env;
  return EXPERTQMM_GOLDEN_DIR;
}

void open_golden(const std::string& file, SafetensorsFile* out) {
  const std::string path = golden_dir() + "/" + file;
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0) << "golden file missing: " << path
                                          << " (regenerate with tests/golden/regen.sh)";
  try {
    *out = SafetensorsFile::open(path);
  } catch (const Error& e) {
    FAIL() << "golden file unreadable: " << e.what();
  }
}

void golden_tensor(const SafetensorsFile& f, const std::string& name, Tensor* out) {
  ASSERT_TRUE(f.has(name)) << f.path() << " has no tensor '" << name << "'";
  *out = f.get(name);
}

int GoldenCase::int_param(const std::string& key) const {
  auto it = params.find(key);
  if (it == params.end()) throw Error("golden", "case '" + name + "' has no parameter '" + key + "'");
  return std::stoi(it->second);
}

std::vector<GoldenCase> golden_cases(const SafetensorsFile& f) {
  std::vector<GoldenCase> cases;
  const std::string prefix = "case.";
  for (const auto& [key, value] : f.metadata()) {
    if (key.compare(0, prefix.size(), prefix) != 0) continue;
    GoldenCase c;
    c.name = key.substr(prefix.size());
    std::istringstream in(value);
    std::string item;
    while (in >> item) {
      const size_t eq = item.find('=');
      if (eq == std::string::npos) throw Error("golden", "malformed parameter '" + item + "' in " + key);
      c.params[item.substr(0, eq)] = item.substr(eq + 1);
    }
    cases.push_back(std::move(c));
  }
  return cases;
}

std::string bitwise_difference(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape())
    return "different tensors: " + a.describe() + " vs " + b.describe();
  const std::vector<uint8_t> x = a.to_host_bytes(), y = b.to_host_bytes();
  const size_t es = dtype_size(a.dtype());
  for (size_t i = 0; i < x.size(); i += es) {
    if (std::memcmp(x.data() + i, y.data() + i, es) == 0) continue;
    uint32_t u = 0, v = 0;
    std::memcpy(&u, x.data() + i, es);
    std::memcpy(&v, y.data() + i, es);
    std::ostringstream o;
    o << "first difference at flat index " << i / es << " of " << dtype_name(a.dtype()) << shape_str(a.shape())
      << ": 0x" << std::hex << std::setfill('0') << std::setw(static_cast<int>(2 * es)) << u << " vs 0x"
      << std::setw(static_cast<int>(2 * es)) << v;
    return o.str();
  }
  return "";
}

}  // namespace expertqmm::test
