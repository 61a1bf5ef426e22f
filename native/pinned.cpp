#include <sys/mman.h>

#include <cerrno>

#include "engine.hpp"

namespace tf {

PinnedAllocation pinned_alloc(uint64_t nbytes) {
  // mmap gives page alignment (enough for any O_DIRECT device) and memory that
  // munmap returns to the system at once, unlike a malloc arena.
  const uint64_t len = nbytes == 0 ? 4096 : nbytes;
  void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw IOError{errno, "", "mmap of a pinned buffer", 0, len};
  // Past RLIMIT_MEMLOCK (or without CAP_IPC_LOCK) mlock fails: the memory is still
  // aligned and usable, only not locked; the caller warns once.
  const bool locked = mlock(p, len) == 0;
  return PinnedAllocation{p, len, locked};
}

void pinned_free(const PinnedAllocation &a) {
  if (a.locked) munlock(a.ptr, a.nbytes);
  munmap(a.ptr, a.nbytes);
}

}  // namespace tf
