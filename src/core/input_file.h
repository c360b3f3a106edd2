// Opening untrusted input files (checkpoints, their JSON): a FIFO, a device or a directory in place
// of a file is an error naming what it is, never a blocked open() or a bogus size, and every failure
// names the path and the reason (strerror).
#pragma once
#include <cstdint>
#include <string>

namespace expertqmm::detail {

// A read-only descriptor of a regular file, closed on destruction.
class InputFile {
 public:
  // Opens with O_NONBLOCK (a FIFO opens at once instead of waiting for a writer) and fstat()s the
  // descriptor: throws Error(op, "<path>: cannot open: <reason>") or Error(op, "<path>: is a
  // directory, not a file") and the like.
  InputFile(const std::string& path, const char* op);
  ~InputFile();
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }
  // Hands the descriptor over (the caller closes it).
  int release();

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The whole file, which must be at most `max_bytes` long.
std::string read_input_file(const std::string& path, const char* op, uint64_t max_bytes);

// "a directory", "a FIFO", ... for a st_mode that is not a regular file.
const char* file_kind(unsigned mode);

}  // namespace expertqmm::detail
