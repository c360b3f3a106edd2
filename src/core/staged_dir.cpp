#include "core/staged_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "core/input_file.h"
#include "expertqmm/error.h"

namespace expertqmm::detail {

namespace {

std::string errno_text() { return std::strerror(errno); }

// Entry names of `dir` without "." and ".."; empty when it cannot be listed.
std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> names;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d))
      if (std::strcmp(e->d_name, ".") != 0 && std::strcmp(e->d_name, "..") != 0) names.push_back(e->d_name);
    ::closedir(d);
  }
  return names;
}

// Removes a directory of files (the writer never makes subdirectories); best effort, as it runs on
// failure paths and for leftovers, where a second error would hide the first.
void remove_flat_dir(const std::string& dir) {
  for (const std::string& n : list_dir(dir)) ::unlink((dir + "/" + n).c_str());
  ::rmdir(dir.c_str());
}

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

// "<parent>/.<name>.<kind>-<unique>", created (kind "tmp") or only named (kind "old": rename's target).
std::string unique_sibling(const std::string& parent, const std::string& name, const char* kind, bool create,
                           const char* op) {
  static unsigned counter = 0;
  for (int attempt = 0; attempt < 100; ++attempt) {
    const auto tick = std::chrono::steady_clock::now().time_since_epoch().count();
    const std::string p = detail::cat(parent, "/.", name, ".", kind, "-", ::getpid(), "-", counter++, "-",
                                      static_cast<unsigned long long>(tick) % 1000000007ull);
    struct stat st;
    if (!create) {
      if (::lstat(p.c_str(), &st) != 0 && errno == ENOENT) return p;
      continue;
    }
    if (::mkdir(p.c_str(), 0777) == 0) return p;  // the umask applies, as to any directory the user makes
    if (errno != EEXIST) throw Error(op, p + ": cannot create the temporary directory: " + errno_text());
  }
  throw Error(op, parent + ": cannot find a free name for a temporary directory");
}

}  // namespace

void sync_path(const std::string& path, const char* op) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw Error(op, path + ": cannot open to sync: " + errno_text());
  const bool ok = ::fsync(fd) == 0 || errno == EINVAL;  // EINVAL: a filesystem without fsync
  const std::string why = ok ? "" : errno_text();
  ::close(fd);
  if (!ok) throw Error(op, path + ": fsync failed: " + why);
}

uint64_t free_bytes(const std::string& dir, const char* op) {
  struct statvfs vfs;
  if (::statvfs(dir.c_str(), &vfs) != 0) throw Error(op, dir + ": cannot read the free space: " + errno_text());
  return uint64_t(vfs.f_bavail) * uint64_t(vfs.f_frsize);
}

StagedDir::StagedDir(const std::string& target, bool replace,
                     const std::function<bool(const std::string&)>& replaceable, const char* op)
    : op_(op) {
  target_ = target;
  while (target_.size() > 1 && target_.back() == '/') target_.pop_back();
  const size_t slash = target_.rfind('/');
  name_ = slash == std::string::npos ? target_ : target_.substr(slash + 1);
  parent_ = slash == std::string::npos ? "." : slash == 0 ? "/" : target_.substr(0, slash);
  if (name_.empty() || name_ == "." || name_ == ".." || name_ == "/")
    throw Error(op, "'" + target + "': name the output directory itself (not '.', '..' or '/')");
  struct stat st;
  if (::stat(parent_.c_str(), &st) != 0) throw Error(op, parent_ + ": cannot use as the parent: " + errno_text());
  if (!S_ISDIR(st.st_mode)) throw Error(op, parent_ + ": is " + file_kind(st.st_mode) + ", not a directory");

  // The lock. flock() locks belong to the open file, so a writer that dies releases its lock; the
  // file is unlinked by the writer holding it, so a lock taken on a file already unlinked (or
  // replaced) is retried on the file now at the path.
  lock_path_ = target_ + ".lock";
  for (;;) {
    lock_fd_ = ::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (lock_fd_ < 0) throw Error(op, lock_path_ + ": cannot create the lock file: " + errno_text());
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      const bool busy = errno == EWOULDBLOCK;
      const std::string why = errno_text();
      ::close(lock_fd_);
      lock_fd_ = -1;
      if (busy) throw Error(op, target_ + ": another writer is writing it (" + lock_path_ + " is locked)");
      throw Error(op, lock_path_ + ": cannot lock: " + why);
    }
    struct stat held, now;
    if (::fstat(lock_fd_, &held) == 0 && ::stat(lock_path_.c_str(), &now) == 0 && held.st_ino == now.st_ino &&
        held.st_dev == now.st_dev)
      break;
    ::close(lock_fd_);
    lock_fd_ = -1;
  }

  try {
    if (::lstat(target_.c_str(), &st) == 0) {
      if (S_ISLNK(st.st_mode))
        throw Error(op, target_ + ": is a symbolic link; give the directory itself (publishing replaces the path)");
      if (!S_ISDIR(st.st_mode)) throw Error(op, target_ + ": exists and is " + file_kind(st.st_mode) + ", not a directory");
      const std::vector<std::string> present = list_dir(target_);
      if (!present.empty() && !replace)
        throw Error(op, detail::cat(target_, ": exists and is not empty (", present.size(),
                                    " entries); refusing to replace it without force (CLI: --force)"));
      for (const std::string& n : present) {
        struct stat f;
        if (::lstat((target_ + "/" + n).c_str(), &f) != 0 || !S_ISREG(f.st_mode) || !replaceable(n))
          throw Error(op, target_ + ": holds '" + n + "', which a checkpoint does not; refusing to delete it (" +
                              "remove it yourself or write elsewhere)");
      }
      replacing_ = !present.empty();
    } else if (errno != ENOENT) {
      throw Error(op, target_ + ": cannot stat: " + errno_text());
    }
    // What a killed writer of this target left: it held the lock we now hold, so nobody owns these.
    for (const std::string& n : list_dir(parent_))
      if (starts_with(n, "." + name_ + ".tmp-") || starts_with(n, "." + name_ + ".old-"))
        remove_flat_dir(parent_ + "/" + n);
    tmp_ = unique_sibling(parent_, name_, "tmp", true, op);
  } catch (...) {
    ::unlink(lock_path_.c_str());
    ::close(lock_fd_);
    throw;
  }
}

StagedDir::~StagedDir() {
  if (!published_ && !tmp_.empty()) remove_flat_dir(tmp_);
  ::unlink(lock_path_.c_str());  // while still holding the lock: see the constructor
  ::close(lock_fd_);
}

void StagedDir::publish() {
  sync_path(tmp_, op_);
  if (!replacing_) {
    // rename() onto an absent path or an empty directory replaces it in one step.
    if (::rename(tmp_.c_str(), target_.c_str()) != 0)
      throw Error(op_, target_ + ": cannot move the written directory into place: " + errno_text());
  } else {
    const std::string old = unique_sibling(parent_, name_, "old", false, op_);
    if (::rename(target_.c_str(), old.c_str()) != 0)
      throw Error(op_, target_ + ": cannot move the old checkpoint aside: " + errno_text());
    if (::rename(tmp_.c_str(), target_.c_str()) != 0) {
      const std::string why = errno_text();
      ::rename(old.c_str(), target_.c_str());  // put the old one back
      throw Error(op_, target_ + ": cannot move the written directory into place: " + why);
    }
    remove_flat_dir(old);  // a leftover is removed by the next writer
  }
  published_ = true;
  sync_path(parent_, op_);
}

}  // namespace expertqmm::detail
