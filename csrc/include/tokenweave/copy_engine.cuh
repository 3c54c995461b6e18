// Copy-engine data path of the fused op: the peers' rows cross NVLink by cudaMemcpyAsync (the
// GPU's copy engines, no SMs), only the reduction + residual add + RMSNorm runs on SMs, over
// local memory. Beside a GEMM of the other half of the tokens, an SM-driven peer load keeps its
// SMs waiting on NVLink latency for the whole transfer; here the SMs are busy only for the short
// local kernel (docs/kernel.md has the measurements).
//
// One op on rank r (stream order; G CTAs for the local kernel, ops.cu launches the steps):
//   1. START: a one-CTA barrier kernel on slot kCopyEngineSlot of the SignalPad (signal.cuh
//      protocol, epoch e): every peer's partial rows are written;
//   2. pull: for each peer q, one cudaMemcpyAsync of the rows this rank reduces (replicated: all
//      rows; sequence parallel: chunk r) from q's partial into this rank's mirror of q (a local
//      buffer laid out like the partial region, so a row's offset is the same everywhere);
//   3. the fused kernel (register or bulk path) with its sources = [mirror of q for q != r, own
//      partial for r], no barriers, normed rows stored locally only;
//   4. sequence parallel with a norm: push, for each peer q, one cudaMemcpyAsync of this rank's
//      normed chunk r into q's normed_out chunk r;
//   5. END: the one-CTA barrier again (same epoch e): every peer finished pulling this rank's
//      partial rows and pushing its normed rows here.
// Stream order makes each copy complete before the next step starts, and the barrier kernels'
// release/acquire flags order the steps across ranks exactly as the SM kernel's START/END do:
// the same proof of "no flag reused too early, no deadlock" holds for the one slot (a rank's
// next START(e + 1) needs every peer's END(e)). A missing peer: the START kernel times out,
// records the error (slot kCopyEngineSlot) and later steps of this and later ops return at once
// or copy stale rows; the host sees the error (SymmetricBuffer.check_error), as on the SM path.
#pragma once

#include "tokenweave/signal.cuh"

namespace tokenweave {

// One CTA of 32 threads: START (kEnd = false: takes the slot's next epoch) or END (kEnd = true:
// the epoch its START took) of the copy-engine op's barrier.
template <bool kEnd>
__global__ void __launch_bounds__(32)
    copy_engine_barrier_kernel(const int64_t* pad_bases, int rank, int world,
                               uint64_t timeout_ns) {
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;
  SignalPad* self = reinterpret_cast<SignalPad*>(pad_bases[rank]);
  if (threadIdx.x == 0) {
    s_fail = 0;
    if (kEnd) {
      const bool failed = *reinterpret_cast<volatile uint32_t*>(&self->error[0]) != kOk;
      s_epoch = failed ? 0u : self->epoch[kCopyEngineSlot];
    } else {
      s_epoch = next_epoch(self, kCopyEngineSlot);
    }
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  if (e == 0) return;  // an earlier launch timed out: do nothing until the host reads the error
  cta_barrier<kEnd>(pad_bases, rank, world, kCopyEngineSlot, e, timeout_ns, &s_fail);
}

}  // namespace tokenweave
