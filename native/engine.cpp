#include "engine.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <limits>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace tf {

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

// Faults in the pages a read will land in. io_uring tries direct I/O without
// blocking; pages not yet touched make that fail and the request is retried by
// kernel workers that fault them in one by one, contending on the mm lock (here:
// 2 s of system time per GiB read into fresh memory, against 0.05 s populated).
void populate_for_write(char *ptr, uint64_t len) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(ptr) & ~(page - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + len + page - 1) & ~(page - 1);
  // Best effort: memory that cannot be populated this way is faulted in by the I/O.
  madvise(reinterpret_cast<void *>(begin), end - begin, MADV_POPULATE_WRITE);
}

int populate_for_read(char *ptr, uint64_t len) {
  return madvise(ptr, len, MADV_POPULATE_READ) == 0 ? 0 : errno;
}

void copy_out(char *dest, const char *source, uint64_t nbytes) {
#if defined(__x86_64__) && defined(__SSE2__)
  const uint64_t head = std::min<uint64_t>(nbytes, (16 - reinterpret_cast<uintptr_t>(dest) % 16) % 16);
  std::memcpy(dest, source, head);
  uint64_t at = head;
  for (; at + 64 <= nbytes; at += 64) {
    const __m128i *from = reinterpret_cast<const __m128i *>(source + at);
    __m128i *to = reinterpret_cast<__m128i *>(dest + at);
    const __m128i a = _mm_loadu_si128(from), b = _mm_loadu_si128(from + 1);
    const __m128i c = _mm_loadu_si128(from + 2), d = _mm_loadu_si128(from + 3);
    _mm_stream_si128(to, a);
    _mm_stream_si128(to + 1, b);
    _mm_stream_si128(to + 2, c);
    _mm_stream_si128(to + 3, d);
  }
  std::memcpy(dest + at, source + at, nbytes - at);
  _mm_sfence();  // the streamed stores are visible before anyone is told the copy is done
#else
  std::memcpy(dest, source, nbytes);
#endif
}

namespace {

// Counts the forks of this process's line, in the child: a request made before the last
// fork and not finished then is the parent's (Request::orphaned). A counter, not getpid():
// read for every request and every wait, it costs no system call.
std::atomic<unsigned> forks_seen{0};
const int fork_handler_registered =
    pthread_atfork(nullptr, nullptr, [] { forks_seen.fetch_add(1, std::memory_order_relaxed); });

const std::string kOrphanedWhat = "in flight at fork(): the I/O belongs to the parent process, its outcome unknown here";

}  // namespace

Request::Request(std::shared_ptr<File> file, bool is_write, uint64_t offset, uint64_t nbytes)
    : file_(std::move(file)), path_(file_ ? file_->path() : std::string()), is_write_(is_write), offset_(offset),
      nbytes_(nbytes), fork_generation_(forks_seen.load(std::memory_order_relaxed)) {}

bool Request::orphaned() const {
  return fork_generation_ != forks_seen.load(std::memory_order_relaxed) &&
         !finished_.load(std::memory_order_acquire);
}

int Request::error() const { return orphaned() ? ECANCELED : err_; }
const std::string &Request::error_what() const { return orphaned() ? kOrphanedWhat : err_what_; }

void Request::set_task_count(int64_t n) { remaining_.fetch_add(n, std::memory_order_relaxed); }

void Request::fail(int err, uint64_t offset, uint64_t length, const char *what) {
  fail(err, offset, what, offset, length);
}

void Request::fail(int err, uint64_t at, const std::string &what, uint64_t offset, uint64_t length) {
  std::lock_guard<std::mutex> lock(mu_);
  // Blocks fail in any order; report the failure nearest the start of the request,
  // which is where the data stops being good.
  if (failed_.load(std::memory_order_relaxed) && at >= err_at_) return;
  err_ = err;
  err_at_ = at;
  err_offset_ = offset;
  err_length_ = length;
  err_what_ = what;
  failed_.store(true, std::memory_order_release);
}

void Request::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  if (remaining_.load(std::memory_order_acquire) == 0 || failed_.load(std::memory_order_relaxed)) return;
  err_ = ECANCELED;
  err_at_ = 0;  // at the start: every block not yet issued is skipped (failed_before)
  err_offset_ = offset_;  // the error names the request cancelled
  err_length_ = nbytes_;
  err_what_ = "cancelled";
  failed_.store(true, std::memory_order_release);
}

bool Request::failed_before(uint64_t offset) {
  if (!failed()) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return err_at_ <= offset;
}

void Request::task_finished() {
  if (remaining_.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  file_.reset();  // the descriptors close here if the caller has closed the file
  std::lock_guard<std::mutex> lock(mu_);
  finished_.store(true, std::memory_order_release);
  cv_.notify_all();
}

bool Request::wait(double timeout_seconds) {
  if (orphaned()) return true;  // before the lock, which a parent thread may have held at the fork
  std::unique_lock<std::mutex> lock(mu_);
  auto is_done = [this] { return finished_.load(std::memory_order_acquire); };
  // wait_for converts to the clock's nanoseconds in 64 bits: past 292 years (infinity,
  // 1e10 s) that overflows and the wait would time out at once. 1e9 s is 31 years.
  constexpr double kNoLimit = 1e9;
  if (timeout_seconds < 0 || !(timeout_seconds < kNoLimit)) {
    cv_.wait(lock, is_done);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_seconds), is_done);
}

AlignedBuffer::AlignedBuffer(uint64_t nbytes) { data_ = static_cast<char *>(map_transfer_memory(nbytes, &mapped_)); }
AlignedBuffer::~AlignedBuffer() {
  if (data_ != nullptr) munmap(data_, mapped_);
}
AlignedBuffer::AlignedBuffer(AlignedBuffer &&other) noexcept : data_(other.data_), mapped_(other.mapped_) {
  other.data_ = nullptr;
  other.mapped_ = 0;
}
AlignedBuffer &AlignedBuffer::operator=(AlignedBuffer &&other) noexcept {
  std::swap(data_, other.data_);
  std::swap(mapped_, other.mapped_);
  return *this;
}

void fault_in_staging(char *area, uint64_t nbytes, uint64_t *faulted) {
  if (nbytes <= *faulted) return;
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t end = (nbytes + page - 1) / page * page;  // staging areas are whole pages
  std::memset(area + *faulted, 0, end - *faulted);
  *faulted = end;
}

void fail_past_end(const Task &task, uint64_t at) {
  task.req->fail(ENODATA, at, "read past end of file (" + std::to_string(at - task.part_offset) + " bytes read)",
                 task.part_offset, task.part_length);
}

void run_task_blocking(const Task &task, char *bounce) {
  Request &req = *task.req;
  if (req.failed_before(task.offset)) return;
  const bool is_write = req.is_write();
  char *mem = task.needs_bounce ? bounce : task.ptr;
  if (is_write && task.needs_bounce) std::memcpy(bounce, task.ptr, task.length);
  int fd = task.fd;
  uint64_t done = 0;
  while (done < task.length) {
    const uint64_t want = task.length - done;
    const off_t at = static_cast<off_t>(task.offset + done);
    const ssize_t n = is_write ? ::pwrite(fd, mem + done, want, at) : ::pread(fd, mem + done, want, at);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      req.fail(errno, task.offset + done, want, is_write ? "pwrite" : "pread");
      break;
    }
    if (n == 0) {
      if (is_write)
        req.fail(EIO, task.offset + done, want, "pwrite made no progress");
      else
        fail_past_end(task, task.offset + done);
      break;
    }
    done += static_cast<uint64_t>(n);
    // A short direct transfer can leave an unaligned remainder, which only the
    // buffered descriptor accepts.
    if (done < task.length && fd == req.file().direct_fd() &&
        (task.offset + done) % req.file().offset_align() != 0)
      fd = req.file().buffered_fd();
  }
  if (!is_write && task.needs_bounce) std::memcpy(task.ptr, bounce, done);
  req.add_bytes(done);
}

Backend::Backend() : owner_pid_(getpid()) {}
bool Backend::forked() const { return getpid() != owner_pid_; }

Engine::Engine(const Config &config) : config_(config) {
  if (config.block_size == 0 || config.block_size > (1ull << 30))
    throw IOError{EINVAL, "", "block_size must be between 1 byte and 1 GiB"};
  if (config.backend == "threads")
    backend_ = make_thread_backend(config.threads, config.block_size);
  else if (config.backend == "io_uring")
    backend_ = make_uring_backend(config.threads, config.queue_depth, config.block_size);
  else
    throw IOError{EINVAL, "", "unknown backend '" + config.backend + "'"};
}

Engine::~Engine() { close(); }

void Engine::close() {
  if (backend_) backend_->shutdown();
}

namespace {

// Offsets are off_t: a range ending past 2**63-1 is beyond any file, and its end, computed
// in uint64_t, may wrap to below its start, which would make no task and no error at all.
void check_range(const File &file, uint64_t offset, uint64_t nbytes) {
  constexpr uint64_t kMaxEnd = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  if (offset > kMaxEnd || nbytes > kMaxEnd - offset)
    throw IOError{EINVAL, file.path(), "a range ending past 2**63-1, the largest file offset", offset, nbytes};
}

// Refused before any block runs: a write that could only fail, or that would land elsewhere.
void check_writable(const File &file, uint64_t offset, uint64_t nbytes) {
  if (!file.writable()) throw IOError{EBADF, file.path(), "write to a file open read-only", offset, nbytes};
  if (file.appends())
    throw IOError{EINVAL, file.path(),
                  "write through a descriptor opened with O_APPEND, which Linux puts at the end of the file "
                  "whatever the offset asked (open it without O_APPEND)",
                  offset, nbytes};
}

}  // namespace

std::shared_ptr<Request> Engine::submit(std::shared_ptr<File> file, bool is_write, char *ptr,
                                        uint64_t nbytes, uint64_t offset) {
  if (file->is_closed()) throw IOError{EBADF, file->path(), "I/O on a closed file", offset, nbytes};
  check_range(*file, offset, nbytes);
  if (is_write) check_writable(*file, offset, nbytes);
  auto req = std::make_shared<Request>(file, is_write, offset, nbytes);
  return start(std::move(req), *file, is_write, offset + nbytes, {Segment{ptr, nbytes, offset}});
}

namespace {

// A request for segments of a file: from their lowest offset, their bytes summed
// (`end` set to the end of the furthest); refused on a closed file.
std::shared_ptr<Request> request_for(const std::shared_ptr<File> &file, bool is_write,
                                     const std::vector<Engine::Segment> &segments, uint64_t *end = nullptr) {
  uint64_t first = segments.empty() ? 0 : segments.front().offset, last = 0, total = 0;
  for (const auto &s : segments) {
    check_range(*file, s.offset, s.nbytes);
    first = std::min(first, s.offset);
    last = std::max(last, s.offset + s.nbytes);
    total += s.nbytes;
  }
  if (file->is_closed()) throw IOError{EBADF, file->path(), "I/O on a closed file", first, total};
  if (is_write) check_writable(*file, first, total);
  if (end) *end = last;
  return std::make_shared<Request>(file, is_write, first, total);
}

}  // namespace

std::shared_ptr<Request> Engine::submit_many(std::shared_ptr<File> file, bool is_write,
                                             const std::vector<Segment> &segments) {
  uint64_t end = 0;
  auto req = request_for(file, is_write, segments, &end);
  return start(std::move(req), *file, is_write, end, segments);
}

std::vector<std::shared_ptr<Request>> Engine::submit_reads(const std::vector<std::shared_ptr<File>> &files,
                                                           const std::vector<std::vector<Segment>> &segments) {
  std::vector<std::shared_ptr<Request>> requests;
  std::vector<Task> tasks;
  for (size_t i = 0; i < files.size(); ++i) {
    auto req = request_for(files[i], false, segments[i]);
    const size_t before = tasks.size();
    for (const auto &s : segments[i]) add_tasks(req, *files[i], s.ptr, s.nbytes, s.offset, tasks);
    req->set_task_count(static_cast<int64_t>(tasks.size() - before));
    requests.push_back(std::move(req));
  }
  if (!tasks.empty()) backend_->submit(std::move(tasks));
  for (auto &req : requests) req->task_finished();  // releases the guard count taken at construction
  return requests;
}

std::shared_ptr<Request> Engine::start(std::shared_ptr<Request> req, File &file, bool is_write, uint64_t end,
                                       const std::vector<Segment> &segments) {
  std::vector<Task> tasks;
  for (const auto &s : segments) add_tasks(req, file, s.ptr, s.nbytes, s.offset, tasks);
  auto is_direct = [&](const Task &t) { return t.fd == file.direct_fd(); };
  const bool direct_writes = is_write && file.direct() && std::any_of(tasks.begin(), tasks.end(), is_direct);
  if (direct_writes) {
    try {
      file.reserve(req->offset(), end);
    } catch (const IOError &e) {  // a full disk shows up here: reported as the write's failure
      req->fail(e.err, req->offset(), req->nbytes(), "fallocate before the write");
      req->task_finished();
      return req;
    }
  }
  req->set_task_count(static_cast<int64_t>(tasks.size()));
  if (!tasks.empty()) backend_->submit(std::move(tasks));
  req->task_finished();  // releases the guard count taken at construction
  return req;
}

void Engine::add_tasks(const std::shared_ptr<Request> &req, File &file, char *ptr, uint64_t nbytes,
                       uint64_t offset, std::vector<Task> &tasks) const {
  const uint64_t end = offset + nbytes;
  auto add_range = [&](int fd, uint64_t from, uint64_t to, uint64_t chunk, bool direct) {
    for (uint64_t at = from; at < to; at += chunk) {
      const uint64_t len = std::min(chunk, to - at);
      char *p = ptr + (at - offset);
      const bool misaligned = direct && reinterpret_cast<uintptr_t>(p) % file.mem_align() != 0;
      tasks.push_back(Task{req, fd, p, at, len, misaligned, offset, nbytes});
    }
  };
  const uint64_t align = file.offset_align();
  const uint64_t lo = (offset + align - 1) / align * align;
  const uint64_t hi = end / align * align;
  if (file.direct() && lo < hi) {
    const uint64_t chunk = std::max<uint64_t>(align, config_.block_size / align * align);
    add_range(file.buffered_fd(), offset, lo, config_.block_size, false);
    add_range(file.direct_fd(), lo, hi, chunk, true);
    add_range(file.buffered_fd(), hi, end, config_.block_size, false);
  } else {
    add_range(file.buffered_fd(), offset, end, config_.block_size, false);
  }
}

}  // namespace tf
