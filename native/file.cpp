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

// The file behind `fd`, opened again with `flags`, through its /proc link: whatever its
// name now leads to, this is the same file.
int reopen(int fd, int flags) {
  char proc[64];
  snprintf(proc, sizeof proc, "/proc/self/fd/%d", fd);
  return ::open(proc, flags);
}

// A second descriptor of the file that `fd` has open (errno set on failure). Not by name: an
// atomic rename over it between the two opens would give one File two files, and one read the
// edges of one and the middle of the other. By name only where /proc is missing (ENOENT), and
// then only if the name still leads to the same file (ESTALE otherwise).
int open_twin(int fd, const std::string &path, int flags) {
  const int twin = reopen(fd, flags);
  if (twin >= 0 || errno != ENOENT) return twin;
  const int named = ::open(path.c_str(), flags);
  if (named < 0) return named;
  struct stat a, b;
  if (fstat(fd, &a) == 0 && fstat(named, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino) return named;
  ::close(named);
  errno = ESTALE;
  return -1;
}

const char *kind_of(mode_t mode) {
  if (S_ISFIFO(mode)) return "a pipe or FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISDIR(mode)) return "a directory";
  return "an unusual file";
}

// Refuses (closing `fd`) a FIFO, socket or character device in place of a file: positional
// I/O cannot serve a stream, and io_uring would ignore the offset of a character device's.
void refuse_stream(int fd, const std::string &path) {
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IOError{err, path, "fstat"};
  }
  if (!S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode) && !S_ISCHR(st.st_mode)) return;
  ::close(fd);
  throw IOError{EINVAL, path, std::string("open: ") + kind_of(st.st_mode) + ", not a file"};
}

// Another process holds a lease on the file (Samba, an NFS server), which a non-blocking
// open does not wait to break. An O_PATH descriptor breaks no lease and shows what the file
// is; the open that may wait goes through it, so that no FIFO can be put in its place meanwhile.
int open_leased(const std::string &path, int flags) {
  const int at = ::open(path.c_str(), O_PATH | O_CLOEXEC);
  if (at < 0) return at;
  refuse_stream(at, path);
  const int fd = reopen(at, flags);
  const int err = errno;
  ::close(at);
  errno = err;
  return fd;
}

// A blocking descriptor of `path` for positional I/O; a FIFO or socket in place of the file
// is refused without blocking on it.
int open_positional(const std::string &path, int flags) {
  // Non-blocking for the open only: a FIFO put where a file should be would block it
  // forever (reads of regular files and block devices ignore the flag anyway).
  int fd = ::open(path.c_str(), flags | O_NONBLOCK, 0644);
  if (fd < 0 && errno == EWOULDBLOCK) fd = open_leased(path, flags);
  if (fd < 0) throw IOError{errno, path, "open"};
  refuse_stream(fd, path);
  if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    throw IOError{err, path, "fcntl(F_SETFL)"};
  }
  return fd;
}

}  // namespace

File::File(const std::string &path, const std::string &mode, bool want_direct)
    : path_(path) {
  const int flags = open_flags(mode) | O_CLOEXEC;
  writable_ = (flags & O_ACCMODE) != O_RDONLY;
  fd_buffered_ = open_positional(path, flags);
  probe_alignment(fd_buffered_);
  if (!want_direct) return;
  // The buffered open already created or truncated the file; the direct one must not.
  fd_direct_ = open_twin(fd_buffered_, path, (flags & ~(O_CREAT | O_TRUNC)) | O_DIRECT);
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

File::File(int fd, const std::string &label) : path_(label) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0) throw IOError{errno, label, "fcntl(F_GETFL)"};
  // io_uring reads and writes a pipe, socket or terminal at its current position whatever
  // the offset asked, and a read of an empty pipe waits for a writer.
  struct stat st;
  if (fstat(fd, &st) != 0) throw IOError{errno, label, "fstat"};
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode))
    throw IOError{EINVAL, label, std::string("a descriptor of ") + kind_of(st.st_mode) +
                                     ", not of a regular file or block device (positional I/O needs one)"};
  writable_ = (flags & O_ACCMODE) != O_RDONLY;
  appends_ = (flags & O_APPEND) != 0;
  // Our own duplicate: the caller may close its number while requests are queued, and an
  // open that reuses the number would take their writes into another file.
  const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
  if (own < 0) throw IOError{errno, label, "fcntl(F_DUPFD_CLOEXEC)"};
  // A descriptor opened with O_DIRECT serves the aligned middle; its edges need a
  // buffered twin, which only a reopen through /proc can give. Plain descriptors stay
  // buffered.
  if (flags & O_DIRECT) {
    const int buffered = reopen(own, (flags & ~(O_DIRECT | O_CREAT | O_TRUNC)) | O_CLOEXEC);
    if (buffered < 0) {
      const int err = errno;
      ::close(own);
      throw IOError{err, label, "reopen without O_DIRECT"};
    }
    fd_buffered_ = buffered;
    fd_direct_ = own;
  } else {
    fd_buffered_ = own;
  }
  probe_alignment(own);
}

File::~File() { close(); }

void File::close() {
  if (fd_direct_ >= 0) ::close(fd_direct_);
  if (fd_buffered_ >= 0) ::close(fd_buffered_);
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

void File::reserve(uint64_t offset, uint64_t end) {
  if (fd_buffered_ < 0) throw IOError{EBADF, path_, "reserve on a closed file"};
  const uint64_t from = std::max(offset, this->size());
  if (end <= from) return;
  if (::fallocate(fd_buffered_, 0, static_cast<off_t>(from), static_cast<off_t>(end - from)) == 0) return;
  const int err = errno;
  // Filesystems without fallocate still take the writes, only slower.
  if (err == EOPNOTSUPP || err == ENOSYS) return;
  throw IOError{err, path_, "fallocate", from, end - from};
}

uint64_t File::size() const {
  struct stat st;
  if (fstat(fd_buffered_, &st) != 0) throw IOError{errno, path_, "fstat"};
  return static_cast<uint64_t>(st.st_size);
}

}  // namespace tf
