// The gate of one index: searches share it, a change (add, truncate, reset, remove, permute) takes it alone.
//
// An add under searching threads must wait for the searches already running and for nothing else. Measured
// on 2 cores (an add of 2,000 rows to 200,000 x 128 float32, 1.4 ms idle, while 8 threads each search one
// query in a loop; bench/add_under_search.py), three things held it up, and the gate answers each:
//
// - Searches that arrive after the add. Once a change waits, searches that arrive later, and searches still
//   waiting for a place, wait behind it (with std::shared_mutex, glibc lets new readers in ahead of a
//   waiting writer: the add took a median 414 ms against 7.7 ms idle).
// - Every search running. Each search runs on the caller's thread (and the pool's, pool.h), so 8 threads
//   searching at once kept 8 searches in flight on 2 cores, each at a quarter of its speed, and the add
//   waited until the last of them had finished. So at most `places` searches run at once, one per core
//   this process may use; a search beyond them waits for a place (asleep: it does not compete for the cores
//   with the searches running, with a waiting add, or with the Python thread that holds the GIL). More
//   searches at once would not finish sooner, they would share the cores.
// - Its own thread, after the change. Waking the searches it held back at the moment it finished gave them
//   the cores while the add's thread still had to get back into Python (the GIL, the Index's bookkeeping):
//   the scheduler, owing them time, kept it off the cores for a time slice or more (median 7-9 ms, the
//   add's thread runnable but not running; measured from /proc/thread-self/schedstat). So the searches
//   resume a grace after a change, min(kGrace, as long as the change held the gate), woken by one of them
//   (the doorman: the change wakes only it, and it sleeps until the grace is over, then wakes the others).
//   The grace costs the searches held back at most as long again as the change held them.
//
// It has lock()/unlock()/lock_shared()/unlock_shared(), so std::unique_lock and std::shared_lock take it.
// No thread may take it shared twice (a second lock_shared could wait for a place only the first frees).
#pragma once
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include <sched.h>

namespace tinyknn {

// The cores this process may run on (its affinity mask), at least 1.
inline int usable_cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? (int)n : 1;
}

class WriterFirstGate {
  typedef std::chrono::steady_clock Clock;

 public:
  // Long enough for a caller's thread to return from the library into Python and finish Index.add
  // (measured: 0.06-0.15 ms for 2,000 rows).
  static constexpr std::chrono::microseconds kGrace{300};

  explicit WriterFirstGate(int places = usable_cores()) : places_(std::max(1, places)) {}

  void lock_shared() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (writing_ || writers_waiting_ > 0) {
        readers_turn_.wait(lock);  // until a change wakes the doorman, or a place frees
        continue;
      }
      if (reopen_at_ != Clock::time_point()) {  // a change finished: its grace first
        if (Clock::now() < reopen_at_) {
          readers_turn_.wait_until(lock, reopen_at_);
          continue;
        }
        reopen_at_ = Clock::time_point();
        readers_turn_.notify_all();  // the doorman (or whoever is first after the grace) opens for all
      }
      if (readers_ < places_) break;
      readers_turn_.wait(lock);
    }
    ++readers_;
  }

  void unlock_shared() {
    std::unique_lock<std::mutex> lock(mutex_);
    --readers_;
    const bool writer_next = writers_waiting_ > 0, last = readers_ == 0;
    lock.unlock();
    if (!writer_next) {
      readers_turn_.notify_one();  // a place is free
    } else if (last) {
      writers_turn_.notify_one();
    }
  }

  void lock() {
    std::unique_lock<std::mutex> lock(mutex_);
    ++writers_waiting_;
    writers_turn_.wait(lock, [&] { return !writing_ && readers_ == 0; });
    --writers_waiting_;
    writing_ = true;
    locked_at_ = Clock::now();
  }

  void unlock() {
    std::unique_lock<std::mutex> lock(mutex_);
    writing_ = false;
    const Clock::time_point now = Clock::now();
    reopen_at_ = now + std::min<Clock::duration>(kGrace, now - locked_at_);
    const bool writer_next = writers_waiting_ > 0;
    lock.unlock();
    if (writer_next) {
      writers_turn_.notify_one();
    } else {
      readers_turn_.notify_one();  // the doorman
    }
  }

 private:
  std::mutex mutex_;
  std::condition_variable readers_turn_, writers_turn_;
  const int places_;
  int readers_ = 0, writers_waiting_ = 0;
  bool writing_ = false;
  Clock::time_point locked_at_{}, reopen_at_{};  // reopen_at_: the end of the last change's grace, until passed
};

}  // namespace tinyknn
