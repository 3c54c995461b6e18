// The consumer of the communicating row-parallel GEMM (megatron_tokenweave/kernels/owner_gemm.py):
// the owner's reduction + residual add + RMSNorm over the tiles the GEMMs of every rank stored
// into its inbox.
//
// Protocol (also in docs/kernel.md)
// ---------------------------------
// Rows of one call are split into P segments; rank c owns segment c (sequence parallel: chunk c's
// rows of this half; replicated: `seg_rows` rows of the half, a multiple of the GEMM's block
// rows). Every rank's GEMM stores the output tile of (segment c, row block m, column tile n) into
// rank c's inbox, slot `src` (its own rank), rows row0 + m * BM ..., and the tiles are published
// by one of two releases (ops/segments.py RELEASES says which a call takes; the GEMM and its
// consumer take the same):
// - by the GEMM: after its last tile each CTA publishes its tiles: bar.sync, fence.acq_rel.sys,
//   then warp 0 stores flag[set][src][m][n] = e into each owner's inbox (st.relaxed.sys; the
//   fence makes it a release);
// - by the consumer (`publish`): the GEMM stores tiles only. The consumer's stream starts it
//   after the GEMM ends, so every CTA's threads q < P store flag[set][src][0][0] = e into rank q's
//   inbox (st.release.sys), and every owner waits on that one flag per source: its whole
//   segment is one block of one tile. Every CTA publishes, so none waits on another CTA of its
//   own grid.
// `e` is the set's epoch: every rank keeps epoch[set] in its own inbox, the GEMM
// stores with epoch[set] + 1 and the consumer's last CTA writes that value back when the call is
// over, so ranks that make the same calls in the same order stay in step (CUDA graphs replay
// with fresh epochs, as the kernel reads them from memory). Whoever publishes a source's flags
// (the GEMM's CTAs, or its consumer) first stores the call's tag into tag[set][src] of each
// owner's inbox, ordered before the flags by the same fence (release): an owner that sees a
// source's flags of this epoch then reads that source's tag, and another call's tag
// (kCallMismatch) makes it give up before it reads the source's tiles. Two sets (the woven
// schedule's halves) let half B's GEMM store while half A's consumer still reads its rows.
// The consumer on rank r, CTA b of G (the same G everywhere: it depends on seg_rows and the CTA
// count only):
//   1. for its rows j = b, b + G, ... of segment r: before the first row of a block, wait until
//      every source's flags of that block read e (ld.acquire.sys, bounded by timeout_ns); then
//      sum the P slots' rows in fp32 in rank order (local loads, at L2), add the residual;
//      sequence parallel: residual_out and the normed row, stored to every rank's normed_out;
//      replicated: y rounded once, stored into every rank's partial rows (as two-shot does);
//   2. END barrier (signal.cuh, slot b): every owner's CTA b wrote its rows into this rank;
//   3. replicated: the rows of CTA b of every segment, locally (twoshot.cuh's last phase).
// Reuse: a rank's GEMM stores into an owner's rows only in a call of the same set whose previous
// consumer finished on that rank (the caller's order: a set is reused after its consumer, as the
// woven schedule's data dependencies give), and that consumer passed END, so every owner is
// done reading. A flag seen from a rank means that rank's stream reached this call's GEMM, so the
// normed/y rows the consumer writes into it are no longer read by its earlier work (START's role).
// Failures: a block whose flags do not arrive records kTimeoutTile (peer = the source, slot = the
// block) in the signal pad; the CTA writes NaN into the rows it owns and skips END, so the peers
// time out at END and poison theirs too. Every CTA counts itself done, failed or not.
#pragma once

#include "tokenweave/common.cuh"
#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/rmsnorm_row.cuh"
#include "tokenweave/signal.cuh"
#include "tokenweave/twoshot.cuh"

namespace tokenweave {

// One call's inbox: where this rank's slots and flags are, and the segment geometry.
struct InboxParams {
  const char* data;          // local inbox: slot q (rows stored by rank q) at q * slot_bytes
  int64_t slot_bytes;
  int row0;                  // inbox row of segment row 0 (this call's rows in every slot)
  int seg_rows;              // rows of a full segment (every rank's)
  int my_rows;               // rows of this rank's segment
  int block_rows;            // the GEMM's block rows (one flag per block and column tile)
  int col_tiles;             // column tiles (flags) per block and source
  const uint32_t* flags;     // local: this set's [world][blocks][tiles_stride] flags
  int64_t src_stride;        // words between sources
  int tiles_stride;          // words between blocks
  uint32_t* epoch;           // local: this set's epoch (the last call's)
  uint32_t* done;            // local: CTAs of this set's current consumer that finished
  const uint32_t* tags;      // local: this set's tag[src], stored by whoever published src's flags
  uint32_t* publish[kMaxRanks];  // consumer release: rank q's flag[set][this rank][0][0]; else
                                 // null (the GEMM published)
  uint32_t* publish_tag[kMaxRanks];  // consumer release: rank q's tag[set][this rank]
};

// The epoch a call uses after `last` (0 is "never written").
__host__ __device__ __forceinline__ uint32_t next_inbox_epoch(uint32_t last) {
  return last >= 0x7fffffffu ? 1u : last + 1u;
}

// All threads: wait until every source's flags of block `blk` read `e`, and (p.tag != 0) that
// every source's tag is this call's. False (for every thread) after timeout_ns, or at once for
// a source on another call, with the error recorded.
__device__ __forceinline__ bool wait_block(const FusedParams& p, const InboxParams& g, int blk,
                                           uint32_t e) {
  SignalPad* self = reinterpret_cast<SignalPad*>(p.bases[p.world + p.rank]);
  int fail = 0;
  const int n = p.world * g.col_tiles;
  for (int i = threadIdx.x; i < n && !fail; i += blockDim.x) {
    const int q = i / g.col_tiles, t = i - q * g.col_tiles;
    const uint32_t* flag =
        g.flags + q * g.src_stride + static_cast<int64_t>(blk) * g.tiles_stride + t;
    const uint64_t t0 = global_timer_ns();
    uint32_t spins = 0;
    while (ld_acquire_sys(flag) != e) {
      if ((++spins & 1023u) == 0 && global_timer_ns() - t0 > p.timeout_ns) {
        record_error(self, kTimeoutTile, q, blk, e);
        fail = 1;
        break;
      }
    }
    if (!fail && t == 0 && p.tag != 0) {
      const uint32_t theirs = ld_relaxed_sys(g.tags + q);  // after its flag: its tag
      if (theirs != p.tag) {
        record_error(self, kCallMismatch, q, blk, e, e, p.tag, theirs);
        fail = 1;
      }
    }
  }
  return __syncthreads_or(fail) == 0;
}

template <typename T, int kNp, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    gemm_reduce_rmsnorm_kernel(const FusedParams p, const InboxParams g) {
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;
  __shared__ uint32_t s_inbox_epoch;
  __shared__ float s_red[2][kMaxThreads / 32];
  const int64_t* pads = p.bases + p.world;
  char* data[kNp];
  peer_data(p, data);
  if (threadIdx.x == 0) s_inbox_epoch = next_inbox_epoch(*g.epoch);
  const uint32_t e = begin_cta(p, &s_epoch, &s_fail);  // syncs: s_inbox_epoch is set too
  const uint32_t ie = s_inbox_epoch;
  // Consumer release: this rank's GEMM, earlier on this stream, has ended (the kernel boundary
  // is what makes its stores complete: a launch overlapping the GEMM's grid, such as a
  // programmatic dependent one, would have to wait for that grid first); the release store
  // orders those stores before the flag for every reader that acquires it.
  if (g.publish[0] != nullptr && e != 0 && threadIdx.x < p.world) {
    st_relaxed_sys(g.publish_tag[threadIdx.x], p.tag);  // ordered by the release below
    st_release_sys(g.publish[threadIdx.x], ie);
  }
  const int hv = p.hidden / kVecElems;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const bool sp = p.sequence_parallel != 0;

  auto reduce_mine = [&]() -> bool {
    Vec16 w[kVpt];
    load_weight(CtaTeam{}, p.weight, hv, w);
    const int first_row = sp ? 0 : p.rank * g.seg_rows;  // of residual / the y rows
    int block = -1, parity = 0;
    for (int j = blockIdx.x; j < g.my_rows; j += gridDim.x, parity ^= 1) {
      if (j / g.block_rows != block) {
        block = j / g.block_rows;
        if (!wait_block(p, g, block, ie)) return false;
      }
      const char* slot_row = g.data + static_cast<int64_t>(g.row0 + j) * row_bytes;
      const int64_t roff = static_cast<int64_t>(first_row + j) * row_bytes;
      float y[kVpt][8];
      float ss = 0.f;
      for_each_vec<kVpt>(CtaTeam{}, hv, [&](int v, int col) {
        const int64_t c = static_cast<int64_t>(col) * kVecBytes;
        Vec16 in[kNp];
#pragma unroll
        for (int q = 0; q < kNp; ++q)
          if (q < p.world) in[q] = load_vec_l2(slot_row + q * g.slot_bytes + c);
        set_vec<T>(y[v], in[0]);
#pragma unroll
        for (int q = 1; q < kNp; ++q)
          if (q < p.world) add_vec<T>(y[v], in[q]);
        add_vec<T>(y[v], load_vec(static_cast<const char*>(p.residual) + roff + c));
        const Vec16 out = pack_vec<T>(y[v]);
        if (sp) {
          store_vec(static_cast<char*>(p.residual_out) + roff + c, out);
          add_squares(ss, y[v]);
        } else {
#pragma unroll
          for (int q = 0; q < kNp; ++q)
            if (q < p.world) store_vec(data[q] + p.partial_off + roff + c, out);
        }
      });
      if (!sp || p.weight == nullptr) continue;
      publish_warp_sum(ss, s_red[parity]);
      __syncthreads();  // s_red[parity] is rewritten two rows later, after another sync
      const float rs = block_rstd(s_red[parity], 1.0f / static_cast<float>(p.hidden), p.eps);
      for_each_vec<kVpt>(CtaTeam{}, hv, [&](int v, int col) {
        store_normed(p, data, p.rank, roff + static_cast<int64_t>(col) * kVecBytes,
                     normalize_vec<T>(y[v], rs, w[v]));
      });
    }
    return true;
  };

  const bool ok = e != 0 && reduce_mine() &&
                  cta_barrier<true>(pads, p.rank, p.world, blockIdx.x, e, 0u, p.timeout_ns,
                                    &s_fail);
  if (ok && !sp) normalize_chunk_rows<T, kVpt>(p, own_partial(p), g.seg_rows);
  if (!ok) {
    if (sp)
      poison_outputs(p, nan_pair<T>());
    else
      poison_chunk_rows(p, nan_pair<T>(), g.seg_rows);
  }
  __syncthreads();
  if (threadIdx.x == 0 && atomicAdd(g.done, 1u) == gridDim.x - 1) {  // the call's last CTA
    *g.done = 0;
    *g.epoch = ie;
  }
}

}  // namespace tokenweave
