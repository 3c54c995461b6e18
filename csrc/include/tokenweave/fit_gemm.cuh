// The communicating row-parallel GEMM with fitted tiles: partial = x @ W^T (+ bias), each output
// row stored straight into the inbox slot of the rank that owns it (the GEMM-fused mechanism's
// reduce-scatter half, with the consumer's release: gemm_reduce.cuh publishes the rows after
// this kernel ends, so this kernel only stores rows).
//
// Why a CUDA kernel beside the Triton ones (kernels/owner_gemm*.py): a Triton tile's token
// extent is a power of two, so a call just past a multiple of the tile (513, 641, 777 tokens)
// computes a whole extra row block and, past a wave of tiles, a whole extra wave: 0.5-0.8x of
// cuBLAS there (docs/kernel.md). cuBLAS fits its tiles' token extent to the count. Here the
// operands are swapped (the weight's rows are the MMA's M; the tokens its N, any multiple of 8
// from 16 to 176, a template parameter BN the host fits to the call: ops/segments.fitted_tiles),
// so a tile holds as many tokens as the call needs and a count's tail costs at most 7 padded
// rows per tile. A row's owner is computed per row, so segments need not align with tiles.
//
// Operands (In): bf16 or fp16 (the output's dtype T), or e4m3 (ops/fp8_operands.py) scaled
// per tensor (FP8 recipes' delayed and current scaling), whose fp32 accumulator is multiplied by
// the two scale_inv values once per tile, before the bias and the one rounding to T, or in
// blocks (kBlocks: TE's blockwise recipe, 1 x 128 blocks of x, 128 x 128 of the weight). A stage
// holds 128 bytes of K per row either way (64 16-bit elements or 128 e4m3 ones), and one wgmma
// takes 32 bytes of it (k16 or k32), so the pipeline and its descriptors are the same. In
// blocks a stage is exactly one K block and a consumer's weight rows lie in one weight block, so
// the block's scale is one weight scale times one x scale per token: each stage's MMAs go into
// a second accumulator, which is then added into the tile's, scaled (one FFMA per element;
// the tokens' scales come with the stage, by TMA). The stage's MMAs are waited for before that
// add, so the tensor cores take the other consumer's MMAs meanwhile (both consumers run their
// main loops at once in the cooperative mode). Two accumulators a thread bound a consumer of 128
// weight rows to kMaxHalvesBlocksBN tokens; past it a consumer takes 64 weight rows (one m64
// wgmma a K step: consumer_rows), up to kMaxBlocksBN tokens in the same registers.
//
// Structure (one CTA per SM, persistent, 384 threads):
// - warpgroup 0, the producer: one thread copies each (tile, K step) of the CTA's tiles in order
//   with TMA into a ring of kStages slots (the weight's box of 128 or 256 rows and the tokens'
//   BN rows, 128 bytes of K each, 128-byte-swizzled K-major rows), each slot with a `full` barrier
//   (transaction bytes) and an `empty` barrier (the consumer warps' release);
// - warpgroups 1 and 2, the consumers, each with a kBM x BN fp32 tile part in registers (kBM 128:
//   two m64nBN wgmma per 32 bytes of K; 64 in blocks past kMaxHalvesBlocksBN tokens, where below
//   every 128 weight rows are 64 and 256 are 128); 16-bit and per tensor one wgmma group in
//   flight, each slot released as the next group is issued; in blocks each stage's group waited
//   for, the slot released after its adds. kCoop = false ("ping-pong"): consumer c takes the
//   CTA's tiles c, c + 2, ... of 128 weight rows; their main loops alternate (named barriers 1
//   and 2: a consumer waits for the slots of its tile only after the other consumer waited for
//   all of the previous tile's, so the parity it waits on is its own fill, never an older one),
//   so one consumer's epilogue runs beside the other's MMAs. kCoop = true ("cooperative"): both
//   take every tile, of 256 weight rows, 128 each: a third fewer operand bytes per MMA through
//   shared memory, the epilogue not overlapped (measured faster where each CTA has one or two
//   tiles of long K); in blocks its consumers issue each stage's MMAs in turn (the same named
//   barriers), so one consumer's scaling of a K block runs beside the other's MMAs;
// - the epilogue, per 32 tokens: bias, rounding once, through shared memory into token rows
//   (stmatrix: the accumulator holds a token's values across lanes), then 16-byte stores of each
//   valid row into its owner's slot.
//
// Tokens: `groups` groups of `group_rows` rows each (sequence parallel: one per rank, the
// owner's segment; replicated: one, all rows, owner = row / seg_rows), tiled by BN; x rows of
// group g: first + g * step + j. Tile order: groups of 8 weight tiles x every token tile (weight
// tiles reused from L2), the token tiles rotated by `start`.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>

#include "tokenweave/common.cuh"
#include "tokenweave/hopper.cuh"

namespace tokenweave {
namespace fit {

constexpr int kHalfM = 64;          // weight rows (output columns) of one m64 wgmma
constexpr int kRowBytes = 128;      // bytes of K per row and stage (the 128-byte swizzle)
constexpr int kBlockK = 128;        // e4m3 in blocks: K per scale block, one stage's
constexpr int kThreads = 384;       // producer + two consumer warpgroups
constexpr int kEpiTokens = 32;      // tokens per epilogue pass (two buffers per consumer)
constexpr int kGroupM = 8;          // weight tiles per group of the tile order
constexpr int kMinBN = 16;
constexpr int kMaxBN = 176;         // BN fp32 accumulators per consumer thread: no spills to 176
constexpr int kMaxHalvesBlocksBN = 104;  // e4m3 in blocks, 128-row consumers: 2 x BN accumulators
constexpr int kMaxBlocksBN = 208;   // e4m3 in blocks, 64-row consumers: 2 x BN / 2 accumulators
constexpr int kScaleLead = 4;       // e4m3 in blocks: x scales per 16 bytes (a TMA box's start)
constexpr int kSmemLimit = 232448;  // bytes of dynamic shared memory per block (sm_90)
constexpr int kBarrierBytes = 256;  // the pipeline's barriers, after the stages
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;

struct FitGemmParams {
  int64_t regions[kMaxRanks];  // every rank's inbox region as this rank maps it
  int64_t slots_off;           // bytes from a region's base to its slots
  const void* bias;            // [n_out] or null
  const float* scale_inv[2];   // e4m3 operands: x's and the weight's dequantization scales
  int ws_stride, w_blocks;     // blocks: the weight scales' row stride and rows (N blocks)
  int n_out, k;                // output columns (hidden) and in-features
  int rank, slot_rows;         // this rank's slot in every owner's inbox; rows per slot
  int row0;                    // inbox row of a segment's row 0
  int first, step;             // x rows of group g: first + g * step + j
  int groups, group_rows;      // token groups (sequence parallel: world; replicated: 1)
  int seg_rows;                // replicated: rows per owner (owner = row / seg_rows)
  float inv_seg_rows;          // 1 / seg_rows (the owner of a row, corrected to the exact one)
  int group_tiles;             // token tiles per group: ceil(group_rows / BN)
  int m_tiles;                 // weight tiles: ceil(n_out / tile rows)
  int tiles;                   // m_tiles * groups * group_tiles
  int start;                   // the first token tile (rotation)
};

// Weight rows per consumer: two m64 halves (BN accumulators a thread), or one in blocks past
// kMaxHalvesBlocksBN tokens (a K block's products beside the sums: 2 x BN / 2 a thread), which
// keeps the tokens of a tile to kMaxBlocksBN within the registers of the halves' 104.
__host__ __device__ constexpr int consumer_rows(int bn, bool blocks) {
  return blocks && bn > kMaxHalvesBlocksBN ? kHalfM : 2 * kHalfM;
}

// kCoop: both consumers on one tile of 2 x kBM weight rows (each its own kBM); else each its own
// tiles of kBM rows, alternating ("ping-pong"). kBlocks: a stage also holds the tile's tokens'
// scales of its K block (BN fp32).
template <int BN, bool kCoop, bool kBlocks = false>
struct Shape {
  static constexpr int kBM = consumer_rows(BN, kBlocks);
  static constexpr int kSubs = kBM / kHalfM;  // m64 wgmma per 32 bytes of K
  static constexpr int kTileM = kCoop ? 2 * kBM : kBM;
  static constexpr int kAStage = kTileM * kRowBytes;
  static constexpr int kBStage = BN * kRowBytes;
  // kBlocks: the box of x scales, from the 16-byte-aligned token below the tile's first, so
  // kScaleLead more (a box at the tile's first token faulted, illegal instruction, on an H100
  // wherever that token's offset was not a multiple of 16 bytes).
  static constexpr int kScaleBox = BN + kScaleLead;
  static constexpr int kSStage = kBlocks ? (kScaleBox * 4 + 127) / 128 * 128 : 0;
  static constexpr int kStageBytes = kAStage + kBStage + kSStage;
  static constexpr int kEpiBuffer = kEpiTokens * kBM * 2;  // bytes: token rows of kBM columns
  static constexpr int kEpiBytes = 2 * 2 * kEpiBuffer;     // two consumers, two buffers
  static constexpr int kFree = kSmemLimit - kBarrierBytes - kEpiBytes;
  static constexpr int kStages = kFree / kStageBytes > 8 ? 8 : kFree / kStageBytes;
  static constexpr int kSmem = kStages * kStageBytes + kEpiBytes + kBarrierBytes;
  static_assert(BN % 8 == 0 && BN >= kMinBN && BN <= (kBlocks ? kMaxBlocksBN : kMaxBN),
                "BN: a multiple of 8 in kMinBN..kMaxBN (kMaxBlocksBN in blocks)");
  static_assert(kStages >= 3, "too few pipeline stages fit");
  static_assert(!kBlocks || kBlockK % kBM == 0, "a consumer's weight rows: one scale block");
};

// An operand type's wgmma and K per stage (kRowBytes of it).
template <typename In>
struct Operand {
  static constexpr bool kFp8 = std::is_same<In, __nv_fp8_e4m3>::value;
  static constexpr hopper::MmaType kMma =
      kFp8 ? hopper::MmaType::kE4m3
           : (std::is_same<In, __nv_bfloat16>::value ? hopper::MmaType::kBf16
                                                     : hopper::MmaType::kF16);
  static constexpr int kStageK = kRowBytes / static_cast<int>(sizeof(In));
  static_assert(kFp8 || std::is_same<In, __nv_bfloat16>::value || std::is_same<In, __half>::value,
                "operands: bf16, fp16 or e4m3");
};

// (weight tile, token tile) of a linear tile index.
__device__ __forceinline__ void tile_coords(const FitGemmParams& p, int tile, int& mt, int& nt) {
  const int n_tiles = p.groups * p.group_tiles;
  const int per_group = kGroupM * n_tiles;
  const int first_m = (tile / per_group) * kGroupM;
  const int size = min(p.m_tiles - first_m, kGroupM);
  const int in_group = tile % per_group;
  mt = first_m + in_group % size;
  nt = (in_group / size + p.start) % n_tiles;
}

// The x row of a token tile's first token.
__device__ __forceinline__ int tile_x_row(const FitGemmParams& p, int nt, int bn) {
  const int g = nt / p.group_tiles;
  return p.first + g * p.step + (nt - g * p.group_tiles) * bn;
}

// Byte offset of the 16-byte granule `granule` of token row `row` in a staging buffer: rows of
// kBM elements, granules XOR-swizzled by the row so that neither stmatrix's 8-row blocks nor the
// row reads meet bank conflicts.
template <int kBM>
__device__ __forceinline__ uint32_t stage_offset(int row, int granule) {
  return static_cast<uint32_t>(row * kBM * 2 + ((granule ^ (row & 7)) << 4));
}

// The owner of row j of a replicated call (j / seg_rows: the float estimate is off by at most one).
__device__ __forceinline__ int owner_of(const FitGemmParams& p, int j) {
  int owner = __float2int_rz(static_cast<float>(j) * p.inv_seg_rows);
  owner -= owner * p.seg_rows > j;
  owner += (owner + 1) * p.seg_rows <= j;
  return owner;
}

// A consumer's kSubs x 64 by BN accumulators (weight columns col0.., token tile nt) into the
// owners' inboxes: per kEpiTokens tokens, bias and rounding into a staging buffer (stmatrix, token
// rows), then each thread's 16 bytes of kEpiTokens x kSubs / 16 rows, all loaded before any is
// stored. Two buffers, so one barrier per pass: a buffer is rewritten two passes later, after
// every thread passed the barrier between. `pass` counts the consumer's passes over all its
// tiles. (Measured on one H200: faster than handing the staged rows to the copy engine, per row
// or per 8-row box, whose many small copies cost 2-3x this pass's time.)
template <typename T, int BN, int kSubs>
__device__ __forceinline__ void epilogue(const FitGemmParams& p, float (&acc)[kSubs][BN / 2],
                                         int col0, int nt, uint8_t* stage, int consumer,
                                         int& pass) {
  using namespace hopper;
  constexpr int kBM = kSubs * kHalfM;
  constexpr int kGranules = kBM * 2 / 16;            // 16-byte granules of a staged row
  constexpr int kSweepRows = 128 / kGranules;        // rows the consumer's threads read at once
  constexpr int kSweeps = kEpiTokens / kSweepRows;   // rows per thread per pass
  const int tid = threadIdx.x - 128 * (consumer + 1);
  const int warp = tid >> 5, lane = tid & 31;
  float bias[kSubs][2] = {};
  if (p.bias != nullptr) {
#pragma unroll
    for (int sub = 0; sub < kSubs; ++sub)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = col0 + sub * 64 + 16 * warp + (lane >> 2) + 8 * h;
        if (col < p.n_out) bias[sub][h] = to_float(static_cast<const T*>(p.bias)[col]);
      }
  }
  const int g = nt / p.group_tiles;
  const int j0 = (nt - g * p.group_tiles) * BN;  // the tile's first row within its group
  const int valid = min(BN, p.group_rows - j0);  // rows of the tile that hold rows
  // This thread's granule and first row of a pass (kGranules: a power of two).
  const int vcol = tid & (kGranules - 1), vrow = static_cast<unsigned>(tid) / kGranules;
  const bool col_ok = col0 + vcol * 8 < p.n_out;
  const int64_t row_bytes = static_cast<int64_t>(p.n_out) * sizeof(T);
  const int64_t col_bytes = (static_cast<int64_t>(col0) + vcol * 8) * sizeof(T);
  const int64_t slot_row0 = static_cast<int64_t>(p.rank) * p.slot_rows + p.row0;
  const bool sp = p.groups > 1;
#pragma unroll
  for (int c = 0; c < (BN + kEpiTokens - 1) / kEpiTokens; ++c, ++pass) {
    uint8_t* buf = stage + (pass & 1) * (kEpiTokens * kBM * 2);
    // Token rows through stmatrix (transposed 8 x 8 blocks): lane 8 * i + r addresses row r of
    // block i = (weight rows +8 or not, token group of the pair).
#pragma unroll
    for (int jj = 0; jj < kEpiTokens / 8; jj += 2) {
      const int j = c * (kEpiTokens / 8) + jj;
      const int blk = lane >> 3;
      const int n = 8 * (jj + (blk >> 1)) + (lane & 7);
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) {
        const int granule = sub * 8 + 2 * warp + (blk & 1);
        const uint32_t addr = smem_addr(buf) + stage_offset<kBM>(n, granule);
        const float b0 = bias[sub][0], b1 = bias[sub][1];
        if (j + 1 < BN / 8) {
          stmatrix_x4_trans(addr,
                            Pack<T>::from_float2(acc[sub][4 * j] + b0, acc[sub][4 * j + 1] + b0),
                            Pack<T>::from_float2(acc[sub][4 * j + 2] + b1,
                                                 acc[sub][4 * j + 3] + b1),
                            Pack<T>::from_float2(acc[sub][4 * j + 4] + b0,
                                                 acc[sub][4 * j + 5] + b0),
                            Pack<T>::from_float2(acc[sub][4 * j + 6] + b1,
                                                 acc[sub][4 * j + 7] + b1));
        } else if (j < BN / 8) {
          stmatrix_x2_trans(addr,
                            Pack<T>::from_float2(acc[sub][4 * j] + b0, acc[sub][4 * j + 1] + b0),
                            Pack<T>::from_float2(acc[sub][4 * j + 2] + b1,
                                                 acc[sub][4 * j + 3] + b1));
        }
      }
    }
    bar_sync(3 + consumer, 128);
    Vec16 v[kSweeps];
#pragma unroll
    for (int q = 0; q < kSweeps; ++q)
      v[q] = *reinterpret_cast<const Vec16*>(
          buf + stage_offset<kBM>(vrow + kSweepRows * q, vcol));
#pragma unroll
    for (int q = 0; q < kSweeps; ++q) {
      const int row = c * kEpiTokens + vrow + kSweepRows * q;  // within the tile
      if (row < valid && col_ok) {
        const int j = j0 + row;
        const int owner = sp ? g : owner_of(p, j);
        const int seg_j = sp ? j : j - owner * p.seg_rows;
        char* dst = reinterpret_cast<char*>(p.regions[owner] + p.slots_off) +
                    (slot_row0 + seg_j) * row_bytes + col_bytes;
        store_vec(dst, v[q]);
      }
    }
  }
}

// The main loop of one tile per consumer: its K steps' MMAs into acc. 16-bit or e4m3 per
// tensor: one wgmma group in flight while the next is issued, each slot released once the MMAs
// that read it are done; the last group is left in flight, its slot returned (the caller waits
// for it: a ping-pong consumer first lets the other one start). kBlocks: each step's MMAs into
// `part`, waited for, then added into acc scaled by the weight block's scale (`ws`: its K
// blocks' scales; null past the weight's rows) times each token's (the stage's scales, the
// tile's first `lead` places in); every slot released here (returns -1). Cooperative blocks:
// `consumer` and the CTA's last stage sequence number `last_seq` order the two consumers' issue.
template <typename In, int BN, bool kCoop, bool kBlocks,
          int kSubs = Shape<BN, kCoop, kBlocks>::kSubs>
__device__ __forceinline__ int main_loop(float (&acc)[kSubs][BN / 2],
                                          float (&part)[kSubs][BN / 2],
                                          const uint8_t* a_smem, const uint8_t* b_smem,
                                          const uint8_t* s_smem, uint64_t* full, uint64_t* empty,
                                          int seq0, int k_steps, uint32_t a_part,
                                          const float* ws, int lead, int consumer,
                                          int last_seq) {
  using namespace hopper;
  using S = Shape<BN, kCoop, kBlocks>;
  using Op = Operand<In>;
  const int lane = threadIdx.x & 31;
  int prev = -1;
  if constexpr (kBlocks) {
#pragma unroll
    for (int sub = 0; sub < kSubs; ++sub)
#pragma unroll
      for (int e = 0; e < BN / 2; ++e) acc[sub][e] = 0.f;
  }
  for (int kt = 0; kt < k_steps; ++kt) {
    const int seq = seq0 + kt;
    const int s = seq % S::kStages;
    mbar_wait(&full[s], (seq / S::kStages) & 1);
    const uint32_t a0 = smem_addr(a_smem + s * S::kAStage) + a_part;
    const uint32_t b0 = smem_addr(b_smem + s * S::kBStage);
    // Cooperative blocks: the consumers issue a stage's MMAs in turn (consumer 0 after consumer
    // 1 issued the stage before, consumer 1 after consumer 0 issued this one), so one
    // consumer's MMAs run while the other scales its finished ones (without it both waited and
    // scaled at once: 1.017x faster at the median, docs/kernel.md "Speed, in blocks"). A
    // barrier's next arrival follows the other consumer's completed wait on it, so two
    // generations never mix; neither wait holds the producer (a slot is refilled only after
    // both consumers released it).
    if constexpr (kBlocks && kCoop)
      if (consumer == 1 || seq > 0) bar_sync(1 + consumer, 256);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kRowBytes / 32; ++kk) {
      const uint64_t bd = smem_desc_k128(b0 + kk * 32);
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) {
        const uint64_t ad = smem_desc_k128(a0 + sub * kHalfM * kRowBytes + kk * 32);
        if constexpr (kBlocks)
          Wgmma<BN>::template mma<Op::kMma>(part[sub], ad, bd, kk != 0);
        else
          Wgmma<BN>::template mma<Op::kMma>(acc[sub], ad, bd, (kt | kk) != 0);
      }
    }
    wgmma_commit();
    if constexpr (kBlocks && kCoop)
      if (consumer == 0 || seq < last_seq) bar_arrive(2 - consumer, 256);
    if constexpr (kBlocks) {
      const float sw = ws != nullptr ? __ldg(ws + kt) : 0.f;  // loaded while the MMAs run
      wgmma_wait<0>();
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) fence_regs(part[sub]);
      // Accumulator element 4 j + 2 h + c holds token 8 j + 2 (lane % 4) + c.
      const float* xs =
          reinterpret_cast<const float*>(s_smem + s * S::kSStage) + lead + 2 * (lane & 3);
#pragma unroll
      for (int j = 0; j < BN / 8; ++j) {
        const float s0 = xs[8 * j] * sw, s1 = xs[8 * j + 1] * sw;
#pragma unroll
        for (int sub = 0; sub < kSubs; ++sub) {
          acc[sub][4 * j] = fmaf(part[sub][4 * j], s0, acc[sub][4 * j]);
          acc[sub][4 * j + 1] = fmaf(part[sub][4 * j + 1], s1, acc[sub][4 * j + 1]);
          acc[sub][4 * j + 2] = fmaf(part[sub][4 * j + 2], s0, acc[sub][4 * j + 2]);
          acc[sub][4 * j + 3] = fmaf(part[sub][4 * j + 3], s1, acc[sub][4 * j + 3]);
        }
      }
      __syncwarp();  // every lane read the slot's scales
      if (lane == 0) mbar_arrive(&empty[s]);
    } else {
      wgmma_wait<1>();  // the previous step's MMAs are done: release its slot
#pragma unroll
      for (int sub = 0; sub < kSubs; ++sub) fence_regs(acc[sub]);
      if (prev >= 0 && lane == 0) mbar_arrive(&empty[prev]);
      prev = s;
    }
  }
  return prev;
}

template <typename T, typename In, int BN, bool kCoop, bool kBlocks>
__global__ void __launch_bounds__(kThreads, 1)
    fit_gemm_kernel(const __grid_constant__ CUtensorMap w_map,
                    const __grid_constant__ CUtensorMap x_map,
                    const __grid_constant__ CUtensorMap s_map, const FitGemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace hopper;
  using S = Shape<BN, kCoop, kBlocks>;
  using Op = Operand<In>;
  static_assert(!kBlocks || Op::kFp8, "block scales are e4m3 operands'");
  // Dynamic shared memory starts 1024-byte aligned (no static shared memory here): the
  // 128-byte swizzle of the stages needs it.
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* a_smem = smem;
  uint8_t* b_smem = a_smem + S::kStages * S::kAStage;
  uint8_t* s_smem = b_smem + S::kStages * S::kBStage;  // kBlocks: the tokens' scales
  uint8_t* epi = s_smem + S::kStages * S::kSStage;
  uint64_t* full = reinterpret_cast<uint64_t*>(epi + S::kEpiBytes);
  uint64_t* empty = full + S::kStages;

  const int wg = threadIdx.x / 128;
  const int k_steps = (p.k + Op::kStageK - 1) / Op::kStageK;
  const int local_tiles =
      blockIdx.x < p.tiles ? (p.tiles - 1 - static_cast<int>(blockIdx.x)) / gridDim.x + 1 : 0;
  if (threadIdx.x == 0) {
    if (smem_addr(smem) & 1023) __trap();  // the swizzled stages would read the wrong bytes
    for (int s = 0; s < S::kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kCoop ? 8 : 4);  // lane 0 of each warp that reads the slot
    }
    fence_mbar_init();
  }
  __syncthreads();

  if (wg == 0) {
    regs_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_map(&w_map);
      prefetch_map(&x_map);
      if constexpr (kBlocks) prefetch_map(&s_map);
      for (int i = 0; i < local_tiles; ++i) {
        int mt, nt;
        tile_coords(p, blockIdx.x + i * gridDim.x, mt, nt);
        const int x_row = tile_x_row(p, nt, BN);
        for (int kt = 0; kt < k_steps; ++kt) {
          const int seq = i * k_steps + kt;
          const int s = seq % S::kStages, fill = seq / S::kStages;
          if (fill > 0) mbar_wait(&empty[s], (fill - 1) & 1);
          mbar_arrive_expect_tx(&full[s],
                                S::kAStage + S::kBStage + (kBlocks ? S::kScaleBox * 4 : 0));
          tma_load_2d(a_smem + s * S::kAStage, &w_map, kt * Op::kStageK, mt * S::kTileM,
                      &full[s]);
          tma_load_2d(b_smem + s * S::kBStage, &x_map, kt * Op::kStageK, x_row, &full[s]);
          if constexpr (kBlocks)
            tma_load_2d(s_smem + s * S::kSStage, &s_map, x_row & -kScaleLead, kt, &full[s]);
        }
      }
    }
    return;
  }
  regs_inc<kConsumerRegs>();
  const int consumer = wg - 1;
  uint8_t* stage = epi + consumer * 2 * S::kEpiBuffer;
  const int col_part = kCoop ? consumer * S::kBM : 0;  // this consumer's weight rows in the tile
  int pass = 0;
  // e4m3 per tensor: the product of the two dequantization scales, applied to each finished
  // tile.
  const float scale = Op::kFp8 && !kBlocks ? p.scale_inv[0][0] * p.scale_inv[1][0] : 1.f;
  float acc[S::kSubs][BN / 2];
  float part[S::kSubs][BN / 2];  // kBlocks: one K block's products
  for (int i = kCoop ? 0 : consumer; i < local_tiles; i += kCoop ? 1 : 2) {
    const float* ws = nullptr;  // kBlocks: the K blocks' scales of this consumer's weight rows
    int lead = 0;               // kBlocks: the tile's first token in the stage's scales
    if constexpr (kBlocks) {
      int mt, nt;
      tile_coords(p, blockIdx.x + i * gridDim.x, mt, nt);
      const int block = (mt * S::kTileM + col_part) / kBlockK;
      if (block < p.w_blocks) ws = p.scale_inv[1] + static_cast<int64_t>(block) * p.ws_stride;
      lead = tile_x_row(p, nt, BN) & (kScaleLead - 1);
    }
    // Ping-pong: the other consumer waited for all of tile i - 1's slots.
    if (!kCoop && i > 0) bar_sync(1 + consumer, 256);
    const int prev = main_loop<In, BN, kCoop, kBlocks>(
        acc, part, a_smem, b_smem, s_smem, full, empty, i * k_steps, k_steps,
        col_part * kRowBytes, ws, lead, consumer, local_tiles * k_steps - 1);
    if (!kCoop && i + 1 < local_tiles) bar_arrive(1 + (1 - consumer), 256);
    if constexpr (!kBlocks) {
      wgmma_wait<0>();
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub) fence_regs(acc[sub]);
      if ((threadIdx.x & 31) == 0) mbar_arrive(&empty[prev]);
    }
    int mt, nt;
    tile_coords(p, blockIdx.x + i * gridDim.x, mt, nt);
    const int col0 = mt * S::kTileM + col_part;
    if constexpr (Op::kFp8 && !kBlocks) {
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[sub][e] *= scale;
    }
    epilogue<T, BN, S::kSubs>(p, acc, col0, nt, stage, consumer, pass);
  }
#else
  __trap();  // sm_90a only: the launcher refuses other devices
#endif
}

}  // namespace fit
}  // namespace tokenweave
