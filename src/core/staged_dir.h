// Writing a directory as one unit (the checkpoint writer). Everything goes into a fresh temporary
// directory next to the target and one rename() publishes it, so that a reader sees the old
// contents or the new, never a mix, and a failure at any point leaves the target as it was and no
// temporary behind. A lock file keeps a second writer of the same target out.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

namespace expertqmm::detail {

class StagedDir {
 public:
  // Takes the lock "<target>.lock" (flock; a second writer gets an Error at once, and a killed
  // writer's lock goes with its process), checks the target, removes what a killed writer left next
  // to it and creates the temporary directory. The target must be absent or an empty directory;
  // with `replace`, it may also be a directory of regular files that `replaceable(name)` accepts
  // (anything else in it is refused: --force must not delete what the writer did not write).
  StagedDir(const std::string& target, bool replace, const std::function<bool(const std::string&)>& replaceable,
            const char* op);
  // Unless published: removes the temporary directory and its files. Releases the lock.
  ~StagedDir();
  StagedDir(const StagedDir&) = delete;
  StagedDir& operator=(const StagedDir&) = delete;

  const std::string& path() const { return tmp_; }        // where to write
  const std::string& parent() const { return parent_; }   // the directory holding the target
  // fsync()s the temporary directory, renames an existing target away, renames the temporary
  // directory to the target, removes the old one and fsync()s the parent.
  void publish();

 private:
  std::string target_, parent_, name_, tmp_;
  const char* op_;
  int lock_fd_ = -1;
  std::string lock_path_;
  bool replacing_ = false;  // the target holds files that publish() replaces
  bool published_ = false;
};

// Bytes an unprivileged writer may still use on the filesystem holding `dir` (statvfs).
uint64_t free_bytes(const std::string& dir, const char* op);

// fsync() of an open file or directory; throws Error(op, "<path>: ...") on failure.
void sync_path(const std::string& path, const char* op);

}  // namespace expertqmm::detail
