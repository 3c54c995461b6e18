// Inter-rank ordering of the tokenweave kernels: a signal pad in every rank's IPC allocation,
// per-CTA flags carrying a device-side epoch and the call's tag, bounded spins.
//
// Protocol (also in docs/kernel.md)
// ---------------------------------
// Every rank's symmetric allocation starts with a header: a SignalPad (kSignalBytes, zeroed at
// creation), then the one-shot path's receive buffers (oneshot.cuh).
// A launch uses G CTAs (the same G on every rank: G depends only on the shapes and the CTA count,
// which every rank passes identically) and carries the call's tag (the caller's name for the
// call, hashed with its shape: the same on every rank for the same call, kernels' FusedParams).
// CTA b of every launch:
//   1. reads e = pad.epoch[b] + 1 from its OWN pad and writes it back (device-side, monotonic:
//      a CUDA graph replays the same kernel arguments and still gets a fresh epoch);
//   2. START barrier: thread t < P stores the tag into peer_pad[t].start_tag[b][rank], then does
//      st.release.sys peer_pad[t].start[b][rank] = e, then spins with ld.acquire.sys on own
//      pad.start[b][t] until it reaches e. It must then read exactly e, and own
//      pad.start_tag[b][t] must hold this call's tag: a peer whose flag is past e, or whose tag
//      differs, is on another call (the ranks' calls diverged), and the CTA gives up as on a
//      timeout (kCallMismatch, naming the peer, both epochs and both tags) without reading the
//      peer's rows. After it, every peer's stream has reached this very call, so its partial rows
//      are written and its normed_out rows are free;
//   3. moves data (loads peers' partials, stores normed rows to peers);
//   4. END barrier: __syncthreads, then the same with pad.end, waiting until the flag reaches e
//      (epochs only: a peer may be past it here, see below): after it every peer's CTA b has
//      finished reading my partial rows and writing my normed rows of the row set owned by b
//      (rows are split between CTAs by index, identically on every rank). The launch on rank r
//      completes only when all its CTAs passed END, so when the next kernel on r's stream runs,
//      no peer touches r's buffer for this op any more.
// No flag is reused too early: a peer writes start=e+1 into my slot only after it passed END(e),
// which needs my end=e, which I write after I consumed start=e; a peer writes end=e+1 only after
// it passed START(e+1), which needs my start=e+1, which I write after I consumed end=e. So every
// start slot is overwritten only after its previous value was read, and a healthy peer's start
// flag is never past the epoch I wait for (past it is a divergence). An end flag may be: a
// kernel with an END barrier only (the GEMM-fused consumer, gemm_reduce.cuh, whose call is
// checked by its flags and tags instead) lets a peer that passed END(e) reach END(e + 1) while I
// still wait, so END accepts any epoch from e on (wrap-safe ordering). A tag is read only after
// its flag (acquire), so it is the tag the flag's writer stored first.
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
// The one-shot path's receive buffers follow the SignalPad in the header (oneshot.cuh): each
// holds kOneShotRoundBytes of rows, then one tag vector per source rank and CTA.
constexpr int kOneShotRounds = 3;
constexpr int64_t kOneShotRoundBytes = int64_t{8} << 20;
constexpr int64_t kOneShotTagBytes = int64_t{kMaxRanks} * kMaxCtas * kVecBytes;
constexpr int64_t kOneShotBufferBytes = kOneShotRoundBytes + kOneShotTagBytes;
constexpr int64_t kHeaderBytes = kSignalBytes + kOneShotRounds * kOneShotBufferBytes;

enum ErrorCode : uint32_t {
  kOk = 0,
  kTimeoutStart = 1,
  kTimeoutEnd = 2,
  kTimeoutArrival = 3,
  kTimeoutTile = 4,  // gemm_reduce.cuh: a source's GEMM tiles of a block never came
  kCallMismatch = 5,  // a peer published for another call (epoch past this one, or another tag)
};

// The error words (SignalPad.error, the host's copy): what failed, where, and both calls.
enum ErrorWord : int {
  kErrCode = 0,
  kErrPeer = 1,
  kErrSlot = 2,       // CTA, row block or barrier slot
  kErrEpoch = 3,      // this rank's epoch (or one-shot round)
  kErrPeerEpoch = 4,  // kCallMismatch: the peer's
  kErrTag = 5,        // kCallMismatch: this call's tag
  kErrPeerTag = 6,    // kCallMismatch: the peer's
  kErrorWords = 8,
};

// Barrier slots: one per CTA index of the kernels' launches, plus two for the copy-engine op's
// one-CTA barrier kernels (copy_engine.cuh: START/END on the first, MID on the second's start
// flags, all with the first slot's epoch).
constexpr int kBarrierSlots = kMaxCtas + 2;
constexpr int kCopyEngineSlot = kMaxCtas;
constexpr int kCopyEngineMidSlot = kMaxCtas + 1;

struct SignalPad {
  uint32_t error[kErrorWords];          // local: ErrorWord; first, so the host finds it at 0
  uint32_t start[kBarrierSlots][kMaxRanks];  // [b][src]: written by rank src (release), read here
  uint32_t start_tag[kBarrierSlots][kMaxRanks];  // [b][src]: the call's tag, stored before start
  uint32_t end[kBarrierSlots][kMaxRanks];
  uint32_t epoch[kBarrierSlots];        // local: last epoch used by slot b
  uint32_t oneshot_round;               // local: next one-shot round
  uint32_t oneshot_done;                // local: CTAs of the current one-shot launch finished
  uint32_t oneshot_vecs[kOneShotRounds];  // local: 16-byte vectors round (i mod 3) used
  uint32_t oneshot_ctas[kOneShotRounds];  // local: CTAs (tag vectors per source) it used
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

__device__ __forceinline__ void st_relaxed_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t ld_relaxed_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Record the first error of this rank (later ones keep the first): code, the peer that never
// came or was on another call, the slot (CTA, row block or round), this rank's epoch, and for
// kCallMismatch the peer's epoch and both tags; visible to the host's copy at once.
__device__ __forceinline__ void record_error(SignalPad* self, uint32_t code, int peer, int slot,
                                             uint32_t epoch, uint32_t peer_epoch = 0,
                                             uint32_t tag = 0, uint32_t peer_tag = 0) {
  if (atomicCAS(&self->error[kErrCode], 0u, code) == 0u) {
    self->error[kErrPeer] = static_cast<uint32_t>(peer);
    self->error[kErrSlot] = static_cast<uint32_t>(slot);
    self->error[kErrEpoch] = epoch;
    self->error[kErrPeerEpoch] = peer_epoch;
    self->error[kErrTag] = tag;
    self->error[kErrPeerTag] = peer_tag;
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
// Returns false (for every thread) if a peer did not arrive within timeout_ns or (START only) is
// on another call: its flag past e, or its tag not `tag` (0: a launch that checks none).
// `pad_bases[q]` is rank q's signal pad (device array of peer pointers).
template <bool kEnd>
__device__ __forceinline__ bool cta_barrier(const int64_t* pad_bases, int rank, int world, int b,
                                            uint32_t e, uint32_t tag, uint64_t timeout_ns,
                                            int* s_fail) {
  __syncthreads();  // all earlier loads/stores of the CTA happen before the release below
  const int t = threadIdx.x;
  if (t < world) {
    SignalPad* peer = reinterpret_cast<SignalPad*>(pad_bases[t]);
    SignalPad* self = reinterpret_cast<SignalPad*>(pad_bases[rank]);
    uint32_t* slot = kEnd ? &peer->end[b][rank] : &peer->start[b][rank];
    if (!kEnd) st_relaxed_sys(&peer->start_tag[b][rank], tag);  // ordered by the release below
    st_release_sys(slot, e);
    const uint32_t* mine = kEnd ? &self->end[b][t] : &self->start[b][t];
    const uint64_t t0 = global_timer_ns();
    uint32_t spins = 0;
    uint32_t seen = ld_acquire_sys(mine);
    bool failed = false;
    while (static_cast<int32_t>(seen - e) < 0) {
      if ((++spins & 1023u) == 0 && global_timer_ns() - t0 > timeout_ns) {
        record_error(self, kEnd ? kTimeoutEnd : kTimeoutStart, t, b, e);
        failed = true;
        break;
      }
      seen = ld_acquire_sys(mine);
    }
    if (!kEnd && !failed && seen != e) {  // the peer is past this call
      record_error(self, kCallMismatch, t, b, e, seen, tag,
                   ld_relaxed_sys(&self->start_tag[b][t]));
      failed = true;
    } else if (!kEnd && !failed && tag != 0) {
      const uint32_t theirs = ld_relaxed_sys(&self->start_tag[b][t]);
      if (theirs != tag) {
        record_error(self, kCallMismatch, t, b, e, seen, tag, theirs);
        failed = true;
      }
    }
    if (failed) atomicExch(s_fail, 1);
  }
  __syncthreads();
  return *reinterpret_cast<volatile int*>(s_fail) == 0;
}

}  // namespace tokenweave
