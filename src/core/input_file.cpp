#include "core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "expertqmm/error.h"

namespace expertqmm::detail {

const char* file_kind(unsigned mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

InputFile::InputFile(const std::string& path, const char* op) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd_ < 0) throw Error(op, path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd_);
    throw Error(op, path + ": cannot stat: " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw Error(op, path + ": is " + file_kind(st.st_mode) + ", not a file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

InputFile::~InputFile() {
  if (fd_ >= 0) ::close(fd_);
}

int InputFile::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

std::string read_input_file(const std::string& path, const char* op, uint64_t max_bytes) {
  const InputFile f(path, op);
  if (f.size() > max_bytes)
    throw Error(op, detail::cat(path, ": is ", f.size(), " bytes; a file here is at most ", max_bytes));
  std::string text(static_cast<size_t>(f.size()), '\0');
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t got = ::read(f.fd(), &text[done], text.size() - done);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) throw Error(op, path + ": read failed: " + std::strerror(errno));
    if (got == 0) throw Error(op, detail::cat(path, ": shrank to ", done, " bytes while being read"));
    done += static_cast<size_t>(got);
  }
  return text;
}

}  // namespace expertqmm::detail
