// Fused all-reduce + residual add + RMSNorm over peer-mapped (CUDA IPC) symmetric buffers.
//
// Two data paths, same math and same inter-rank protocol (signal.cuh):
//
// 1. Bulk-copy pipeline (fused_allreduce_rmsnorm_bulk_kernel, the default whenever S >= 2 stages
//    of P + 1 rows fit in shared memory, see bulk_stages() in ops.cu): one row per team
//    iteration, the CTA split into two teams (rmsnorm_row.cuh Team; H <= 8192) that take
//    alternate rows, each with S / 2 of the stages, so one team's per-row waits overlap the
//    other's work. A team's thread 0 keeps its stages in flight: stage s holds the P partial rows
//    (one per rank, peers' read over NVLink) and the residual row of a future row, fetched with
//    cp.async.bulk (no registers used) and completed on mbarrier full[s]. Every thread of the
//    team waits for full[s], sums its 16-byte vectors of the P rows in fp32 in rank order, adds
//    the residual, stores residual_out, reduces the sum of squares over the team; the team's
//    barrier of that reduction also proves that its threads are done reading stage s, so its
//    thread 0 refills it with the team's row S / 2 iterations ahead before the team normalizes
//    and stores the current one. With P=2, H=8192 that is 4 stages x 48 KB = 192 KB in flight
//    per CTA (the register path had ~32 KB of peer data).
// 2. Register path (fused_allreduce_rmsnorm_kernel, fallback when fewer than 2 stages fit, e.g.
//    P=8 and H=8192, or TOKENWEAVE_NO_BULK=1): kRows rows per iteration; every thread loads kVpt
//    16-byte vectors of each of kRows rows from each of the P peers' partial (all loads issued
//    before the first use) into registers.
// Both: normalize, multiply by w (fp32), round once to T, store the row to all P peers'
// normed_out (sequence parallel; remote stores are posted writes) or locally (replicated).
// residual_out gets y rounded to T. Rows are split between CTAs by index, identically on every
// rank (bulk: rows b, b+G, b+2G...; registers: row0 = (iter * G + b) * kRows); signal.cuh's
// per-CTA barriers rely on that.
#pragma once

#include "tokenweave/bulk_copy.cuh"
#include "tokenweave/common.cuh"
#include "tokenweave/fp8_rows.cuh"
#include "tokenweave/rmsnorm_row.cuh"
#include "tokenweave/signal.cuh"

namespace tokenweave {

struct FusedParams {
  const int64_t* bases;       // device [2 * world]: data-region bases, then signal-pad bases
  int64_t partial_off;        // bytes from the data base: partial[0][0][0]
  int64_t partial_cstride;    // bytes between partial chunks
  int64_t normed_off;         // sequence parallel: bytes from the data base of normed_out[0]
  int64_t normed_cstride;     // bytes between normed_out chunks (any stride(0))
  void* normed_local;         // replicated: local normed_out[0] (need not be in the buffer)
  const void* residual;       // [rows, hidden], local
  void* residual_out;         // [rows, hidden], local, may alias residual
  const void* weight;         // [hidden] or nullptr (add only)
  int rows;                   // rows per chunk
  int hidden;
  int rank;
  int world;
  int sequence_parallel;      // 1: rank r reduces chunk r, stores normed rows to every peer
  float eps;
  uint64_t timeout_ns;
  int local_stores_only;      // benchmark diagnostic only (the communicator's setting): store
                              // normed rows locally, not to peers (results then WRONG)
  int copy_engine;            // copy-engine data path (copy_engine.cuh): bases[q] are local
                              // copies of the peers' rows; no barriers, normed rows stored
                              // locally only (the op's copies move them)
  uint32_t tag;               // the call's tag (signal.cuh: the same on every rank for the same
                              // call; checked at START and by the one-shot exchange); 0: none
  Fp8Rows fp8;                // mode kFp8None: normed rows in T; else (replicated layout only)
                              // normed_local holds e4m3 rows of `hidden` bytes (fp8_rows.cuh)
};

// This rank's own partial (partial[0][0][0] in its data region), from the bases: a kernel that
// indexed its peers' pointer array by the rank at run time (`data[p.rank]`) put that array in
// local memory and read it back on every row.
__device__ __forceinline__ const char* own_partial(const FusedParams& p) {
  return reinterpret_cast<const char*>(p.bases[p.rank]) + p.partial_off;
}

// Whether the kernel stores normed rows to the peers itself (sequence parallel).
__device__ __forceinline__ bool stores_to_peers(const FusedParams& p) {
  return !p.copy_engine && !p.local_stores_only;
}

// Where a normed vector at byte offset roff of the chunk goes: sequence parallel, this rank's
// chunk of every peer's normed_out (data[q]: rank q's data region; posted remote stores), or of
// the local one only (stores_to_peers false); replicated, the local normed_out.
template <int kNp>
__device__ __forceinline__ void store_normed(const FusedParams& p, char* const (&data)[kNp],
                                             int chunk, int64_t roff, const Vec16& out) {
  if (p.sequence_parallel) {
    const int64_t dst = p.normed_off + chunk * p.normed_cstride + roff;
#pragma unroll
    for (int q = 0; q < kNp; ++q)
      if (q < p.world && (q == p.rank || stores_to_peers(p)))
        *reinterpret_cast<Vec16*>(data[q] + dst) = out;
  } else {
    *reinterpret_cast<Vec16*>(static_cast<char*>(p.normed_local) + roff) = out;
  }
}

// One row's normed vectors from this thread's kVpt vectors y of the row (rs: its rstd), each
// rounded once to T, then stored by store(v, col, vector) (T rows: the caller's destination) or,
// for FP8 rows, quantized and stored into normed_local here (`acc`: fp8_begin's). Every thread
// of the team `t` (rmsnorm_row.cuh) calls it for the row: block scales reduce over lanes.
template <typename T, int kVpt, int kTeams, typename Store>
__device__ __forceinline__ void emit_normed(Team<kTeams> t, const FusedParams& p, int row,
                                            const float (&y)[kVpt][8], float rs,
                                            const Vec16 (&w)[kVpt], Fp8Acc& acc, Store&& store) {
  const int hv = p.hidden / kVecElems;
  const Fp8Rows& f = p.fp8;
  if (f.mode == kFp8None) {
    for_each_vec<kVpt>(t, hv,
                       [&](int v, int col) { store(v, col, normalize_vec<T>(y[v], rs, w[v])); });
    return;
  }
#if !TOKENWEAVE_FP8_ROWS
  __trap();  // below sm_89: never launched with FP8 rows (ops.cu)
#else
  uint2* out = reinterpret_cast<uint2*>(static_cast<char*>(p.normed_local) +
                                        static_cast<int64_t>(row) * p.hidden);
  // One known scale: every vector scaled in fp32, its magnitudes into the running amax.
  auto tensor_scaled = [&]() {
    for_each_vec<kVpt>(t, hv, [&](int v, int col) {
      const Vec16 q = normalize_vec<T>(y[v], rs, w[v]);
      acc.amax2 = max_abs2<T>(acc.amax2, vec_max_abs2<T>(q));
      float x[8];
      scaled_vec<T>(x, q, acc.scale);
      out[col] = fp8_pack8(x);
    });
  };
  // 1 x 128 blocks, whether every scale is a power of two (kPow2) decided once a row. A block
  // is 16 consecutive vectors: 16 aligned lanes (team sizes are multiples of 32). Vectors v and
  // v + 1 of a thread (two blocks) go together: their amaxes one word, one half-warp reduction.
  auto blocks = [&](auto pow2) {
    constexpr bool kPow2 = decltype(pow2)::value;
#pragma unroll
    for (int v = 0; v < kVpt; v += 2) {
      if (v * t.size() >= hv) break;  // no thread of the team has vector v
      Vec16 q[2] = {};  // the rounded values
      int col[2];
      bool in[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int vj = v + j < kVpt ? v + j : v;  // an odd kVpt: the last pair's second is none
        col[j] = t.tid() + (v + j) * t.size();
        in[j] = v + j < kVpt && col[j] < hv;
        if (in[j]) q[j] = normalize_vec<T>(y[vj], rs, w[vj]);
      }
      // A second vector that is none (an odd kVpt, or past the row: a whole block of 16 lanes,
      // as hidden is a multiple of 128) takes the first's values: its amax, never stored, then
      // keeps the pair on the packed scales' path, which a zero amax would leave.
      if (!in[1]) q[1] = q[0];
      const BlockScales2 s =
          fp8_block_scales2<T, kPow2>(half_warp_max2<T>(pair_max_abs<T>(q[0], q[1])), f);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        if (!in[j]) continue;
        float x[8];
        if constexpr (kPow2 && std::is_same_v<T, __nv_bfloat16>)
          scaled_pow2_bf16(x, q[j], s.pair[j]);
        else
          scaled_vec<T>(x, q[j], s.scale[j]);
        out[col[j]] = fp8_pack8(x);
        if (col[j] % kFp8BlockLanes == 0)
          f.scale_inv[static_cast<int64_t>(col[j] / kFp8BlockLanes) * f.stride + row] = s.inv[j];
      }
    }
  };
  if (f.mode == kFp8TensorScale)
    tensor_scaled();
  else if (f.pow2 && f.amax_eps == 0.f)
    blocks(std::true_type{});
  else
    blocks(std::false_type{});
#endif
}

// Failures are loud: a CTA that cannot complete its rows (an earlier launch timed out, or a
// peer never arrived) writes NaN into every output row it was to write, so a consumer reads NaN,
// never stale rows, until the host raises the recorded error. poison_row: one row of residual_out
// and of this rank's own copy of normed_out (that row of every chunk under sequence
// parallelism); each kernel poisons exactly the rows its CTA owns (poison_outputs: rows
// b, b + G, ... as the bulk, one-shot and multimem kernels split them; the register and two-shot
// kernels their own sets), so a CTA that failed never overwrites a healthy CTA's rows.
// `nan2`: two 16-bit quiet NaNs of the output dtype.
__device__ __forceinline__ void poison_row(const FusedParams& p, uint32_t nan2, int row) {
  const Vec16 nan = {{nan2, nan2, nan2, nan2}};
  const int hv = p.hidden / kVecElems;
  const int64_t row_off = row * static_cast<int64_t>(hv) * kVecBytes;
  char* own = reinterpret_cast<char*>(p.bases[p.rank]);
  if (p.weight != nullptr && p.fp8.mode != kFp8None) {  // e4m3 rows of `hidden` bytes
    uint2* normed = reinterpret_cast<uint2*>(static_cast<char*>(p.normed_local) +
                                             static_cast<int64_t>(row) * p.hidden);
    for (int col = threadIdx.x; col < hv; col += blockDim.x)
      normed[col] = make_uint2(kFp8NanWord, kFp8NanWord);
  }
  for (int col = threadIdx.x; col < hv; col += blockDim.x) {
    const int64_t roff = row_off + static_cast<int64_t>(col) * kVecBytes;
    store_vec(static_cast<char*>(p.residual_out) + roff, nan);
    if (p.weight == nullptr || p.fp8.mode != kFp8None) continue;
    if (p.sequence_parallel) {
      for (int c = 0; c < p.world; ++c)
        store_vec(own + p.normed_off + c * p.normed_cstride + roff, nan);
    } else {
      store_vec(static_cast<char*>(p.normed_local) + roff, nan);
    }
  }
}

__device__ __forceinline__ void poison_outputs(const FusedParams& p, uint32_t nan2) {
  for (int row = blockIdx.x; row < p.rows; row += gridDim.x) poison_row(p, nan2, row);
}

// Two quiet NaNs of T in one 32-bit word.
template <typename T>
__host__ __device__ constexpr uint32_t nan_pair();
template <>
__host__ __device__ constexpr uint32_t nan_pair<__nv_bfloat16>() { return 0x7FC07FC0u; }
template <>
__host__ __device__ constexpr uint32_t nan_pair<__half>() { return 0x7E007E00u; }

// Thread 0: this launch's epoch of CTA b (0: an earlier launch failed). The copy-engine path's
// kernel has no barriers of its own, only the error check.
__device__ __forceinline__ uint32_t launch_epoch(const FusedParams& p, int b) {
  SignalPad* self = reinterpret_cast<SignalPad*>(p.bases[p.world + p.rank]);
  if (!p.copy_engine) return next_epoch(self, b);
  return *reinterpret_cast<volatile uint32_t*>(&self->error[0]) == kOk ? 1u : 0u;
}

// The ranks' data-region bases as this launch addresses them (nullptr past the group).
template <int kNp>
__device__ __forceinline__ void peer_data(const FusedParams& p, char* (&data)[kNp]) {
#pragma unroll
  for (int q = 0; q < kNp; ++q)
    data[q] = q < p.world ? reinterpret_cast<char*>(p.bases[q]) : nullptr;
}

// Every CTA's start: thread 0 clears the CTA's barrier failure flag and takes the launch's epoch
// (launch_epoch); every thread gets the epoch (0: an earlier launch failed).
__device__ __forceinline__ uint32_t begin_cta(const FusedParams& p, uint32_t* s_epoch,
                                              int* s_fail) {
  if (threadIdx.x == 0) {
    *s_fail = 0;
    *s_epoch = launch_epoch(p, blockIdx.x);
  }
  __syncthreads();
  return *s_epoch;
}

// Register path: rows per CTA iteration. Keeps np*vpt*rows vector loads (4 regs each) and
// vpt*rows*8 fp32 values of y (vpt*rows <= 4) within the register budget of 512 threads/CTA.
// Also the host's grid size (ops.cu).
__host__ __device__ constexpr int rows_per_iter(int np, int vpt) {
  const int a = 16 / (np * vpt), b = 4 / vpt;
  const int m = a < b ? a : b;
  return m < 1 ? 1 : (m > 4 ? 4 : m);
}

template <typename T, int kNp, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    fused_allreduce_rmsnorm_kernel(const FusedParams p) {
  constexpr int kRows = rows_per_iter(kNp, kVpt);
  __shared__ float s_red[2][kRows][kMaxThreads / 32];
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;

  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int world = p.world;
  const int64_t* pad_bases = p.bases + p.world;
  char* data[kNp];
  peer_data(p, data);
  // This CTA's rows: kRows at a time, rows (iter * G + b) * kRows + r.
  auto poison_mine = [&] {
    for (int row0 = b * kRows; row0 < p.rows; row0 += gridDim.x * kRows)
      for (int r = 0; r < kRows && row0 + r < p.rows; ++r) poison_row(p, nan_pair<T>(), row0 + r);
  };
  const uint32_t e = begin_cta(p, &s_epoch, &s_fail);
  if (e == 0) {  // an earlier launch timed out: NaN until the host raises the error
    poison_mine();
    return;
  }

  const int hv = p.hidden / kVecElems;  // vectors per row
  const bool norm = p.weight != nullptr;
  Vec16 w[kVpt];
  load_weight(CtaTeam{}, p.weight, hv, w);

  if (!p.copy_engine &&
      !cta_barrier<false>(pad_bases, p.rank, world, b, e, p.tag, p.timeout_ns, &s_fail)) {
    poison_mine();
    return;
  }

  const int chunk = p.sequence_parallel ? p.rank : 0;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t src_off = p.partial_off + chunk * p.partial_cstride;
  const float inv_h = 1.0f / static_cast<float>(p.hidden);
  int parity = 0;
  Fp8Acc acc = fp8_begin(p.fp8);  // FP8 rows (fp8_rows.cuh)

  for (int row0 = b * kRows; row0 < p.rows; row0 += gridDim.x * kRows, parity ^= 1) {
    Vec16 in[kRows][kVpt][kNp];
    Vec16 res[kRows][kVpt];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int v = 0; v < kVpt; ++v) {
        const int col = tid + v * blockDim.x;
        if (row0 + r < p.rows && col < hv) {
          const int64_t off = src_off + (row0 + r) * row_bytes + col * kVecBytes;
#pragma unroll
          for (int q = 0; q < kNp; ++q)
            if (q < world) in[r][v][q] = *reinterpret_cast<const Vec16*>(data[q] + off);
          res[r][v] = reinterpret_cast<const Vec16*>(
              static_cast<const char*>(p.residual) + (row0 + r) * row_bytes)[col];
        }
      }
    }
    float y[kRows][kVpt][8];
    float ss[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      ss[r] = 0.f;
#pragma unroll
      for (int v = 0; v < kVpt; ++v) {
        const int col = tid + v * blockDim.x;
        if (row0 + r < p.rows && col < hv) {
          set_vec<T>(y[r][v], in[r][v][0]);
#pragma unroll
          for (int q = 1; q < kNp; ++q)
            if (q < world) add_vec<T>(y[r][v], in[r][v][q]);
          add_vec<T>(y[r][v], res[r][v]);
          reinterpret_cast<Vec16*>(static_cast<char*>(p.residual_out) + (row0 + r) * row_bytes)
              [col] = pack_vec<T>(y[r][v]);
          add_squares(ss[r], y[r][v]);
        }
      }
    }
    if (!norm) continue;
    // Block reduction of the kRows sums of squares.
#pragma unroll
    for (int r = 0; r < kRows; ++r) publish_warp_sum(ss[r], s_red[parity][r]);
    __syncthreads();  // s_red[parity] is rewritten two iterations later, after another sync
#pragma unroll
    for (int r = 0; r < kRows; ++r) ss[r] = block_rstd(s_red[parity][r], inv_h, p.eps);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (row0 + r >= p.rows) continue;  // the same in every thread
      emit_normed<T, kVpt>(CtaTeam{}, p, row0 + r, y[r], ss[r], w, acc,
                           [&](int, int col, const Vec16& o) {
                             store_normed(p, data, chunk, (row0 + r) * row_bytes + col * kVecBytes,
                                          o);
                           });
    }
  }
  fp8_end<T>(p.fp8, acc);

  if (!p.copy_engine &&
      !cta_barrier<true>(pad_bases, p.rank, world, b, e, 0u, p.timeout_ns, &s_fail))
    poison_mine();  // a peer's normed rows (or its reads) never completed
}

// Stages of the bulk path: at most kMaxStages, within kStageSmemBytes of dynamic shared memory.
constexpr int kMaxStages = 8;
constexpr int kStageSmemBytes = 192 * 1024;

template <typename T, int kNp, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    fused_allreduce_rmsnorm_bulk_kernel(const FusedParams p, const int stages) {
  constexpr int kTeams = teams_for(kVpt);  // rmsnorm_row.cuh
  constexpr int kV = kVpt * kTeams;         // vectors per thread of a team
  extern __shared__ __align__(128) unsigned char s_stage[];
  __shared__ __align__(8) uint64_t s_full[kMaxStages];
  __shared__ float s_red[kMaxTeams][2][kMaxThreads / 32];
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;

  const int b = blockIdx.x;
  const int G = gridDim.x;
  const int tid = threadIdx.x;
  const int world = p.world;
  const int64_t* pad_bases = p.bases + p.world;
  char* data[kNp];
  peer_data(p, data);

  if (tid == 0) {
    s_fail = 0;
    s_epoch = launch_epoch(p, b);
    for (int s = 0; s < stages; ++s) mbar_init(&s_full[s], 1);
    fence_mbar_init();
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  if (e == 0) {  // an earlier launch timed out: NaN until the host raises the error
    poison_outputs(p, nan_pair<T>());
    return;
  }

  // Team t takes the CTA's rows b + (t + i * teams) * G through stages [t * per_team, ...).
  const Team<kTeams> team;
  const int per_team = stages / kTeams;
  const int hv = p.hidden / kVecElems;  // vectors per row
  const bool norm = p.weight != nullptr;
  Vec16 w[kV];
  load_weight(team, p.weight, hv, w);

  if (!p.copy_engine &&
      !cta_barrier<false>(pad_bases, p.rank, world, b, e, p.tag, p.timeout_ns, &s_fail)) {
    poison_outputs(p, nan_pair<T>());
    return;
  }

  const int chunk = p.sequence_parallel ? p.rank : 0;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const uint32_t stage_bytes = static_cast<uint32_t>((world + 1) * row_bytes);
  const int64_t src_off = p.partial_off + chunk * p.partial_cstride;
  const float inv_h = 1.0f / static_cast<float>(p.hidden);
  const int first = b + team.id() * G, step = kTeams * G;  // this team's rows
  const int stage0 = team.id() * per_team;
  float (&red)[2][kMaxThreads / 32] = s_red[team.id()];

  // The team's thread 0: fetch the P partial rows of `row` (peers' over NVLink) and its residual
  // row into stage s.
  auto issue = [&](int s, int row) {
    unsigned char* dst = s_stage + static_cast<int64_t>(s) * stage_bytes;
    mbar_arrive_expect_tx(&s_full[s], stage_bytes);
    const int64_t off = src_off + row * row_bytes;
    for (int q = 0; q < world; ++q)
      bulk_load(dst + q * row_bytes, reinterpret_cast<const char*>(p.bases[q]) + off,
                static_cast<uint32_t>(row_bytes), &s_full[s]);  // one thread: not unrolled
    bulk_load(dst + world * row_bytes, static_cast<const char*>(p.residual) + row * row_bytes,
              static_cast<uint32_t>(row_bytes), &s_full[s]);
  };
  if (team.tid() == 0) {
    fence_proxy_async_global();  // rows published before START (peers') are now bulk-read
    for (int i = 0; i < per_team; ++i) {
      const int row = first + i * step;
      if (row >= p.rows) break;
      issue(stage0 + i, row);
    }
  }

  int s = 0;
  uint32_t phase = 0;
  int parity = 0;
  Fp8Acc acc = fp8_begin(p.fp8);  // FP8 rows (fp8_rows.cuh)
  // One team: a row's normed stores are emitted one iteration late, between the next row's
  // block sums and its barrier, so their latency (FP8 rows: the block scales) overlaps that
  // barrier's wait instead of adding to the row's. Two teams: at once (the other team's work
  // overlaps them; no registers for a second row).
  float y_prev[kTeams == 1 ? kV : 1][kTeams == 1 ? 8 : 1];
  float rs_prev = 0.f;
  int prev = -1;
  auto emit = [&](int r, const float (&yr)[kV][8], float rs) {
    emit_normed<T, kV>(team, p, r, yr, rs, w, acc, [&](int, int col, const Vec16& o) {
      store_normed(p, data, chunk, r * row_bytes + col * kVecBytes, o);
    });
  };
  for (int row = first; row < p.rows; row += step, parity ^= 1) {
    mbar_wait(&s_full[stage0 + s], phase);
    const unsigned char* st = s_stage + static_cast<int64_t>(stage0 + s) * stage_bytes;
    float y[kV][8];
    float ss[kTeams] = {};
#pragma unroll
    for (int m = 0; m < kV; ++m) {
      const int col = team.tid() + m * team.size();
      if (col < hv) {
        set_vec<T>(y[m], reinterpret_cast<const Vec16*>(st)[col]);
#pragma unroll
        for (int q = 1; q < kNp; ++q)
          if (q < world)
            add_vec<T>(y[m], reinterpret_cast<const Vec16*>(st + q * row_bytes)[col]);
        add_vec<T>(y[m], reinterpret_cast<const Vec16*>(st + world * row_bytes)[col]);
        reinterpret_cast<Vec16*>(static_cast<char*>(p.residual_out) + row * row_bytes)[col] =
            pack_vec<T>(y[m]);
        add_squares(ss[m % kTeams], y[m]);
      }
    }
    publish_row_sums(team, ss, red[parity]);
    if constexpr (kTeams == 1)
      if (prev >= 0) emit(prev, y_prev, rs_prev);  // the same in every thread
    // After this sync every thread of the team is done reading stage s (and red[parity] is
    // complete; it is rewritten two iterations later, after another sync).
    team.sync();
    if (team.tid() == 0) {
      const int next = row + per_team * step;
      if (next < p.rows) {
        fence_proxy_async_shared();  // the threads' reads of stage s before the copy's writes
        issue(stage0 + s, next);
      }
    }
    if (++s == per_team) {
      s = 0;
      phase ^= 1;
    }
    if (!norm) continue;
    const float rs = block_rstd(red[parity], inv_h, p.eps);
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
  if constexpr (kTeams == 1)
    if (prev >= 0) emit(prev, y_prev, rs_prev);
  fp8_end<T>(p.fp8, acc);

  if (!p.copy_engine &&
      !cta_barrier<true>(pad_bases, p.rank, world, b, e, 0u, p.timeout_ns, &s_fail))
    poison_outputs(p, nan_pair<T>());  // a peer's normed rows (or its reads) never completed
}

}  // namespace tokenweave
