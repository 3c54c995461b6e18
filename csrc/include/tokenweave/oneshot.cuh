// One-shot fused all-reduce + residual add + RMSNorm for small replicated-layout calls: no
// barrier round trips, the data carries its own arrival flag (Lamport-style). For decode-sized
// calls the barrier path's two sys-scope round trips (START, END) are most of its time.
//
// Protocol (also in docs/kernel.md)
// ---------------------------------
// Every rank's allocation header holds, after the SignalPad, kOneShotRounds receive buffers of
// kOneShotRoundBytes of rows and kOneShotTagBytes of tag vectors, whose 16-bit words start as
// 0x8000 (-0.0 in bf16 and fp16): "empty". Launch of round r (pad.oneshot_round, device-side,
// advanced by the last CTA of each launch, so CUDA graph replays get fresh rounds) uses buffer
// i = r % 3, rows laid out [src rank][rows][hidden], tags [src rank][CTA]:
//   1. push: CTA b stores its tag vector (the call's tag, r and the row count: tag_vector, no
//      16-bit word of it reads as "empty") into slot [rank][b] of the tags of buffer i of every
//      peer, then each row it owns (rows b, b+G, ...; G CTAs, the same on every rank) of this
//      rank's partial, with -0.0 replaced by +0.0 (same value; keeps "empty" unique), into slot
//      [rank][row] of buffer i of every peer: posted 16-byte NVLink stores, no waiting;
//   2. poll: for each of its rows every thread re-reads (volatile) its 16-byte vectors of slot
//      [q][row], q != rank, until none of its 16-bit words holds "empty" (so only 16-bit
//      writes need to arrive whole, which aligned stores always do);
//   3. check: thread q also polls tag slot [q][b] of its own buffer i, in the same spin as its
//      first vector of peer q's first row (both reads in flight at once: no round trip of its
//      own; a thread without a column of the row, hidden < 8 * world, polls the tag alone), and
//      compares it with its own: another tag, round or row count is a peer on another call
//      (kCallMismatch, naming it, both rounds and both tags; the row it polled is not waited
//      for). The CTA's first barrier, which every output store waits for, then makes every
//      thread give up (NaN outputs), and the CTA's threads stop polling any peer's rows
//      (s_abort) instead of waiting for the timeout: no row of another call reaches an output.
//      Every CTA has rows (grid <= rows: launch_oneshot.cu), so every CTA checks;
//   4. sums the P rows in rank order in fp32 (its own partial sanitized the same way: every rank
//      sums bit-identical values, so the replicated outputs are identical), adds the residual,
//      and after the row's barrier stores residual_out, normalizes, stores normed_out locally;
//   5. resets buffer (r - 1) % 3 of its own header (the rows and tag slots round r - 1 used,
//      pad.oneshot_vecs / oneshot_ctas[(r - 1) % 3]) to "empty";
//   6. the last CTA to finish records round r's extent and advances oneshot_round.
// A buffer is never written before it was reset, nor reset while in use: a peer is at most one
// round ahead (finishing round r + 1 needs my round r + 1 push, issued after my round r launch
// completed), so during my round r peers write buffer r % 3 or (r + 1) % 3, never (r - 1) % 3,
// which I reset; a peer writes (r - 1) % 3 = (r + 2) % 3 again only in round r + 2, after my round
// r launch (and its reset) completed. So a tag and the rows in one buffer are from the same round
// of their writer. No deadlock: pushes never wait, and CTA b polls only rows pushed by CTA b of
// every peer, which pushes before it polls. Bounded: polls give up after timeout_ns, record
// kTimeoutArrival, write NaN into the CTA's outputs and return; the round then never advances
// and later launches write NaN at once (the error is sticky, as on the barrier path). The
// partial buffer is free when the launch ends: peers never read it. The round counter wraps at a
// multiple of 3. Whether a call takes this path is the communicator's setting, agreed by every
// rank when it is created (a rank on the barrier path and one on this path would both time out).
#pragma once

#include "tokenweave/common.cuh"
#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/rmsnorm_row.cuh"
#include "tokenweave/signal.cuh"

namespace tokenweave {

constexpr uint32_t kEmptyWord = 0x80008000u;  // two 16-bit -0.0
constexpr uint32_t kOneShotRoundWrap = 0xFFFFFFFFu;  // rounds run 0 .. wrap - 1, then 0 again
static_assert(kOneShotRoundWrap % kOneShotRounds == 0, "the round wrap must keep the rotation");

__device__ __forceinline__ uint32_t sanitize_word(uint32_t w) {
  if ((w & 0xffffu) == 0x8000u) w &= 0xffff0000u;
  if ((w >> 16) == 0x8000u) w &= 0x0000ffffu;
  return w;
}

__device__ __forceinline__ Vec16 load_sanitized(const void* p) {
  Vec16 v = load_vec(p);
#pragma unroll
  for (int k = 0; k < 4; ++k) v.u[k] = sanitize_word(v.u[k]);
  return v;
}

__device__ __forceinline__ Vec16 load_volatile_vec(const void* p) {
  Vec16 v;
  TOKENWEAVE_LOAD_V4("ld.volatile.global.v4.u32", v, p);
  return v;
}

// The one-shot call's tag vector: the call's tag, its round and row count, 12 bits in each 16-bit
// word under a 0x1 top nibble (never the "empty" 0x8000).
__device__ __forceinline__ Vec16 tag_vector(uint32_t tag, uint32_t round, uint32_t rows) {
  const uint32_t v[3] = {tag, round, rows};
  uint32_t h[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) h[k] = 0x1000u | ((v[k / 3] >> (12 * (k % 3))) & 0xfffu);
  Vec16 out;
#pragma unroll
  for (int k = 0; k < 4; ++k) out.u[k] = h[2 * k] | (h[2 * k + 1] << 16);
  return out;
}

// Field f (0: tag, 1: round, 2: rows, as far as the vector holds it) of a tag vector.
__device__ __forceinline__ uint32_t tag_field(const Vec16& v, int f) {
  uint32_t x = 0;
  for (int k = 3 * f; k < 3 * f + 3 && k < 8; ++k)
    x |= ((v.u[k / 2] >> (16 * (k % 2))) & 0xfffu) << (12 * (k - 3 * f));
  return x;
}

__device__ __forceinline__ bool same_vec(const Vec16& a, const Vec16& b) {
  return a.u[0] == b.u[0] && a.u[1] == b.u[1] && a.u[2] == b.u[2] && a.u[3] == b.u[3];
}

__device__ __forceinline__ bool holds_empty(const Vec16& v) {
  bool e = false;
#pragma unroll
  for (int k = 0; k < 4; ++k) e |= ((v.u[k] & 0xffffu) == 0x8000u) || ((v.u[k] >> 16) == 0x8000u);
  return e;
}

// Whether polling should stop: timeout_ns have passed since t0, or another thread of the CTA
// found a peer on another call (*abort). Checked every 256 spins.
__device__ __forceinline__ bool give_up(uint32_t& spins, uint64_t t0, uint64_t timeout_ns,
                                        const volatile int* abort) {
  return (++spins & 255u) == 0 && (*abort || global_timer_ns() - t0 > timeout_ns);
}

enum Arrival : int { kArrived = 0, kGaveUp = 1, kOtherCall = 2 };

// Re-read (volatile) the 16-byte vector at `src` into `x` until none of its 16-bit words reads
// "empty" and, where `tag_src` is given (a peer's tag vector, the thread that checks it), that
// vector into `theirs` in the same spin until it arrived, so both reads are in flight at once:
// kArrived once both are in and the tag equals `mine`; kOtherCall as soon as the tag arrived
// and differs (the row may never come: it is not waited for); kGaveUp on give_up (`x` is then
// what was last read). One loop for every thread of a warp, whether it checks a tag or not:
// a separate spin for the checking lanes would run after (not beside) the others' spins. No
// `src` (nullptr): the tag alone.
__device__ __forceinline__ int arrived(const char* src, Vec16& x, const char* tag_src,
                                       Vec16& theirs, const Vec16& mine, uint64_t t0,
                                       uint64_t timeout_ns, const volatile int* abort) {
  x = src != nullptr ? load_volatile_vec(src) : mine;
  if (tag_src != nullptr) theirs = load_volatile_vec(tag_src);
  uint32_t spins = 0;
  for (;;) {
    bool tag_in = true;
    if (tag_src != nullptr) {
      tag_in = !holds_empty(theirs);
      if (tag_in && !same_vec(theirs, mine)) return kOtherCall;
    }
    const bool row_in = !holds_empty(x);
    if (tag_in && row_in) return kArrived;
    if (give_up(spins, t0, timeout_ns, abort)) return kGaveUp;
    if (!tag_in) theirs = load_volatile_vec(tag_src);
    if (!row_in) x = load_volatile_vec(src);
  }
}

template <typename T, int kNp, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    fused_allreduce_rmsnorm_oneshot_kernel(const FusedParams p) {
  __shared__ float s_red[2][kMaxThreads / 32];
  __shared__ uint32_t s_round;
  __shared__ int s_fail;
  __shared__ int s_abort;  // a thread found a peer on another call: stop polling

  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int world = p.world;
  const int grid = gridDim.x;
  const int64_t* pad_bases = p.bases + world;
  SignalPad* self = reinterpret_cast<SignalPad*>(pad_bases[p.rank]);
  if (tid == 0) {
    s_fail = *reinterpret_cast<volatile uint32_t*>(&self->error[0]) != kOk;
    s_round = self->oneshot_round;
    s_abort = 0;
  }
  __syncthreads();
  if (s_fail) {  // an earlier launch timed out: NaN until the host raises the error
    poison_outputs(p, nan_pair<T>());
    return;
  }
  const uint32_t r = s_round;

  const int hv = p.hidden / kVecElems;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const char* mine = own_partial(p);
  const int64_t slot0 =
      kSignalBytes + static_cast<int64_t>(r % kOneShotRounds) * kOneShotBufferBytes;
  const int64_t tags0 = slot0 + kOneShotRoundBytes;
  const bool check = p.tag != 0;
  const Vec16 my_tag = tag_vector(p.tag, r, static_cast<uint32_t>(p.rows));

  // 1. push my tag, then my rows, to every peer.
  if (check && tid < world && tid != p.rank)
    store_vec(reinterpret_cast<char*>(pad_bases[tid]) + tags0 +
                  (static_cast<int64_t>(p.rank) * kMaxCtas + b) * kVecBytes,
              my_tag);
  for (int row = b; row < p.rows; row += grid) {
#pragma unroll
    for (int v = 0; v < kVpt; ++v) {
      const int col = tid + v * blockDim.x;
      if (col < hv) {
        const Vec16 x = load_sanitized(mine + row * row_bytes + col * kVecBytes);
        const int64_t off = slot0 + (static_cast<int64_t>(p.rank) * p.rows + row) * row_bytes +
                            col * kVecBytes;
#pragma unroll
        for (int q = 0; q < kNp; ++q)
          if (q < world && q != p.rank) store_vec(reinterpret_cast<char*>(pad_bases[q]) + off, x);
      }
    }
  }

  const bool norm = p.weight != nullptr;
  Vec16 w[kVpt];
  load_weight(CtaTeam{}, p.weight, hv, w);
  const char* inbox = reinterpret_cast<const char*>(pad_bases[p.rank]) + slot0;
  const float inv_h = 1.0f / static_cast<float>(p.hidden);
  const uint64_t t0 = global_timer_ns();
  int parity = 0;
  int failed = 0;  // this thread gave up (a timeout, or a peer on another call): NaN outputs
  Fp8Acc acc = fp8_begin(p.fp8);  // FP8 rows (fp8_rows.cuh)

  // Thread q < world (q != rank) checks that peer q's CTA b is on this very call (step 3).
  const char* tag_src = inbox + kOneShotRoundBytes +
                        (static_cast<int64_t>(tid) * kMaxCtas + b) * kVecBytes;
  bool watch = check && tid < world && tid != p.rank;
  // A failed arrival: peer q on another call (its tag, read by thread q) or given up on; on
  // another call every thread of the CTA stops polling (s_abort), and the CTA's next barrier
  // makes it give up.
  auto fail = [&](int got, int q, const Vec16& theirs) {
    if (got == kOtherCall) {
      record_error(self, kCallMismatch, q, b, r, tag_field(theirs, 1), p.tag,
                   tag_field(theirs, 0));
      atomicExch(&s_abort, 1);  // after record_error's fence: the error is in
    } else {
      record_error(self, kTimeoutArrival, q, b, r);
    }
    failed = 1;
  };

  // 2.-4. poll (and check), reduce, normalize.
  for (int row = b; row < p.rows; row += grid, parity ^= 1) {
    float y[kVpt][8];
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < kVpt; ++v) {
      const int col = tid + v * blockDim.x;
      if (col >= hv) continue;
#pragma unroll
      for (int q = 0; q < kNp; ++q) {
        if (q >= world) continue;
        Vec16 x;
        if (q == p.rank) {
          x = load_sanitized(mine + row * row_bytes + col * kVecBytes);
        } else {
          const char* src =
              inbox + (static_cast<int64_t>(q) * p.rows + row) * row_bytes + col * kVecBytes;
          const bool checks = watch && q == tid;  // this thread's first vector of peer q
          Vec16 theirs;
          const int got = arrived(src, x, checks ? tag_src : nullptr, theirs, my_tag, t0,
                                  p.timeout_ns, &s_abort);
          if (checks) watch = false;
          if (got != kArrived) fail(got, q, theirs);
        }
        if (q == 0)
          set_vec<T>(y[v], x);
        else
          add_vec<T>(y[v], x);
      }
      add_vec<T>(y[v], reinterpret_cast<const Vec16*>(
                           static_cast<const char*>(p.residual) + row * row_bytes)[col]);
      add_squares(ss, y[v]);
    }
    if (watch) {  // no column of the row for this thread (hidden < 8 * world): the tag alone
      Vec16 none, theirs;
      const int got = arrived(nullptr, none, tag_src, theirs, my_tag, t0, p.timeout_ns, &s_abort);
      watch = false;
      if (got != kArrived) fail(got, tid, theirs);
    }
    publish_warp_sum(ss, s_red[parity]);
    // One answer for every thread (a per-thread flag, not shared memory a faster thread could
    // set while others still read it); s_red[parity] is rewritten after another barrier.
    if (__syncthreads_or(failed)) {
      poison_outputs(p, nan_pair<T>());
      return;
    }
    for_each_vec<kVpt>(CtaTeam{}, hv, [&](int v, int col) {
      reinterpret_cast<Vec16*>(static_cast<char*>(p.residual_out) + row * row_bytes)[col] =
          pack_vec<T>(y[v]);
    });
    if (!norm) continue;
    const float rs = block_rstd(s_red[parity], inv_h, p.eps);
    emit_normed<T, kVpt>(CtaTeam{}, p, row, y, rs, w, acc, [&](int, int col, const Vec16& o) {
      reinterpret_cast<Vec16*>(static_cast<char*>(p.normed_local) + row * row_bytes)[col] = o;
    });
  }
  fp8_end<T>(p.fp8, acc);

  // 5. reset the previous round's buffer of my own header: its rows and its tag slots.
  const int prev = static_cast<int>((r % kOneShotRounds + kOneShotRounds - 1) % kOneShotRounds);
  const int64_t nvec = self->oneshot_vecs[prev];
  char* old = reinterpret_cast<char*>(pad_bases[p.rank]) + kSignalBytes +
              static_cast<int64_t>(prev) * kOneShotBufferBytes;
  const Vec16 empty = {{kEmptyWord, kEmptyWord, kEmptyWord, kEmptyWord}};
  for (int64_t i = static_cast<int64_t>(b) * blockDim.x + tid; i < nvec;
       i += static_cast<int64_t>(grid) * blockDim.x)
    store_vec(old + i * kVecBytes, empty);
  const int64_t old_ctas = self->oneshot_ctas[prev];
  for (int64_t i = static_cast<int64_t>(b) * blockDim.x + tid; i < world * old_ctas;
       i += static_cast<int64_t>(grid) * blockDim.x)
    store_vec(old + kOneShotRoundBytes + ((i / old_ctas) * kMaxCtas + i % old_ctas) * kVecBytes,
              empty);

  // 6. the last CTA records this round's extent and advances the round.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    if (atomicAdd(&self->oneshot_done, 1u) == static_cast<uint32_t>(grid - 1)) {
      self->oneshot_vecs[r % kOneShotRounds] = static_cast<uint32_t>(world * p.rows * hv);
      self->oneshot_ctas[r % kOneShotRounds] = check ? static_cast<uint32_t>(grid) : 0u;
      self->oneshot_done = 0;
      // Wrap at 0xFFFFFFFF, a multiple of 3 (2^32 is not): r % 3 keeps rotating across the wrap.
      self->oneshot_round = r + 1 == kOneShotRoundWrap ? 0u : r + 1;
    }
  }
}

}  // namespace tokenweave
