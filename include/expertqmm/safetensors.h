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
  // Throws when the file has shrunk below the tensor's end since open(): the file must not be
  // truncated or rewritten in place while it is mapped (replacing it by rename is safe), as reading
  // a mapped page past the end of a file kills the process with SIGBUS; this check narrows that
  // window to the time between get() and the reads, it cannot close it.
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
  // Throws unless the file still holds data section bytes [0, end).
  void check_size(size_t end) const;

  std::string path_;
  std::shared_ptr<void> mapping_;  // owns the mmap and the descriptor (closed on release)
  const unsigned char* data_ = nullptr;  // start of the data section
  uint64_t data_offset_ = 0;             // its offset in the file
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
