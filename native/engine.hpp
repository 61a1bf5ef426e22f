// tensorferry native I/O core: files, requests, backends. Knows no Python object
// other than the raw memory ranges the binding layer hands it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tf {

// An open file: a buffered descriptor for unaligned edges and, when the filesystem
// accepts it, an O_DIRECT descriptor for the aligned middle of each request.
// Made by std::make_shared (Python constructs it through a factory), so that the
// requests holding it share a plain C++ owner: a reference that nanobind made from
// the Python object would take the GIL when a ring thread drops it, and a thread
// that takes the GIL while the interpreter finalizes is ended by pthread_exit,
// which aborts the process when it unwinds through a noexcept frame.
class File : public std::enable_shared_from_this<File> {
 public:
  // mode: "r", "r+", "w" (create, truncate), "w+" (read/write, create, truncate),
  // "a" (write, create, keep contents: positional writes into an existing file).
  File(const std::string &path, const std::string &mode, bool want_direct);
  // Works through its own duplicate of a descriptor the caller keeps owning (and may close
  // at once); `label` names it in errors.
  File(int fd, const std::string &label);
  ~File();
  File(const File &) = delete;
  File &operator=(const File &) = delete;

  void close();
  void fsync();
  void truncate(uint64_t size);
  // Extends the file to at least `end` bytes with allocated blocks, so that O_DIRECT
  // writes into it do not extend the file (ext4 serialises extending direct writes).
  // Only [offset, end) past the current end is allocated: a hole before `offset` stays one.
  void reserve(uint64_t offset, uint64_t end);
  uint64_t size() const;

  const std::string &path() const { return path_; }
  int buffered_fd() const { return fd_buffered_; }
  int direct_fd() const { return fd_direct_; }
  bool is_closed() const { return fd_buffered_ < 0; }
  bool direct() const { return fd_direct_ >= 0; }
  // Opened for reading only (mode "r", or a descriptor opened O_RDONLY).
  bool writable() const { return writable_; }
  // A descriptor opened with O_APPEND: Linux appends its pwrites whatever their offset.
  bool appends() const { return appends_; }
  // O_DIRECT was asked for and the filesystem refused it (EINVAL at open).
  bool direct_refused() const { return direct_refused_; }
  uint32_t offset_align() const { return offset_align_; }
  uint32_t mem_align() const { return mem_align_; }

 private:
  void probe_alignment(int fd);

  std::string path_;
  int fd_buffered_ = -1;
  int fd_direct_ = -1;
  bool writable_ = true;
  bool appends_ = false;
  bool direct_refused_ = false;
  uint32_t offset_align_ = 4096;
  uint32_t mem_align_ = 4096;
};

// Raised inside the core for failures outside of requests (open, fsync, ...).
struct IOError {
  int err;
  std::string path;
  std::string what;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// One user-visible pread/pwrite. Completed when every task it was split into is done.
class Request {
 public:
  Request(std::shared_ptr<File> file, bool is_write, uint64_t offset, uint64_t nbytes);

  // False on timeout. A negative timeout, or one past what the clock holds (infinity,
  // 1e10 s), waits without limit.
  bool wait(double timeout_seconds);
  bool done() const { return finished_.load(std::memory_order_acquire) || orphaned(); }
  bool failed() const { return failed_.load(std::memory_order_acquire) || orphaned(); }
  // In flight when the process that made it forked, and seen from the child: the I/O and
  // the threads doing it stayed in the parent, so nothing here will finish it. It counts
  // as done and failed (error() says why), so that waiting on it does not hang.
  bool orphaned() const;
  // Whether a block at `offset` can be skipped: an earlier part of the request has
  // already failed. Blocks before the failure still run, so that the error reported
  // is the one nearest the start whatever order blocks complete in.
  bool failed_before(uint64_t offset);

  void fail(int err, uint64_t offset, uint64_t length, const char *what);
  // A failure at byte `at`, reported as one of the range [offset, offset + length) that
  // the caller asked for (what it sees of the request), not of the block that found it.
  void fail(int err, uint64_t at, const std::string &what, uint64_t offset, uint64_t length);
  // Fails the request as cancelled: its blocks not yet issued are skipped, those in
  // flight finish (their memory is written all the same until then). A request whose
  // every block is done keeps its outcome, and a failed one its error.
  void cancel();
  void add_bytes(uint64_t n) { bytes_done_.fetch_add(n, std::memory_order_relaxed); }
  void task_finished();
  void set_task_count(int64_t n);

  uint64_t bytes_done() const { return bytes_done_.load(std::memory_order_relaxed); }
  uint64_t nbytes() const { return nbytes_; }
  uint64_t offset() const { return offset_; }
  bool is_write() const { return is_write_; }
  // Valid only while the request runs: a finished request lets go of its file, so
  // that a closed file's descriptors close (and a deleted file's space is freed) at
  // once, not when the caller drops the request.
  const File &file() const { return *file_; }
  const std::string &path() const { return path_; }
  int error() const;
  uint64_t error_offset() const { return orphaned() ? offset_ : err_offset_; }
  uint64_t error_length() const { return orphaned() ? nbytes_ : err_length_; }
  const std::string &error_what() const;

 private:
  std::shared_ptr<File> file_;  // keeps the descriptors open until the request ends
  std::string path_;
  bool is_write_;
  uint64_t offset_, nbytes_;
  unsigned fork_generation_;  // the forks before this request was made (see orphaned)
  std::atomic<int64_t> remaining_{1};
  std::atomic<uint64_t> bytes_done_{0};
  std::atomic<bool> finished_{false};
  std::atomic<bool> failed_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int err_ = 0;
  uint64_t err_at_ = 0;  // where the failure was found: the one nearest the start is kept
  uint64_t err_offset_ = 0, err_length_ = 0;
  std::string err_what_;
};

// A contiguous piece of a request, issued as one pread/pwrite.
struct Task {
  std::shared_ptr<Request> req;
  int fd;
  char *ptr;
  uint64_t offset;
  uint64_t length;
  // The memory is not aligned for O_DIRECT: stage it through an aligned buffer.
  bool needs_bounce;
  // The range the caller asked for that this task is a piece of (a segment of the request).
  uint64_t part_offset = 0, part_length = 0;
};

// Fails the read `task` belongs to, which found the end of its file at byte `at`: as the
// caller's range, with how many of its bytes were read (those before `at`).
void fail_past_end(const Task &task, uint64_t at);

// Performs tasks. Implementations must finish every task they accept exactly once,
// successfully or by failing its request.
class Backend {
 public:
  Backend();
  virtual ~Backend() = default;
  // In a forked child the worker threads do not exist: they cannot be joined.
  bool forked() const;
  virtual void submit(std::vector<Task> &&tasks) = 0;
  virtual void shutdown() = 0;  // waits for accepted tasks, then stops
  virtual const char *name() const = 0;

 private:
  int owner_pid_;
};

std::unique_ptr<Backend> make_thread_backend(int threads, uint64_t block_size);
// `rings` rings, each with a thread, share `queue_depth` blocks in flight.
std::unique_ptr<Backend> make_uring_backend(int rings, int queue_depth, uint64_t block_size);
// Makes the next `count` io_uring_enter calls of every ring fail with `err` (tests).
void inject_uring_enter_failures(int count, int err);
// Makes the next `count` read/write completions of every ring report `res` instead (tests).
void inject_uring_results(int count, int res);
// Whether this kernel and sandbox let us create and use an io_uring instance.
bool uring_available(std::string *why);

// memcpy for a destination nobody reads soon (a loaded tensor): on x86-64 the aligned
// middle goes with streaming stores, which neither read the destination's cache lines
// first nor evict the source from the cache; elsewhere, memcpy.
void copy_out(char *dest, const char *source, uint64_t nbytes);

// Faults in the pages of [ptr, ptr+len) for writing (best effort, no error).
void populate_for_write(char *ptr, uint64_t len);
// Faults in, readable, the pages of a file mapping (MADV_POPULATE_READ, Linux 5.14): 0, or
// the errno (EFAULT where a page cannot be read in, which touching it would make a SIGBUS;
// EINVAL on older kernels).
int populate_for_read(char *ptr, uint64_t len);

// Runs one task synchronously with pread/pwrite, resuming short transfers.
// `bounce` is an aligned scratch buffer of at least task.length bytes, used when
// task.needs_bounce is set.
void run_task_blocking(const Task &task, char *bounce);

struct Config {
  std::string backend = "threads";  // "threads" or "io_uring"
  uint64_t block_size = 1 << 20;
  int queue_depth = 32;
  int threads = 4;
};

class Engine {
 public:
  explicit Engine(const Config &config);
  ~Engine();
  std::shared_ptr<Request> submit(std::shared_ptr<File> file, bool is_write, char *ptr,
                                  uint64_t nbytes, uint64_t offset);
  // A buffer and the file offset it is read from or written to.
  struct Segment {
    char *ptr;
    uint64_t nbytes;
    uint64_t offset;
  };
  // One request for several segments of one file: one submission and one wake-up of
  // the backend for all of them, however many buffers they are.
  std::shared_ptr<Request> submit_many(std::shared_ptr<File> file, bool is_write,
                                       const std::vector<Segment> &segments);
  // Reads of several files, a request each (file i's segments[i]), handed to the
  // backend together: one wake-up for a batch of small files, not one per file.
  std::vector<std::shared_ptr<Request>> submit_reads(const std::vector<std::shared_ptr<File>> &files,
                                                     const std::vector<std::vector<Segment>> &segments);
  void close();
  const char *backend_name() const { return backend_->name(); }
  const Config &config() const { return config_; }

 private:
  // Appends the tasks of one segment: O_DIRECT for its aligned middle, buffered for the rest.
  void add_tasks(const std::shared_ptr<Request> &req, File &file, char *ptr, uint64_t nbytes, uint64_t offset,
                 std::vector<Task> &tasks) const;
  std::shared_ptr<Request> start(std::shared_ptr<Request> req, File &file, bool is_write, uint64_t end,
                                 const std::vector<Segment> &segments);
  Config config_;
  std::unique_ptr<Backend> backend_;
};

// Page-aligned host memory, locked in RAM when RLIMIT_MEMLOCK allows.
struct PinnedAllocation {
  void *ptr;
  uint64_t nbytes;
  bool locked;
};
PinnedAllocation pinned_alloc(uint64_t nbytes, bool lock);
void pinned_free(const PinnedAllocation &a);

// Anonymous memory for transfers: page-aligned, and in transparent huge pages
// wherever it spans one. Returns the mapping's real length through `mapped`.
void *map_transfer_memory(uint64_t nbytes, uint64_t *mapped);

// Aligned scratch memory owned by one backend worker: mapped whole, faulted in only as far
// as transfers use it (fault_in_staging).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(uint64_t nbytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer &&other) noexcept;
  AlignedBuffer &operator=(AlignedBuffer &&other) noexcept;
  char *data() const { return data_; }

 private:
  char *data_ = nullptr;
  uint64_t mapped_ = 0;
};

// Makes the first `nbytes` of a staging area faulted in, `*faulted` being how many are
// already (advanced here): zero-filled once, before the transfers that use them, not during
// each (this VM pays dearly for a first touch), and no further than transfers reach, so
// that a 64 KiB read through a 1 GiB staging block costs 64 KiB of memory, not 1 GiB.
void fault_in_staging(char *area, uint64_t nbytes, uint64_t *faulted);

}  // namespace tf
