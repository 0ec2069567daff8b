// One CUDA thread block on the host: each CUDA thread a std::thread, __syncthreads a std::barrier,
// and the warp intrinsics an exchange through a shared array between two warp barriers. Enough to
// run a __device__ function's logic (not its speed, nor the GPU's memory model) on the CPU.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <memory>
#include <thread>
#include <vector>

using std::max;
using std::min;

namespace emu {
inline thread_local int tid;
inline std::barrier<>* block_barrier;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
inline int exchange[1024];

// Run f() as `threads` CUDA threads of one block (threads a multiple of 32, ≤ 1024).
template <class F>
void run_block(int threads, F f) {
  std::barrier<> block(threads);
  block_barrier = &block;
  warp_barriers.clear();
  for (int w = 0; w < threads / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back([t, &f] { tid = t; f(); });
  for (auto& th : pool) th.join();
}
}  // namespace emu

struct EmuDim { int x; };
#define threadIdx (EmuDim{emu::tid})
#define __device__
#define __forceinline__ inline
#define __shared__ static  // blocks run one after another, so one static copy per block is right

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

inline int __shfl_xor_sync(unsigned, int v, int lane_mask) {
  auto& warp = *emu::warp_barriers[emu::tid >> 5];
  emu::exchange[emu::tid] = v;
  warp.arrive_and_wait();
  const int r = emu::exchange[emu::tid ^ lane_mask];
  warp.arrive_and_wait();
  return r;
}

inline unsigned __ballot_sync(unsigned, bool p) {
  const int first = emu::tid & ~31;
  auto& warp = *emu::warp_barriers[emu::tid >> 5];
  emu::exchange[emu::tid] = p;
  warp.arrive_and_wait();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= (emu::exchange[first + l] ? 1u : 0u) << l;
  warp.arrive_and_wait();
  return bits;
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int atomicOr(int* a, int v) { return std::atomic_ref<int>(*a).fetch_or(v); }
