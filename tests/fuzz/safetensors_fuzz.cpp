// libFuzzer target for the untrusted-input path: the strict JSON parser and SafetensorsFile::open.
// Each input is tried three ways: as a JSON text, as a whole .safetensors file, and as the header
// of a file (length prefix and 256 data bytes added) so the fuzzer reaches header validation fast.
// Any expertqmm::Error is an accepted outcome; a crash, a sanitizer report or another exception is
// a bug. Run: expertqmm_safetensors_fuzz -max_len=65536 <corpus dir> tests/golden
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "core/json.h"
#include "expertqmm/error.h"
#include "expertqmm/safetensors.h"

namespace {

// One memory-backed file reused by every run; open() reaches it through /proc/self/fd.
const std::string& scratch_path(int* fd_out) {
  static int fd = ::memfd_create("expertqmm_safetensors_fuzz", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  *fd_out = fd;
  return path;
}

void write_scratch(const std::string& bytes) {
  int fd;
  scratch_path(&fd);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) __builtin_trap();
  if (!bytes.empty() && ::pwrite(fd, bytes.data(), bytes.size(), 0) != static_cast<ssize_t>(bytes.size()))
    __builtin_trap();
}

// Opens the scratch file and reads every byte of every tensor, so an out-of-range view is caught.
void open_and_touch() {
  int fd;
  const std::string& path = scratch_path(&fd);
  try {
    const expertqmm::SafetensorsFile f = expertqmm::SafetensorsFile::open(path);
    uint8_t sum = 0;
    for (const std::string& name : f.names()) {
      const expertqmm::Tensor t = f.get(name);
      const uint8_t* p = static_cast<const uint8_t*>(t.data());
      for (size_t i = 0; i < t.nbytes(); ++i) sum = static_cast<uint8_t>(sum + p[i]);
    }
    for (const auto& kv : f.metadata()) sum = static_cast<uint8_t>(sum + kv.first.size() + kv.second.size());
    volatile uint8_t sink = sum;
    (void)sink;
  } catch (const expertqmm::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  try {
    expertqmm::json::parse(input);
  } catch (const expertqmm::Error&) {
  }
  write_scratch(input);
  open_and_touch();
  std::string file(8, '\0');
  const uint64_t header_len = size;
  std::memcpy(file.data(), &header_len, 8);
  write_scratch(file + input + std::string(256, '\x5a'));
  open_and_touch();
  return 0;
}
