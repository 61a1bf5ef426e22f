// io_uring through raw syscalls and the kernel's own <linux/io_uring.h>: no liburing.
// One thread owns the ring; it keeps up to queue_depth blocks' bytes in flight and is
// woken for new work by a poll on an eventfd, so submitters never touch the ring.
#include <linux/io_uring.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <new>
#include <thread>

#include "engine.hpp"

namespace tf {

namespace {

int sys_setup(unsigned entries, io_uring_params *p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
// Failures to inject into the next io_uring_enter calls (tests of the recovery below).
std::atomic<int> injected_enter_failures{0};
std::atomic<int> injected_enter_errno{0};
// Results to put in place of the next completions' own (tests of the retries in complete()).
std::atomic<int> injected_results{0};
std::atomic<int> injected_result{0};

int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  for (int left = injected_enter_failures.load(); left > 0;) {
    if (injected_enter_failures.compare_exchange_weak(left, left - 1)) {
      errno = injected_enter_errno.load();
      return -1;
    }
  }
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

// The mapped rings of one io_uring instance.
class Ring {
 public:
  explicit Ring(unsigned entries) {
    io_uring_params p;
    std::memset(&p, 0, sizeof p);
    fd_ = sys_setup(entries, &p);
    if (fd_ < 0) throw IOError{errno, "", "io_uring_setup"};
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ptr_ = map(sq_len_, IORING_OFF_SQ_RING);
    cq_ptr_ = single ? sq_ptr_ : map(cq_len_, IORING_OFF_CQ_RING);
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe *>(map(sqes_len_, IORING_OFF_SQES));

    auto *sq = static_cast<char *>(sq_ptr_);
    sq_head_ = reinterpret_cast<unsigned *>(sq + p.sq_off.head);
    sq_tail_ = reinterpret_cast<unsigned *>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned *>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned *>(sq + p.sq_off.array);
    auto *cq = static_cast<char *>(cq_ptr_);
    cq_head_ = reinterpret_cast<unsigned *>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned *>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned *>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe *>(cq + p.cq_off.cqes);
    entries_ = p.sq_entries;
  }

  ~Ring() { release(); }

  // Unmaps the rings and closes the instance; only once nothing uses them (a second call does nothing).
  void release() {
    if (sqes_) munmap(sqes_, sqes_len_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) munmap(cq_ptr_, cq_len_);
    if (sq_ptr_) munmap(sq_ptr_, sq_len_);
    if (fd_ >= 0) ::close(fd_);
    sqes_ = nullptr;
    sq_ptr_ = cq_ptr_ = nullptr;
    fd_ = -1;
  }

  unsigned entries() const { return entries_; }

  // A zeroed submission entry; the caller fills it, and enter() submits it.
  io_uring_sqe *next_sqe() {
    const unsigned tail = local_tail_;
    io_uring_sqe *sqe = &sqes_[tail & sq_mask_];
    std::memset(sqe, 0, sizeof *sqe);
    sq_array_[tail & sq_mask_] = tail & sq_mask_;
    ++local_tail_;
    ++unsubmitted_;
    return sqe;
  }

  // Submits what next_sqe() prepared and, if `wait`, blocks for one completion.
  void enter(bool wait) {
    __atomic_store_n(sq_tail_, local_tail_, __ATOMIC_RELEASE);
    for (;;) {
      const int r = sys_enter(fd_, unsubmitted_, wait ? 1 : 0, wait ? IORING_ENTER_GETEVENTS : 0);
      if (r >= 0) {
        unsubmitted_ -= static_cast<unsigned>(r);
        if (unsubmitted_ == 0 || !wait) return;
        continue;
      }
      if (errno == EINTR) continue;
      // A full completion queue: the caller reaps, then we come back.
      if (errno == EBUSY || errno == EAGAIN) return;
      if (errno == ENOMEM) {  // the kernel short of memory for a moment: try again shortly
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        return;
      }
      throw IOError{errno, "", "io_uring_enter"};
    }
  }

  // Takes back the entries the kernel has not consumed (after a failed enter), calling
  // on_withdrawn with each one's user_data. Safe without SQPOLL: only io_uring_enter
  // reads the submission queue, and it is not running.
  template <class F>
  void withdraw(F &&on_withdrawn) {
    const unsigned head = __atomic_load_n(sq_head_, __ATOMIC_ACQUIRE);
    for (unsigned i = head; i != local_tail_; ++i) on_withdrawn(sqes_[sq_array_[i & sq_mask_]].user_data);
    local_tail_ = head;
    unsubmitted_ = 0;
    __atomic_store_n(sq_tail_, head, __ATOMIC_RELEASE);
  }

  template <class F>
  void reap(F &&on_completion) {
    unsigned head = *cq_head_;
    const unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    while (head != tail) {
      const io_uring_cqe cqe = cqes_[head & cq_mask_];
      ++head;
      __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
      on_completion(cqe.user_data, cqe.res);
    }
  }

 private:
  void *map(size_t len, off_t offset) {
    void *p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, offset);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd_);
      fd_ = -1;
      throw IOError{err, "", "mmap of the io_uring rings"};
    }
    return p;
  }

  int fd_ = -1;
  void *sq_ptr_ = nullptr, *cq_ptr_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  io_uring_sqe *sqes_ = nullptr;
  unsigned *sq_head_, *sq_tail_, *sq_array_, *cq_head_, *cq_tail_;
  unsigned sq_mask_, cq_mask_;
  io_uring_cqe *cqes_;
  unsigned entries_ = 0;
  unsigned local_tail_ = 0;
  unsigned unsubmitted_ = 0;
};

constexpr uint64_t kWakeTag = ~uint64_t(0);

// Tasks smaller than a block (random 4 KiB reads, say) are kept in flight up to this
// many per block of queue_depth, within queue_depth blocks' bytes: random 4 KiB reads
// through TensorFlow at depth 32 ran at 0.34-0.40 GB/s, with 128 in flight 0.44-0.51,
// fio's speed on this disk (fio at depth 32: 104k IOPS, 64: 126k).
constexpr int kTasksPerBlock = 4;
constexpr int kMaxTasks = 4096;

int task_slots(int queue_depth) { return std::min(kMaxTasks, queue_depth * kTasksPerBlock); }

// Staging memory (for memory unaligned for O_DIRECT) an engine may use at most, shared by
// its rings; a ring has at least one block. A bounced task beyond it waits for a staging
// block to come free. 1 MiB blocks at depth 32 stay within it; 1 GiB ones at depth 32
// took 32 GiB (the process was killed for it).
constexpr uint64_t kStagingBudget = 256ull << 20;

class UringBackend final : public Backend {
 public:
  UringBackend(int queue_depth, uint64_t block_size, uint64_t staging_budget)
      : staging_stride_(round_up_to_page(block_size)),
        staging_blocks_(static_cast<int>(
            std::max<uint64_t>(1, std::min<uint64_t>(queue_depth, staging_budget / staging_stride_)))),
        byte_budget_(block_size * static_cast<uint64_t>(queue_depth)),
        ring_(static_cast<unsigned>(task_slots(queue_depth)) + 1) {
    if (queue_depth < 1 || queue_depth > 4096) throw IOError{EINVAL, "", "queue_depth must be between 1 and 4096"};
    wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) throw IOError{errno, "", "eventfd"};
    const int slots = task_slots(queue_depth);
    slots_.resize(static_cast<size_t>(slots));
    for (int i = slots - 1; i >= 0; --i) free_slots_.push_back(i);
    for (int i = staging_blocks_ - 1; i >= 0; --i) free_staging_.push_back(i);
    staging_faulted_.assign(static_cast<size_t>(staging_blocks_), 0);
    loop_ = std::thread([this] { run(); });
  }

  ~UringBackend() override { shutdown(); }

  void submit(std::vector<Task> &&tasks) override {
    // The wake-up is written under the lock: shutdown closes the eventfd under it, and a
    // write after the close could land in whatever file took its number.
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) throw IOError{EBADF, "", "I/O submitted to a closed engine"};
    for (auto &t : tasks) pending_.push_back(std::move(t));
    wake();
  }

  // Stops the loop once every accepted task is done, then gives back the ring, the eventfd
  // and the staging memory at once, not when the engine is garbage collected.
  void shutdown() override {
    if (forked()) {
      // A forked child's copy of the ring has no thread behind it, and the parent's thread
      // (in the parent) still uses the ring: the child leaves it all alone.
      new std::thread(std::move(loop_));  // see ThreadBackend::shutdown
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      wake();
    }
    // The loop may have stopped on its own (a broken ring sets stopping_): join anyway.
    if (loop_.joinable()) loop_.join();
    std::lock_guard<std::mutex> lock(mu_);
    ring_.release();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    wake_fd_ = -1;
    staging_ = AlignedBuffer();  // no task is left to copy through it
  }

  const char *name() const override { return "io_uring"; }

 private:
  struct Slot {
    Task task;
    uint64_t done = 0;
    int retries = 0;  // EAGAIN/EINTR completions in a row
    int fd = -1;
    int staging = -1;  // the staging block of a bounced task
  };

  // Called with mu_ held.
  void wake() {
    if (wake_fd_ < 0) return;  // shut down: no loop to wake
    const uint64_t one = 1;
    // EAGAIN means the counter is already non-zero: the loop is being woken anyway.
    while (::write(wake_fd_, &one, sizeof one) < 0 && errno == EINTR) {
    }
  }

  void arm_wake() {
    io_uring_sqe *sqe = ring_.next_sqe();
    sqe->opcode = IORING_OP_POLL_ADD;
    sqe->fd = wake_fd_;
    sqe->poll32_events = POLLIN;
    sqe->user_data = kWakeTag;
  }

  void prepare(int slot_index) {
    Slot &s = slots_[static_cast<size_t>(slot_index)];
    const Task &t = s.task;
    char *mem = t.needs_bounce ? staging_block(s.staging) : t.ptr;
    io_uring_sqe *sqe = ring_.next_sqe();
    sqe->opcode = t.req->is_write() ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = s.fd;
    sqe->addr = reinterpret_cast<uint64_t>(mem + s.done);
    sqe->len = static_cast<uint32_t>(t.length - s.done);
    sqe->off = t.offset + s.done;
    sqe->user_data = static_cast<uint64_t>(slot_index);
  }

  // Moves queued tasks into free slots, in order, while their bytes fit the budget (the
  // first always does) and a bounced one finds a staging block. Returns false once
  // stopping and idle.
  bool take_new_work() {
    std::lock_guard<std::mutex> lock(mu_);
    while (!pending_.empty() && !free_slots_.empty()) {
      const Task &next = pending_.front();
      if (bytes_in_flight_ > 0 && bytes_in_flight_ + next.length > byte_budget_) break;
      if (next.needs_bounce && free_staging_.empty()) break;
      const int i = free_slots_.back();
      free_slots_.pop_back();
      Slot &s = slots_[static_cast<size_t>(i)];
      s.task = std::move(pending_.front());
      pending_.pop_front();
      s.done = 0;
      s.retries = 0;
      s.fd = s.task.fd;
      bytes_in_flight_ += s.task.length;
      if (s.task.needs_bounce) {
        s.staging = free_staging_.back();
        free_staging_.pop_back();
      }
      if (s.task.req->failed_before(s.task.offset)) {
        finish(i);
        continue;
      }
      if (s.task.needs_bounce) {
        if (staging_.data() == nullptr && !allocate_staging(s.task)) {
          finish(i);
          continue;
        }
        fault_in_staging(staging_block(s.staging), s.task.length, &staging_faulted_[static_cast<size_t>(s.staging)]);
        if (s.task.req->is_write()) std::memcpy(staging_block(s.staging), s.task.ptr, s.task.length);
      } else if (!s.task.req->is_write()) {
        populate_for_write(s.task.ptr, s.task.length);
      }
      prepare(i);
    }
    return !(stopping_ && pending_.empty() && free_slots_.size() == slots_.size());
  }

  // One slab for every staging block, so that it lies in huge pages.
  // Blocks start a page apart: at multiples of a block_size off the page (1000000, say), all
  // but the first would be misaligned for O_DIRECT, which refuses such memory (EINVAL).
  char *staging_block(int index) const {
    return staging_.data() + static_cast<uint64_t>(index) * staging_stride_;
  }

  static uint64_t round_up_to_page(uint64_t n) {
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    return (n + page - 1) / page * page;
  }

  // Allocates the staging slab for `task`, or fails its request: thrown out of the loop,
  // the failure would leave the task in its slot, never finished, and close() waiting for it.
  bool allocate_staging(const Task &task) {
    try {
      staging_ = AlignedBuffer(staging_stride_ * static_cast<uint64_t>(staging_blocks_));
      return true;
    } catch (const IOError &e) {
      task.req->fail(e.err, task.offset, task.length, "mmap of staging memory for memory unaligned for O_DIRECT");
    } catch (const std::bad_alloc &) {
      task.req->fail(ENOMEM, task.offset, task.length, "staging memory for memory unaligned for O_DIRECT");
    }
    return false;
  }

  void finish(int i) {
    Slot &s = slots_[static_cast<size_t>(i)];
    if (!s.task.req->is_write() && s.task.needs_bounce && s.done > 0)
      std::memcpy(s.task.ptr, staging_block(s.staging), s.done);
    s.task.req->add_bytes(s.done);
    bytes_in_flight_ -= s.task.length;
    if (s.staging >= 0) free_staging_.push_back(s.staging);
    s.staging = -1;
    auto req = std::move(s.task.req);
    s.task = Task{};
    free_slots_.push_back(i);
    req->task_finished();
  }

  void complete(uint64_t tag, int res) {
    if (tag == kWakeTag) {
      uint64_t count;
      while (::read(wake_fd_, &count, sizeof count) > 0) {
      }
      arm_wake();
      return;
    }
    const int i = static_cast<int>(tag);
    Slot &s = slots_[static_cast<size_t>(i)];
    Request &req = *s.task.req;
    const bool is_write = req.is_write();
    const uint64_t want = s.task.length - s.done;
    for (int left = injected_results.load(); left > 0;) {
      if (injected_results.compare_exchange_weak(left, left - 1)) {
        res = injected_result.load();
        break;
      }
    }
    if (res < 0) {
      // Resubmitted at once, a device that keeps answering EAGAIN would spin this thread
      // forever: back off after a few, and give up after many.
      if ((res == -EAGAIN || res == -EINTR) && ++s.retries <= kMaxRetries) {
        if (s.retries > 64)
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        else if (s.retries > 8)
          sched_yield();
        prepare(i);
        return;
      }
      req.fail(-res, s.task.offset + s.done, want, is_write ? "pwrite" : "pread");
    } else if (res == 0) {
      if (is_write)
        req.fail(EIO, s.task.offset + s.done, want, "pwrite made no progress");
      else
        fail_past_end(s.task, s.task.offset + s.done);
    } else {
      s.done += static_cast<uint64_t>(res);
      s.retries = 0;
      if (s.done < s.task.length) {
        // Resume a short transfer; an unaligned remainder must go buffered.
        if (s.fd == req.file().direct_fd() && (s.task.offset + s.done) % req.file().offset_align() != 0)
          s.fd = req.file().buffered_fd();
        prepare(i);
        return;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    finish(i);
  }

  void run() {
    arm_wake();
    int failures_in_a_row = 0;
    for (;;) {
      try {
        if (!take_new_work()) return;
        ring_.enter(true);
        failures_in_a_row = 0;
        ring_.reap([this](uint64_t tag, int res) { complete(tag, res); });
      } catch (const IOError &e) {
        // A failed io_uring_enter fails the requests whose entries it did not take, not
        // the engine: the next ones may well go through. Only a ring that fails again
        // and again is broken for good.
        if (++failures_in_a_row > kMaxEnterFailures) {
          fail_everything(e);
          return;
        }
        fail_withdrawn(e);
        std::this_thread::sleep_for(std::chrono::milliseconds(failures_in_a_row));
      }
    }
  }

  static constexpr int kMaxEnterFailures = 16;
  static constexpr int kMaxRetries = 1000;

  void fail_withdrawn(const IOError &e) {
    bool wake_withdrawn = false;
    ring_.withdraw([&](uint64_t tag) {
      if (tag == kWakeTag) {
        wake_withdrawn = true;
        return;
      }
      Slot &s = slots_[static_cast<size_t>(tag)];
      s.task.req->fail(e.err, s.task.offset + s.done, s.task.length - s.done, e.what.c_str());
      std::lock_guard<std::mutex> lock(mu_);
      finish(static_cast<int>(tag));
    });
    if (wake_withdrawn) arm_wake();
  }

  // The ring itself broke (io_uring_enter failed): no task may be left hanging.
  void fail_everything(const IOError &e) {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      if (!slots_[i].task.req) continue;
      slots_[i].task.req->fail(e.err, slots_[i].task.offset, slots_[i].task.length, e.what.c_str());
      finish(static_cast<int>(i));
    }
    for (auto &t : pending_) {
      t.req->fail(e.err, t.offset, t.length, e.what.c_str());
      t.req->task_finished();
    }
    pending_.clear();
    stopping_ = true;
  }

  uint64_t staging_stride_;  // block_size rounded up to a page
  int staging_blocks_;       // queue_depth of them, or fewer within the staging budget
  uint64_t byte_budget_;      // queue_depth blocks
  uint64_t bytes_in_flight_ = 0;
  Ring ring_;
  int wake_fd_ = -1;
  std::mutex mu_;
  std::deque<Task> pending_;
  bool stopping_ = false;
  std::vector<Slot> slots_;
  AlignedBuffer staging_;  // mapped for the first misaligned direct task
  std::vector<uint64_t> staging_faulted_;  // per staging block, the bytes faulted in so far
  std::vector<int> free_slots_;
  std::vector<int> free_staging_;
  std::thread loop_;
};

// Several rings, each with its own thread, sharing the work block by block. One
// ring thread alone does every staging copy and page fault-in of the engine in
// series; with several, those run on as many cores while the rings keep the drive busy.
class MultiRingBackend final : public Backend {
 public:
  MultiRingBackend(int rings, int queue_depth, uint64_t block_size) {
    const int depth_each = std::max(1, queue_depth / rings);
    for (int i = 0; i < rings; ++i)
      rings_.push_back(std::make_unique<UringBackend>(depth_each, block_size, kStagingBudget / rings));
  }

  void submit(std::vector<Task> &&tasks) override {
    std::vector<std::vector<Task>> shares(rings_.size());
    size_t next = next_.fetch_add(1, std::memory_order_relaxed);
    for (auto &t : tasks) shares[next++ % rings_.size()].push_back(std::move(t));
    bool accepted = false;
    for (size_t i = 0; i < rings_.size(); ++i) {
      if (shares[i].empty()) continue;
      try {
        rings_[i]->submit(std::move(shares[i]));
        accepted = true;
      } catch (const IOError &e) {
        // Nothing in flight yet: the caller may have the exception. Once a ring has taken
        // its share, that share writes the caller's memory until it ends, so the request
        // must stay to be waited on: a refused share fails it instead.
        if (!accepted) throw;
        for (auto &t : shares[i]) {
          t.req->fail(e.err, t.offset, t.length, e.what.c_str());
          t.req->task_finished();
        }
      }
    }
  }

  void shutdown() override {
    for (auto &r : rings_) r->shutdown();
  }

  const char *name() const override { return "io_uring"; }

 private:
  std::vector<std::unique_ptr<UringBackend>> rings_;
  std::atomic<size_t> next_{0};
};

}  // namespace

void inject_uring_enter_failures(int count, int err) {
  injected_enter_errno.store(err);
  injected_enter_failures.store(count);
}

void inject_uring_results(int count, int res) {
  injected_result.store(res);
  injected_results.store(count);
}

std::unique_ptr<Backend> make_uring_backend(int rings, int queue_depth, uint64_t block_size) {
  if (queue_depth < 1 || queue_depth > 4096) throw IOError{EINVAL, "", "queue_depth must be between 1 and 4096"};
  rings = std::max(1, std::min(rings, queue_depth));
  if (rings == 1) return std::make_unique<UringBackend>(queue_depth, block_size, kStagingBudget);
  return std::make_unique<MultiRingBackend>(rings, queue_depth, block_size);
}

bool uring_available(std::string *why) {
  try {
    Ring ring(2);
    io_uring_sqe *sqe = ring.next_sqe();
    sqe->opcode = IORING_OP_NOP;
    sqe->user_data = 7;
    ring.enter(true);
    bool ok = false;
    ring.reap([&](uint64_t tag, int res) { ok = (tag == 7 && res == 0); });
    if (!ok && why) *why = "io_uring NOP did not complete";
    return ok;
  } catch (const IOError &e) {
    if (why) *why = e.what + ": " + std::strerror(e.err);
    return false;
  }
}

}  // namespace tf
