// Reading and writing .safetensors checkpoints (the format MLX and Hugging Face use).
// Files are untrusted input: a malformed file gives expertqmm::Error("safetensors",
// "<path>: ...") naming the tensor where there is one, never a crash or an out-of-bounds read.
// Supported dtypes: BF16, F16, F32, U32, I32. Little-endian hosts only (as the format).
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "expertqmm/tensor.h"

namespace expertqmm {

class SafetensorsFile {
 public:
  // Maps the file read-only (POSIX mmap) and validates the whole header up front.
  static SafetensorsFile open(const std::string& path);

  // Tensor names in lexicographic order.
  const std::vector<std::string>& names() const { return names_; }
  bool has(const std::string& name) const { return entries_.count(name) != 0; }
  // A CPU view into the mapping (no copy) that keeps the mapping alive after this object is gone.
  // Only a tensor whose offset is not a multiple of its element size is copied, to stay aligned.
  Tensor get(const std::string& name) const;
  // The "__metadata__" string map (empty when absent).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }

 private:
  struct Entry {
    DType dtype;
    Shape shape;
    size_t begin = 0, end = 0;  // byte range inside the data section
  };
  std::string path_;
  std::shared_ptr<void> mapping_;  // owns the mmap (munmap on release)
  const unsigned char* data_ = nullptr;  // start of the data section
  std::map<std::string, Entry> entries_;
  std::vector<std::string> names_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` in the given order (any device, any strides; written row-major) with the
// optional string metadata. Names must be unique, non-empty, valid UTF-8 and not "__metadata__".
// Writes to "<path>.tmp" and renames, so a failed write never leaves a truncated file at `path`.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

}  // namespace expertqmm
