// thread_pool.hpp - the kernels' persistent threads: started once, parked between calls.
//
// Spawning std::threads for every update costs tens of microseconds per thread, as much
// as the whole kernel at the paper's size; these threads are started the first time a call
// asks for them and stay. Between calls each spins for a few microseconds (the next update
// often follows at once), then sleeps on a condition variable, so that an idle master gives
// its cores back to the workers and the evaluation beside it.
//
// Pool thread w (1, 2, ...) always runs part w of a call: the part of θ, of the mailboxes
// and of the per-worker state it first touched is the part it streams ever after.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if !defined(_WIN32)
#include <unistd.h>
#endif

namespace gem_mpi {

class ThreadPool {
 public:
  using Job = void (*)(void* ctx, int part);

  // How long a parked thread, and a caller waiting for the others, spins before it sleeps.
  static constexpr std::chrono::microseconds kSpin{20};

  // The process's pool (a fresh one in a forked child, whose threads the fork did not copy).
  // Never destroyed: threads parked at exit must not outlive their condition variable.
  static ThreadPool& instance() {
    static std::mutex guard;
    static ThreadPool* pool = nullptr;
    std::lock_guard<std::mutex> lock(guard);
    if (pool == nullptr || pool->pid_ != current_pid()) pool = new ThreadPool();  // the
    return *pool;  // old pool of a parent process is left as it is: its threads are gone
  }

  // job(ctx, part) for part = 0 .. parts - 1: part 0 on the calling thread, part w on pool
  // thread w. Returns once every part is done. Calls are serialised; a job must not call
  // run() itself.
  void run(int parts, Job job, void* ctx) {
    if (parts <= 1) {
      job(ctx, 0);
      return;
    }
    std::lock_guard<std::mutex> serial(run_mutex_);
    grow(parts - 1);
    job_ = job;
    ctx_ = ctx;
    pending_.store(parts - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++generation_;
      word_.store((generation_ << 16) | static_cast<std::uint64_t>(parts),
                  std::memory_order_release);
    }
    wake_.notify_all();
    job(ctx, 0);
    if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    }
  }

  // Pool threads started so far (the callers' own thread not counted).
  int size() const {
    std::lock_guard<std::mutex> serial(run_mutex_);
    return static_cast<int>(threads_.size());
  }

 private:
  ThreadPool() : pid_(current_pid()) {}

  static long current_pid() {
#if defined(_WIN32)
    return 0;
#else
    return static_cast<long>(::getpid());
#endif
  }

  static void relax() {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#else
    std::this_thread::yield();
#endif
  }

  template <class Pred>
  static bool spin_until(Pred&& ready) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    for (;;) {
      for (int i = 0; i < 64; ++i) {
        if (ready()) return true;
        relax();
      }
      if (std::chrono::steady_clock::now() >= until) return ready();
    }
  }

  // Start pool threads up to `workers` (under run_mutex_, between calls).
  void grow(int workers) {
    while (static_cast<int>(threads_.size()) < workers) {
      const int part = static_cast<int>(threads_.size()) + 1;
      const std::uint64_t seen = generation_;
      threads_.emplace_back([this, part, seen] { loop(part, seen); });
      threads_.back().detach();  // never joined: the pool lives as long as the process
    }
  }

  void loop(int part, std::uint64_t seen) {
    for (;;) {
      auto changed = [this, seen] {
        return (word_.load(std::memory_order_acquire) >> 16) != seen;
      };
      if (!spin_until(changed)) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, changed);
      }
      const std::uint64_t word = word_.load(std::memory_order_acquire);
      seen = word >> 16;
      if (part < static_cast<int>(word & 0xffff)) {  // this call has a part for this thread
        job_(ctx_, part);
        if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          std::lock_guard<std::mutex> lock(mutex_);
          done_.notify_one();
        }
      }
    }
  }

  const long pid_;
  mutable std::mutex run_mutex_;  // one call at a time
  std::vector<std::thread> threads_;
  std::mutex mutex_;  // guards the sleeps on wake_ and done_
  std::condition_variable wake_, done_;
  std::uint64_t generation_ = 0;  // calls published so far (under mutex_)
  std::atomic<std::uint64_t> word_{0};  // generation << 16 | parts of the current call
  std::atomic<int> pending_{0};  // pool threads still running their part
  Job job_ = nullptr;  // the current call; written only while no pool thread runs a part
  void* ctx_ = nullptr;
};

}  // namespace gem_mpi
