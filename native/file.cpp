#include <fcntl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "engine.hpp"

namespace tf {

namespace {

int open_flags(const std::string &mode) {
  if (mode == "r") return O_RDONLY;
  if (mode == "r+") return O_RDWR;
  if (mode == "w") return O_WRONLY | O_CREAT | O_TRUNC;
  if (mode == "w+") return O_RDWR | O_CREAT | O_TRUNC;
  if (mode == "a") return O_WRONLY | O_CREAT;
  throw IOError{EINVAL, "", "unknown file mode '" + mode + "' (use r, r+, w, w+ or a)"};
}

// Logical block size of the block device holding the file, from sysfs; 0 if unknown.
uint32_t sysfs_logical_block_size(dev_t dev) {
  char path[128];
  for (const char *suffix : {"queue/logical_block_size", "../queue/logical_block_size"}) {
    snprintf(path, sizeof path, "/sys/dev/block/%u:%u/%s", major(dev), minor(dev), suffix);
    std::ifstream in(path);
    uint32_t value = 0;
    if (in >> value && value > 0) return value;
  }
  return 0;
}

}  // namespace

File::File(const std::string &path, const std::string &mode, bool want_direct) : path_(path) {
  const int flags = open_flags(mode) | O_CLOEXEC;
  // Non-blocking for the open only: a FIFO put where a file should be would block it
  // forever (reads of regular files and block devices ignore the flag anyway).
  fd_buffered_ = ::open(path.c_str(), flags | O_NONBLOCK, 0644);
  if (fd_buffered_ < 0) throw IOError{errno, path, "open"};
  struct stat st;
  const int err = fstat(fd_buffered_, &st) != 0 ? errno
                  : S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode) ? EINVAL : 0;
  if (err != 0) {
    ::close(fd_buffered_);
    fd_buffered_ = -1;
    throw IOError{err, path, err == EINVAL ? "open: a FIFO or socket, not a file" : "fstat"};
  }
  if (fcntl(fd_buffered_, F_SETFL, fcntl(fd_buffered_, F_GETFL) & ~O_NONBLOCK) != 0) {
    const int fcntl_err = errno;
    ::close(fd_buffered_);
    fd_buffered_ = -1;
    throw IOError{fcntl_err, path, "fcntl(F_SETFL)"};
  }
  probe_alignment(fd_buffered_);
  if (!want_direct) return;
  // The buffered open already created or truncated the file; the direct one must not.
  fd_direct_ = ::open(path.c_str(), (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT);
  if (fd_direct_ < 0) {
    const int err = errno;
    if (err != EINVAL) {
      ::close(fd_buffered_);
      fd_buffered_ = -1;
      throw IOError{err, path, "open (O_DIRECT)"};
    }
    direct_refused_ = true;  // the filesystem has no direct I/O: stay buffered
  }
}

File::File(int fd, const std::string &label) : path_(label), owns_fd_(false) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) throw IOError{errno, label, "fcntl(F_GETFL)"};
  // A descriptor opened with O_DIRECT serves the aligned middle; its edges need a
  // buffered twin, which only a reopen through /proc can give. Plain descriptors stay
  // buffered.
  if (flags & O_DIRECT) {
    char proc[64];
    snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
    const int buffered = ::open(proc, (flags & ~(O_DIRECT | O_CREAT | O_TRUNC)) | O_CLOEXEC);
    if (buffered < 0) throw IOError{errno, label, "reopen without O_DIRECT"};
    fd_buffered_ = buffered;
    fd_direct_ = fd;
  } else {
    fd_buffered_ = fd;
  }
  probe_alignment(fd);
}

File::~File() { close(); }

void File::close() {
  if (owns_fd_) {
    if (fd_direct_ >= 0) ::close(fd_direct_);
    if (fd_buffered_ >= 0) ::close(fd_buffered_);
  } else if (fd_direct_ >= 0 && fd_buffered_ >= 0) {
    ::close(fd_buffered_);  // only the twin we opened is ours
  }
  fd_direct_ = fd_buffered_ = -1;
}

void File::probe_alignment(int fd) {
  // Ask the filesystem first (statx STATX_DIOALIGN, Linux 6.1+), then the block
  // device, and only then assume the strictest common value.
  struct statx stx;
  std::memset(&stx, 0, sizeof stx);
  uint32_t offset_align = 0, mem_align = 0;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0) {
    if (stx.stx_mask & STATX_DIOALIGN) {
      offset_align = stx.stx_dio_offset_align;
      mem_align = stx.stx_dio_mem_align;
    }
    if (offset_align == 0) offset_align = sysfs_logical_block_size(makedev(stx.stx_dev_major, stx.stx_dev_minor));
  }
  if (offset_align == 0) offset_align = 4096;
  if (mem_align == 0) mem_align = offset_align;
  // Direct and buffered ranges must never share a page, or write-back of the
  // buffered page could overwrite what the direct write put on disk.
  const uint32_t page = static_cast<uint32_t>(sysconf(_SC_PAGESIZE));
  offset_align_ = std::max(offset_align, page);
  mem_align_ = mem_align;
}

void File::fsync() {
  if (fd_buffered_ < 0) throw IOError{EBADF, path_, "fsync on a closed file"};
  if (::fsync(fd_buffered_) != 0) throw IOError{errno, path_, "fsync"};
}

void File::truncate(uint64_t size) {
  if (fd_buffered_ < 0) throw IOError{EBADF, path_, "truncate on a closed file"};
  if (::ftruncate(fd_buffered_, static_cast<off_t>(size)) != 0) throw IOError{errno, path_, "ftruncate", size};
}

void File::reserve(uint64_t size) {
  if (fd_buffered_ < 0) throw IOError{EBADF, path_, "reserve on a closed file"};
  const uint64_t current = this->size();
  if (size <= current) return;
  if (::fallocate(fd_buffered_, 0, static_cast<off_t>(current), static_cast<off_t>(size - current)) == 0) return;
  const int err = errno;
  // Filesystems without fallocate still take the writes, only slower.
  if (err == EOPNOTSUPP || err == ENOSYS) return;
  throw IOError{err, path_, "fallocate", current, size - current};
}

uint64_t File::size() const {
  struct stat st;
  if (fstat(fd_buffered_, &st) != 0) throw IOError{errno, path_, "fstat"};
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace tf
