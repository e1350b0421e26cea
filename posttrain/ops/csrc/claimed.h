// A parallel loop whose indices threads claim in runs (cpu_kernels.py folds this file into the build's name).
//
// at::parallel_for splits a range statically: each thread gets an equal share and the region ends when the slowest
// share is done. On a shared host one vCPU is often slowed by its neighbours for a while, and then every region of a
// decode step waits for it (measured, 2 vCPUs of an Intel Xeon: the 121 linears of a 64-row decode step took 93-110
// ms split statically against 70-85 ms claimed, in the same minutes; 65-67 ms both on a quiet host). Claiming costs
// one compare-and-swap per run of indices (below). Each index's work and result are the same whichever thread runs it.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace posttrain_par {

// Runs, over at most min(n, threads) threads, each claiming the next unclaimed indices when it is free:
//   auto body = start(first);  once per thread, with the first index it claimed (per-thread set-up, prefetch)
//   body(i, next);             for every index i it claims, in claim order; next is the index it has already
//                              claimed to run after i (n if none), so the body can prefetch next's data.
// Claims are guided: a run of max(1, left / (4 * threads)) consecutive indices, so the first runs are an eighth of
// the work each (2 threads) and the last ones single indices. One index per claim made both threads of a decode
// step's GEMMs pass one cache line back and forth ~6400 times a step (SmolLM2-135M, 64 rows: 30 q|k|v, 18 o, 96
// gate|up, 18 down panels a layer, 1536 lm-head ones); guided runs took the 121 linears from 58.4 to 56.5 ms
// (median of 12 alternating rounds in one process, 2 vCPUs of an Intel Xeon, oneDNN capped below AMX). A run of r
// is claimed only while >= 8r indices are left (2 threads), and a thread holds its next index before it runs the
// current one, so the last indices may wait on a busy thread for about one index's time.
template <typename Start>
void claimed_for(int64_t n, Start&& start) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(n, at::get_num_threads());
  alignas(64) std::atomic<int64_t> claims{0};  // a line of its own: the caller's stack is written meanwhile
  auto claim = [&](int64_t& end) {  // the next run [first, end), or n if none is left
    int64_t first = claims.load(std::memory_order_relaxed);
    while (first < n) {
      const int64_t run = std::max<int64_t>(1, (n - first) / (4 * threads));
      if (claims.compare_exchange_weak(first, first + run)) {
        end = first + run;
        return first;
      }
    }
    return n;
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t end = 0, i = claim(end);  // inside another parallel region this runs once and claims every index
    if (i >= n) return;
    auto body = start(i);
    while (i < n) {
      const int64_t next = i + 1 < end ? i + 1 : claim(end);
      body(i, next);
      i = next;
    }
  });
}

}  // namespace posttrain_par
