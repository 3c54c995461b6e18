// Two-shot fused all-reduce + residual add + RMSNorm for the replicated layout at TP >= 4: each
// rank reduces only the rows it owns and writes them back to every peer, so 2(P-1)/P of the
// partial crosses NVLink per rank instead of the pull-all path's P-1.
//
// Protocol (also in docs/kernel.md)
// ---------------------------------
// Rows are split into P chunks of ceil(rows / P); rank r owns chunk r. A launch uses G CTAs (the
// same G on every rank); CTA b of every rank handles rows first_c + b, first_c + b + G, ... of
// every chunk c, so per-CTA barriers (signal.cuh) order everything:
//   1. START barrier (slot b): every peer's partial rows are written and its previous op is over;
//   2. reduce-scatter, in place: for each of my chunk's rows of CTA b, load the row from every
//      rank's partial (16-byte vectors, fp32 accumulation in rank order), add the residual, round
//      y once to T and store it into the same row of every rank's partial (mine included). Only
//      the owner ever reads or writes a row of its chunk, on any rank, so no other CTA races it;
//   3. END barrier (slot b): every owner's CTA b has written its rows of every chunk into my
//      partial, and has finished reading mine;
//   4. all rows of CTA b, every chunk, from my own partial (now y; read at L2, since a row's
//      cache line may hold a neighbouring row this CTA loaded in step 2): copy to residual_out,
//      reduce the sum of squares, normalize, store normed_out locally; the CTA's two teams
//      (rmsnorm_row.cuh Team; H <= 8192) take alternate rows.
// Every rank normalizes the same rounded y, so the replicated outputs are bit-identical across
// ranks. The partial buffer holds y afterwards (it is the communicator's scratch). A residual_out
// that aliases residual is safe: CTA b reads the residual only of the rows it writes itself.
// No reuse too early and no deadlock, as on the barrier path (signal.cuh): a peer writes into my
// partial only after START of the same op, which needs my arrival, issued after my previous op
// finished (stream order). Bounded: a failed barrier, or an earlier error, writes NaN into the
// CTA's rows of every output and returns.
#pragma once

#include "tokenweave/common.cuh"
#include "tokenweave/fused_allreduce_rmsnorm.cuh"
#include "tokenweave/rmsnorm_row.cuh"
#include "tokenweave/signal.cuh"

namespace tokenweave {

// The communicator takes the two-shot path for replicated calls from this TP size on (smaller
// groups pull every row: the same total bytes at P = 2, one barrier pair, no second pass).
constexpr int kTwoShotMinWorld = 4;

// Rows b, b + G, ... of each of the P chunks of `chunk_rows` rows: the rows CTA b of an
// owner-reduces launch (this file's kernel, gemm_reduce.cuh's replicated one) writes on every
// rank after its END barrier. A CTA that fails poisons exactly these.
__device__ __forceinline__ void poison_chunk_rows(const FusedParams& p, uint32_t nan2,
                                                  int chunk_rows) {
  for (int c = 0; c < p.world; ++c)
    for (int row = c * chunk_rows + blockIdx.x; row < min(p.rows, (c + 1) * chunk_rows);
         row += gridDim.x)
      poison_row(p, nan2, row);
}

// After the END barrier, every rank: those rows of y (every owner wrote them into `own`, this
// rank's partial; read at L2, since a row's cache line may hold a neighbouring row this CTA
// loaded earlier) to residual_out, and their norm to normed_out, locally. Every rank normalizes
// the same rounded y, so the replicated outputs are bit-identical across ranks.
template <typename T, int kVpt>
__device__ __forceinline__ void normalize_chunk_rows(const FusedParams& p, const char* own,
                                                     int chunk_rows) {
  constexpr int kTeams = teams_for(kVpt);  // rmsnorm_row.cuh
  constexpr int kV = kVpt * kTeams;         // vectors per thread of a team
  __shared__ float s_red[kMaxTeams][2][kMaxThreads / 32];
  // The CTA's rows are b + i * G of each chunk, counted across chunks; team t takes those whose
  // count is t modulo the teams (two rows' load latencies, block reductions and epilogues in
  // flight per CTA, also where a chunk gives the CTA a single row).
  const Team<kTeams> team;
  const int hv = p.hidden / kVecElems;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  Vec16 w[kV];
  load_weight(team, p.weight, hv, w);
  char* res_out = static_cast<char*>(p.residual_out);
  char* normed = static_cast<char*>(p.normed_local);
  float (&red)[2][kMaxThreads / 32] = s_red[team.id()];
  int parity = 0, count = 0;
  Fp8Acc acc = fp8_begin(p.fp8);  // FP8 rows (fp8_rows.cuh)
  // One team: a row's normed stores are emitted one row late, before the next row's barrier
  // (as in the bulk kernel: their latency overlaps that barrier's wait); two teams: at once.
  float y_prev[kTeams == 1 ? kV : 1][kTeams == 1 ? 8 : 1];
  float rs_prev = 0.f;
  int prev = -1;
  auto emit = [&](int r, const float (&yr)[kV][8], float rs) {
    emit_normed<T, kV>(team, p, r, yr, rs, w, acc, [&](int, int col, const Vec16& o) {
      reinterpret_cast<Vec16*>(normed + r * row_bytes)[col] = o;
    });
  };
  for (int c = 0; c < p.world; ++c) {
    const int end = min(p.rows, (c + 1) * chunk_rows);
    for (int row = c * chunk_rows + blockIdx.x; row < end; row += gridDim.x) {
      if (count++ % kTeams != team.id()) continue;
      parity ^= 1;
      const int64_t roff = row * row_bytes;
      float y[kV][8];
      float ss[kTeams] = {};
      for_each_vec<kV>(team, hv, [&](int m, int col) {
        const Vec16 yv = load_vec_l2(own + roff + static_cast<int64_t>(col) * kVecBytes);
        reinterpret_cast<Vec16*>(res_out + roff)[col] = yv;
        set_vec<T>(y[m], yv);
        add_squares(ss[m % kTeams], y[m]);
      });
      if (p.weight == nullptr) continue;
      publish_row_sums(team, ss, red[parity]);
      if constexpr (kTeams == 1)
        if (prev >= 0) emit(prev, y_prev, rs_prev);  // the same in every thread
      team.sync();  // red[parity] is rewritten two rows later, after another sync
      const float rs = block_rstd(red[parity], 1.0f / static_cast<float>(p.hidden), p.eps);
      if constexpr (kTeams == 1) {
        rs_prev = rs;
        prev = row;
#pragma unroll
        for (int m = 0; m < kV; ++m)
#pragma unroll
          for (int k = 0; k < 8; ++k) y_prev[m][k] = y[m][k];
      } else {
        emit(row, y, rs);
      }
    }
  }
  if constexpr (kTeams == 1)
    if (prev >= 0) emit(prev, y_prev, rs_prev);
  fp8_end<T>(p.fp8, acc);
}

template <typename T, int kNp, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    fused_allreduce_rmsnorm_twoshot_kernel(const FusedParams p) {
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;
  const int64_t* pads = p.bases + p.world;
  char* data[kNp];
  peer_data(p, data);
  const int chunk_rows = (p.rows + p.world - 1) / p.world;
  // This CTA's rows: b, b + G, ... of every chunk (in phase 2 it writes those of its own chunk
  // to every rank, in phase 4 all of them locally).
  auto poison_mine = [&] { poison_chunk_rows(p, nan_pair<T>(), chunk_rows); };
  const uint32_t e = begin_cta(p, &s_epoch, &s_fail);
  if (e == 0 || !cta_barrier<false>(pads, p.rank, p.world, blockIdx.x, e, p.tag, p.timeout_ns,
                                     &s_fail)) {
    poison_mine();
    return;
  }
  const int hv = p.hidden / kVecElems;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);

  // 2. my chunk: reduce, add the residual, write y back to every rank's partial.
  const int mine_end = min(p.rows, (p.rank + 1) * chunk_rows);
  for (int row = p.rank * chunk_rows + blockIdx.x; row < mine_end; row += gridDim.x) {
    for_each_vec<kVpt>(CtaTeam{}, hv, [&](int, int col) {
      const int64_t off = p.partial_off + row * row_bytes + static_cast<int64_t>(col) * kVecBytes;
      Vec16 in[kNp];
#pragma unroll
      for (int q = 0; q < kNp; ++q)
        if (q < p.world) in[q] = *reinterpret_cast<const Vec16*>(data[q] + off);
      float y[8];
      set_vec<T>(y, in[0]);
#pragma unroll
      for (int q = 1; q < kNp; ++q)
        if (q < p.world) add_vec<T>(y, in[q]);
      add_vec<T>(y, reinterpret_cast<const Vec16*>(static_cast<const char*>(p.residual) +
                                                   row * row_bytes)[col]);
      const Vec16 out = pack_vec<T>(y);
#pragma unroll
      for (int q = 0; q < kNp; ++q)
        if (q < p.world) *reinterpret_cast<Vec16*>(data[q] + off) = out;
    });
  }

  // 3. every owner's rows of this CTA are in my partial.
  if (!cta_barrier<true>(pads, p.rank, p.world, blockIdx.x, e, 0u, p.timeout_ns, &s_fail)) {
    poison_mine();
    return;
  }

  // 4. all rows of this CTA: residual_out and the norm, locally.
  normalize_chunk_rows<T, kVpt>(p, own_partial(p), chunk_rows);
}

}  // namespace tokenweave
