// A pool of threads doing blocking pread/pwrite: works wherever POSIX does.
#include <cerrno>
#include <deque>
#include <thread>

#include "engine.hpp"

namespace tf {

namespace {

class ThreadBackend final : public Backend {
 public:
  ThreadBackend(int threads, uint64_t block_size) : block_size_(block_size) {
    if (threads < 1) throw IOError{EINVAL, "", "threads must be at least 1"};
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadBackend() override { shutdown(); }

  void submit(std::vector<Task> &&tasks) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) throw IOError{EBADF, "", "I/O submitted to a closed engine"};
      for (auto &t : tasks) queue_.push_back(std::move(t));
    }
    if (tasks.size() == 1)
      cv_.notify_one();
    else
      cv_.notify_all();
  }

  void shutdown() override {
    if (forked()) {
      // The threads live only in the parent: joining or detaching their handles
      // fails here and destroying them aborts, so the handles are left behind (and
      // the lock, which a parent thread may have held at the fork, is not touched).
      new std::vector<std::thread>(std::move(workers_));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto &w : workers_) w.join();
    workers_.clear();  // a second shutdown finds nothing to join
  }

  const char *name() const override { return "threads"; }

 private:
  void work() {
    AlignedBuffer bounce;      // mapped for the first misaligned direct task
    uint64_t bounce_faulted = 0;  // and faulted in as far as such tasks reach
    for (;;) {
      Task task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and every accepted task is done
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      try {
        if (task.needs_bounce) {
          if (bounce.data() == nullptr) bounce = AlignedBuffer(block_size_);
          fault_in_staging(bounce.data(), task.length, &bounce_faulted);
        }
        run_task_blocking(task, bounce.data());
      } catch (const IOError &e) {
        task.req->fail(e.err, task.offset, task.length, e.what.c_str());
      }
      task.req->task_finished();
    }
  }

  uint64_t block_size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> make_thread_backend(int threads, uint64_t block_size) {
  return std::make_unique<ThreadBackend>(threads, block_size);
}

}  // namespace tf
