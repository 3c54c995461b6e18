// Inter-rank ordering of the tokenweave kernels: a signal pad in every rank's IPC allocation,
// per-CTA flags carrying a device-side epoch, bounded spins.
//
// Protocol (also in docs/kernel.md)
// ---------------------------------
// Every rank's symmetric allocation starts with a header: a SignalPad (kSignalBytes, zeroed at
// creation), then the one-shot path's receive buffers (oneshot.cuh).
// A launch uses G CTAs (the same G on every rank: G depends only on the shapes and the CTA count,
// which every rank passes identically). CTA b of every launch:
//   1. reads e = pad.epoch[b] + 1 from its OWN pad and writes it back (device-side, monotonic:
//      a CUDA graph replays the same kernel arguments and still gets a fresh epoch);
//   2. START barrier: thread t < P does st.release.sys peer_pad[t].start[b][rank] = e, then spins
//      with ld.acquire.sys on own pad.start[b][t] until it reaches e. After it, every peer's stream
//      has reached this op, so its partial rows are written and its normed_out rows are free;
//   3. moves data (loads peers' partials, stores normed rows to peers);
//   4. END barrier: __syncthreads, then the same with pad.end: after it every peer's CTA b has
//      finished reading my partial rows and writing my normed rows of the row set owned by b
//      (rows are split between CTAs by index, identically on every rank). The launch on rank r
//      completes only when all its CTAs passed END, so when the next kernel on r's stream runs,
//      no peer touches r's buffer for this op any more.
// No flag is reused too early: a peer writes start=e+1 into my slot only after it passed END(e),
// which needs my end=e, which I write after I consumed start=e; a peer writes end=e+1 only after
// it passed START(e+1), which needs my start=e+1, which I write after I consumed end=e. So every
// slot is overwritten only after its previous value was read; the wait uses wrap-safe `>=`.
// No deadlock: a CTA only waits for CTAs of the same index on other ranks, which wait for nothing
// but this CTA's flags; every CTA eventually becomes resident (G <= kMaxCtas, other kernels on the
// GPU do not wait on us), and ops are issued in the same order on every rank (caller's contract:
// one op in flight per buffer). If a peer never arrives (crash, mismatched calls), the spin ends
// after timeout_ns (%globaltimer) and the CTA records an error in pad.error, writes NaN into its
// outputs and returns; later launches see the error and write NaN at once. The error is sticky: the
// host raises it (the communicator copies the error words to pinned memory after every forward,
// also inside CUDA graphs) and the buffer must be recreated.
#pragma once

#include "tokenweave/common.cuh"

namespace tokenweave {

constexpr int64_t kSignalBytes = 64 * 1024;  // the SignalPad's part of each header
// The one-shot path's receive buffers follow the SignalPad in the header (oneshot.cuh).
constexpr int kOneShotRounds = 3;
constexpr int64_t kOneShotRoundBytes = int64_t{8} << 20;
constexpr int64_t kHeaderBytes = kSignalBytes + kOneShotRounds * kOneShotRoundBytes;

enum ErrorCode : uint32_t {
  kOk = 0,
  kTimeoutStart = 1,
  kTimeoutEnd = 2,
  kTimeoutArrival = 3,
  kTimeoutTile = 4,  // gemm_reduce.cuh: a source's GEMM tiles of a block never came
};

// Barrier slots: one per CTA index of the kernels' launches, plus two for the copy-engine op's
// one-CTA barrier kernels (copy_engine.cuh: START/END on the first, MID on the second's start
// flags, all with the first slot's epoch).
constexpr int kBarrierSlots = kMaxCtas + 2;
constexpr int kCopyEngineSlot = kMaxCtas;
constexpr int kCopyEngineMidSlot = kMaxCtas + 1;

struct SignalPad {
  uint32_t error[4];                    // local: code, peer, slot, epoch (or one-shot round);
                                        // first, so the host finds it at offset 0
  uint32_t start[kBarrierSlots][kMaxRanks];  // [b][src]: written by rank src (release), read here
  uint32_t end[kBarrierSlots][kMaxRanks];
  uint32_t epoch[kBarrierSlots];        // local: last epoch used by slot b
  uint32_t oneshot_round;               // local: next one-shot round
  uint32_t oneshot_done;                // local: CTAs of the current one-shot launch finished
  uint32_t oneshot_vecs[kOneShotRounds];  // local: 16-byte vectors round (i mod 3) used
};
static_assert(sizeof(SignalPad) <= kSignalBytes, "signal pad too large");

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Record the first error of this rank (later ones keep the first): code, the peer that never
// came, the slot (CTA, row block or round) and the epoch; visible to the host's copy at once.
__device__ __forceinline__ void record_error(SignalPad* self, uint32_t code, int peer, int slot,
                                             uint32_t epoch) {
  if (atomicCAS(&self->error[0], 0u, code) == 0u) {
    self->error[1] = static_cast<uint32_t>(peer);
    self->error[2] = static_cast<uint32_t>(slot);
    self->error[3] = epoch;
    __threadfence_system();
  }
}

// Thread 0 of the CTA: take the next epoch of CTA b; returns 0 if an earlier error is pending.
__device__ __forceinline__ uint32_t next_epoch(SignalPad* self, int b) {
  if (*reinterpret_cast<volatile uint32_t*>(&self->error[0]) != kOk) return 0;
  uint32_t e = self->epoch[b] + 1;
  if (e == 0) e = 1;  // 0 is "no epoch"; wrap-around after 2^32 launches of CTA b
  self->epoch[b] = e;
  return e;
}

// One barrier phase (start or end) of CTA b among `world` ranks. All threads of the CTA call it.
// Returns false (for every thread) if a peer did not arrive within timeout_ns.
// `pad_bases[q]` is rank q's signal pad (device array of peer pointers).
template <bool kEnd>
__device__ __forceinline__ bool cta_barrier(const int64_t* pad_bases, int rank, int world, int b,
                                            uint32_t e, uint64_t timeout_ns, int* s_fail) {
  __syncthreads();  // all earlier loads/stores of the CTA happen before the release below
  const int t = threadIdx.x;
  if (t < world) {
    SignalPad* peer = reinterpret_cast<SignalPad*>(pad_bases[t]);
    SignalPad* self = reinterpret_cast<SignalPad*>(pad_bases[rank]);
    uint32_t* slot = kEnd ? &peer->end[b][rank] : &peer->start[b][rank];
    st_release_sys(slot, e);
    const uint32_t* mine = kEnd ? &self->end[b][t] : &self->start[b][t];
    const uint64_t t0 = global_timer_ns();
    uint32_t spins = 0;
    while (static_cast<int32_t>(ld_acquire_sys(mine) - e) < 0) {
      if ((++spins & 1023u) == 0 && global_timer_ns() - t0 > timeout_ns) {
        record_error(self, kEnd ? kTimeoutEnd : kTimeoutStart, t, b, e);
        atomicExch(s_fail, 1);
        break;
      }
    }
  }
  __syncthreads();
  return *reinterpret_cast<volatile int*>(s_fail) == 0;
}

}  // namespace tokenweave
