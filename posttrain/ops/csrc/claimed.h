// A parallel loop whose indices threads claim one at a time (cpu_kernels.py folds this file into the build's name).
//
// at::parallel_for splits a range statically: each thread gets an equal share and the region ends when the slowest
// share is done. On a shared host one vCPU is often slowed by its neighbours for a while, and then every region of a
// decode step waits for it (measured, 2 vCPUs of an Intel Xeon: the 121 linears of a 64-row decode step took 93-110
// ms split statically against 70-85 ms claimed, in the same minutes; 65-67 ms both on a quiet host). Claiming costs
// one atomic add per index. Each index's work and result are the same whichever thread runs it.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace posttrain_par {

// Runs, over at most min(n, threads) threads, each claiming the next unclaimed index when it is free:
//   auto body = start(first);  once per thread, with the first index it claimed (per-thread set-up, prefetch)
//   body(i, next);             for every index i it claims, in claim order; next is the index it has already
//                              claimed to run after i (n if none), so the body can prefetch next's data.
// A thread holds one claim ahead, so the last indices may wait on a busy thread for at most one index's time.
template <typename Start>
void claimed_for(int64_t n, Start&& start) {
  if (n <= 0) return;
  std::atomic<int64_t> claims{0};
  at::parallel_for(0, std::min<int64_t>(n, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    int64_t i = claims.fetch_add(1);  // inside another parallel region this runs once and claims every index
    if (i >= n) return;
    auto body = start(i);
    while (i < n) {
      const int64_t next = std::min(claims.fetch_add(1), n);
      body(i, next);
      i = next;
    }
  });
}

}  // namespace posttrain_par
