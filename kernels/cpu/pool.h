// A small thread pool: the library's own threads (Python never creates them).
//
// run(n_tasks, threads, fn) calls fn(task) for every task in [0, n_tasks) on up to `threads` threads,
// the caller being one of them, and returns when all are done. The first exception thrown by any task
// (on any thread) is rethrown in the caller, so the ABI boundary sees worker errors too.
// One pool serves the process. A caller that finds it busy (another Python thread searching at the same
// time) runs its tasks itself instead of waiting: concurrent searches then proceed side by side.
#pragma once
#include <atomic>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <unistd.h>

namespace tinyknn {

class ThreadPool {
 public:
  static ThreadPool& shared() {
    // Never destroyed: at process exit the workers die with the process instead of being joined.
    static ThreadPool* pool = new ThreadPool();
    return *pool;
  }

  void run(int n_tasks, int threads, const std::function<void(int)>& fn) {
    if (n_tasks <= 0) return;
    threads = threads < 1 ? 1 : (threads > n_tasks ? n_tasks : threads);
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (threads == 1 || !busy.owns_lock() || owner_pid_ != getpid()) {
      for (int task = 0; task < n_tasks; ++task) fn(task);
      return;
    }
    grow(threads - 1);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &fn;
      n_tasks_ = n_tasks;
      next_task_.store(0);
      helpers_wanted_ = threads - 1;
      helpers_running_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    helpers_wanted_ = 0;  // helpers that have not woken yet are not needed any more
    done_.wait(lock, [&] { return helpers_running_ == 0; });
    job_ = nullptr;
    if (error_) std::rethrow_exception(error_);
  }

 private:
  ThreadPool() : owner_pid_(getpid()) {}

  void grow(int helpers) {
    while ((int)workers_.size() < helpers) workers_.emplace_back([this] { loop(); });
  }

  // Takes tasks until none are left; records the first exception instead of letting it escape.
  void work() {
    for (int task = next_task_.fetch_add(1); task < n_tasks_; task = next_task_.fetch_add(1)) {
      try {
        (*job_)(task);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        next_task_.store(n_tasks_);  // stop handing out tasks
      }
    }
  }

  void loop() {
    unsigned long seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen && helpers_wanted_ > 0; });
        seen = generation_;
        --helpers_wanted_;
        ++helpers_running_;
      }
      work();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        --helpers_running_;
      }
      done_.notify_all();
    }
  }

  std::mutex busy_;                  // held by the one caller that owns the pool now
  std::mutex mutex_;                 // guards everything below
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  int n_tasks_ = 0;
  std::atomic<int> next_task_{0};
  int helpers_wanted_ = 0, helpers_running_ = 0;
  unsigned long generation_ = 0;
  std::exception_ptr error_;
  const pid_t owner_pid_;            // after fork() the workers are gone: run in the caller instead
};

}  // namespace tinyknn
