// Copy-engine data path of the fused op: the peers' rows cross NVLink by cudaMemcpyAsync (the
// GPU's copy engines, no SMs), only the reduction + residual add + RMSNorm runs on SMs, over
// local memory. Beside a GEMM of the other half of the tokens, an SM-driven peer load keeps its
// SMs waiting on NVLink latency for the whole transfer; here the SMs are busy only for the local
// kernel (docs/kernel.md has the measurements: on H200 TP=2 it did not pay).
//
// One op on rank r (stream order; ops.cu launches the steps). Every copy is a PULL: a rank only
// ever writes its own memory, so a rank whose barrier timed out cannot corrupt a peer.
//   1. START: a one-CTA barrier kernel, slot kCopyEngineSlot, new epoch e (signal.cuh protocol):
//      every peer's partial rows are written and its previous op is over;
//   2. for each peer q, one cudaMemcpyAsync of the rows r reduces (replicated: all rows;
//      sequence parallel: chunk r) from q's partial into r's mirror of q (a local buffer laid out
//      like the partial region, so a row has the same offset in both);
//   3. the fused kernel (register or bulk path) with its sources = [mirror of q for q != r, own
//      partial for r]: no barriers, normed rows stored locally only;
//   sequence parallel with a norm:
//   4. MID: the barrier kernel on slot kCopyEngineMidSlot's start flags, epoch e: every peer's
//      normed chunk is written;
//   5. for each peer q, one cudaMemcpyAsync of q's normed chunk q into r's normed_out chunk q;
//   then
//   6. END: the barrier kernel on slot kCopyEngineSlot's end flags, epoch e: every peer finished
//      pulling r's partial rows (and normed chunk), so r may overwrite them.
// Two phases (replicated layout, or no norm: nothing to gather after the reduction): TRANSFER =
// steps 1, 2 and 6 (every peer has pulled my rows once END passes), REDUCE = step 3 alone, over
// local memory. The layer issues TRANSFER on its side stream beside the other half's GEMMs and
// REDUCE on the main stream when the rows are needed: then no SM-driven work runs beside a GEMM
// (what slowed the GEMM on the side-stream arrangement, docs/kernel.md), only the copy engines.
// Stream order makes each copy complete before the next step starts; the barrier kernels'
// release/acquire flags order the steps across ranks. No flag is reused too early: a peer writes
// start = e + 1 or mid = e + 1 only after it passed START(e + 1), which needs my start = e + 1,
// written after I passed END(e), i.e. after I consumed start = e and mid = e; and it writes
// end = e + 1 only after START(e + 1) as on the SM path. No deadlock: each barrier kernel waits
// only for the same kernel on the other ranks, issued in the same order everywhere. A missing
// peer: the START kernel times out and records the error (slot kCopyEngineSlot); the copies then
// read stale rows into this rank's own memory, but the reduction kernel finds the error and
// writes NaN instead of its rows, and so do MID and END after the normed rows' copies; the host
// raises the error (the communicator's error check), as on the SM path.
#pragma once

#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/signal.cuh"

namespace tokenweave {

enum CopyEngineBarrier : int { kCeStart = 0, kCeMid = 1, kCeEnd = 2 };
// What one call of the copy-engine op issues (the op's `phase` argument).
enum CopyEnginePhase : int { kCeWhole = 0, kCeTransfer = 1, kCeReduce = 2 };

// One CTA of 32 threads: one barrier of the copy-engine op (START takes kCopyEngineSlot's next
// epoch; MID and END use the epoch START took). `p` holds the op's real bases (data, then signal
// pads). With `poison` (the barriers after which no kernel of the op writes outputs any more),
// one that finds an earlier error, or a MID that times out, writes NaN into the op's outputs.
template <int kBarrier>
__global__ void __launch_bounds__(32)
    copy_engine_barrier_kernel(const FusedParams p, uint32_t nan2, int poison) {
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;
  const int64_t* pad_bases = p.bases + p.world;
  SignalPad* self = reinterpret_cast<SignalPad*>(pad_bases[p.rank]);
  if (threadIdx.x == 0) {
    s_fail = 0;
    if (kBarrier == kCeStart) {
      s_epoch = next_epoch(self, kCopyEngineSlot);
    } else {
      const bool failed = *reinterpret_cast<volatile uint32_t*>(&self->error[0]) != kOk;
      s_epoch = failed ? 0u : self->epoch[kCopyEngineSlot];
    }
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  constexpr int slot = kBarrier == kCeMid ? kCopyEngineMidSlot : kCopyEngineSlot;
  const bool timed_out =
      e != 0 && !cta_barrier<kBarrier == kCeEnd>(pad_bases, p.rank, p.world, slot, e, p.tag,
                                                 p.timeout_ns, &s_fail);
  // A timeout at END comes after this call's outputs are complete (MID passed, the copies are
  // stream-ordered before END), and a slow peer may still be pulling my normed chunk: END
  // poisons only after an earlier failure.
  if (poison && (e == 0 || (timed_out && kBarrier != kCeEnd))) poison_outputs(p, nan2);
}

}  // namespace tokenweave
