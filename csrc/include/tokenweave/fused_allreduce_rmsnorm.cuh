// Fused all-reduce + residual add + RMSNorm over peer-mapped (CUDA IPC) symmetric buffers.
//
// Data path of one CTA iteration (kRows rows at once, so that many bytes are in flight):
//   every thread loads kVpt 16-byte vectors of each of kRows rows from each of the P peers' partial
//   (all loads issued before the first use), reduces them in fp32 in rank order, adds the residual,
//   accumulates the row's sum of squares in registers, block-reduces it (warp shuffles + one smem
//   exchange), normalizes, multiplies by w (fp32), rounds once to T and stores the row to all P
//   peers' normed_out (sequence parallel) or locally (replicated). residual_out gets y rounded to T.
// Rows are split between CTAs by index (row0 = (iter * G + b) * kRows), identically on every rank;
// signal.cuh's per-CTA barriers rely on that.
#pragma once

#include "tokenweave/common.cuh"
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
};

// Rows per CTA iteration: keep kRows*kVpt*kNp vector loads (4 regs each) and kRows*kVpt*8 fp32
// values of y (kRows*kVpt <= 4) within the register budget of 512 threads/CTA.
template <int kNp, int kVpt>
struct RowsPerIter {
  static constexpr int a = 16 / (kNp * kVpt);
  static constexpr int b = 4 / kVpt;
  static constexpr int m = a < b ? a : b;
  static constexpr int value = m < 1 ? 1 : (m > 4 ? 4 : m);
};

template <typename T, int kNp, int kVpt>
__global__ void __launch_bounds__(kMaxThreads)
    fused_allreduce_rmsnorm_kernel(const FusedParams p) {
  constexpr int kRows = RowsPerIter<kNp, kVpt>::value;
  __shared__ float s_red[2][kRows][kMaxThreads / 32];
  __shared__ uint32_t s_epoch;
  __shared__ int s_fail;

  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int world = p.world;
  const int64_t* pad_bases = p.bases + p.world;
  const char* data[kNp];
#pragma unroll
  for (int q = 0; q < kNp; ++q)
    data[q] = q < world ? reinterpret_cast<const char*>(p.bases[q]) : nullptr;

  if (tid == 0) {
    s_fail = 0;
    s_epoch = next_epoch(reinterpret_cast<SignalPad*>(pad_bases[p.rank]), b);
  }
  __syncthreads();
  const uint32_t e = s_epoch;
  if (e == 0) return;  // an earlier launch timed out: do nothing until the host reads the error

  const int hv = p.hidden / kVecElems;  // vectors per row
  const bool norm = p.weight != nullptr;
  Vec16 w[kVpt];
#pragma unroll
  for (int v = 0; v < kVpt; ++v) {
    const int col = tid + v * blockDim.x;
    if (norm && col < hv) w[v] = reinterpret_cast<const Vec16*>(p.weight)[col];
  }

  if (!cta_barrier<false>(pad_bases, p.rank, world, b, e, p.timeout_ns, &s_fail)) return;

  const int chunk = p.sequence_parallel ? p.rank : 0;
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  const int64_t src_off = p.partial_off + chunk * p.partial_cstride;
  const int nwarps = blockDim.x / 32;
  const float inv_h = 1.0f / static_cast<float>(p.hidden);
  int parity = 0;

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
#pragma unroll
          for (int k = 0; k < 8; ++k) ss[r] += y[r][v][k] * y[r][v][k];
        }
      }
    }
    if (!norm) continue;
    // Block reduction of the kRows sums of squares.
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o);
      if ((tid & 31) == 0) s_red[parity][r][tid >> 5] = ss[r];
    }
    __syncthreads();  // s_red[parity] is rewritten two iterations later, after another sync
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float t = 0.f;
      for (int k = 0; k < nwarps; ++k) t += s_red[parity][r][k];
      ss[r] = rsqrtf(t * inv_h + p.eps);
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
#pragma unroll
      for (int v = 0; v < kVpt; ++v) {
        const int col = tid + v * blockDim.x;
        if (row0 + r < p.rows && col < hv) {
          float wf[8];
          set_vec<T>(wf, w[v]);
          float o[8];
#pragma unroll
          for (int k = 0; k < 8; ++k) o[k] = y[r][v][k] * ss[r] * wf[k];
          const Vec16 out = pack_vec<T>(o);
          const int64_t roff = (row0 + r) * row_bytes + col * kVecBytes;
          if (p.sequence_parallel) {
            const int64_t dst = p.normed_off + chunk * p.normed_cstride + roff;
#pragma unroll
            for (int q = 0; q < kNp; ++q)
              if (q < world) *reinterpret_cast<Vec16*>(const_cast<char*>(data[q]) + dst) = out;
          } else {
            *reinterpret_cast<Vec16*>(static_cast<char*>(p.normed_local) + roff) = out;
          }
        }
      }
    }
  }

  cta_barrier<true>(pad_bases, p.rank, world, b, e, p.timeout_ns, &s_fail);
}

}  // namespace tokenweave
