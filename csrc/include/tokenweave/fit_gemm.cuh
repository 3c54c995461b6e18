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
// from 16 to 176, to 208 in the cooperative mode: consumer_rows; a template parameter BN the
// host fits to the call: ops/segments.fitted_tiles),
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
// wgmma a K step: consumer_rows), up to kMaxWideBN tokens in the same registers.
//
// Tokens as M (kTokensM, e4m3 in blocks only): the operands the other way round, the tokens the
// MMA's M (64 a consumer: one m64 wgmma a K step) and the weight's rows its N (BN, the tile's
// weight extent: a multiple of 8 to kMaxWideBN, not the call's token count). A consumer
// thread's accumulators then hold two token rows (warp * 16 + lane / 4 and + 8) by the tile's
// columns, so a K block is scaled by two x scales a thread (not BN / 4), loaded from global
// memory while the block's MMAs run, and by the scales of the weight blocks the tile's columns
// span, each column's block known at compile time (RowScales: the kernel holds a main loop per
// place of the tile's first column in its weight block). Token tiles are 64 rows (ping-pong) or
// 128 (cooperative), so a count's tail costs up to 63 or 127 padded rows a tile (what a
// measurement is to weigh against the scales saved: docs/kernel.md "Speed, in blocks").
//
// Pairs (kPair; the cooperative mode, 16-bit or e4m3 per tensor): a cluster of two CTAs takes
// one weight tile with two token tiles, each CTA copying half of each stage's weight rows into
// both CTAs' shared memory (TMA multicast) and its own tokens, so a CTA reads a third fewer
// bytes from L2 a stage. Why: at one tile a CTA the kernel's tensor pipes wait for their
// operands (docs/kernel.md, "One tile a CTA under Nsight Compute": 1.57x cuBLAS's L2 bytes, its
// kernel there on clusters of two). A slot is refilled only after both CTAs' consumers released
// it (each consumer warp arrives on both CTAs' `empty` barrier), and a producer waits for the last
// releases of every slot before its CTA exits (the other CTA's consumers arrive on its barriers).
// Where the count of token tiles is odd, a pair's second tile is none: that CTA computes an
// existing token tile again (the weight's loads are shared) and stores nothing.
//
// Split K (p.split_tiles > 0; the cooperative mode outside pairs, 16-bit or e4m3 per tensor):
// the call's whole waves of tiles as without it, then the K steps of its last p.split_tiles
// tiles (the part wave, or it and one whole wave) laid end to end and dealt out evenly,
// p.split_steps a CTA (Work), so the part wave keeps every SM busy for a shorter time: at 777
// tokens of a hidden-3584 shard 112 tiles of 128 x 200 leave 20 of 132 SMs idle through the
// whole K loop. A split tile whose steps span CTAs is finished by the one holding its last
// step: the others store their fp32 sums (split_store: a slot and a flag a CTA), it adds them
// (split_add) and runs the epilogue. The whole tiles come first, so that the CTAs run them in
// step, as without split K: tiles that share weight rows then read them from L2, not DRAM.
// Dealing every tile's steps out instead (each CTA a contiguous share of all) ran at 0.70x of
// the whole-tile kernel's speed at the median (one H100, 2026-12-07; docs/kernel.md "Split K").
//
// Structure (one CTA per SM, persistent, 384 threads):
// - warpgroup 0, the producer: one thread copies each (tile, K step) of the CTA's units in order
//   with TMA into a ring of kStages slots (the weight's box of 128 or 256 rows and the tokens'
//   BN rows, or with kTokensM the tokens' 64 or 128 and the weight's BN, 128 bytes of K each,
//   128-byte-swizzled K-major rows), each slot with a `full` barrier
//   (transaction bytes) and an `empty` barrier (the consumer warps' release);
// - warpgroups 1 and 2, the consumers, each with a kBM x BN fp32 tile part in registers (kBM 128:
//   two m64nBN wgmma per 32 bytes of K; 64 past kMaxBN tokens in the cooperative mode, in blocks
//   past kMaxHalvesBlocksBN, where below every 128 weight rows are 64 and 256 are 128); 16-bit
//   and per tensor one wgmma group in flight, each slot released as the next group is issued; in
//   blocks each stage's group waited for, the slot released after its adds. kCoop = false
//   ("ping-pong"): consumer c takes the CTA's tiles c, c + 2, ... of 128 weight rows; their
//   main loops alternate (named barriers 1 and 2: a consumer waits for the slots of its tile
//   only after the other consumer waited for all of the previous tile's, so the parity it waits
//   on is its own fill, never an older one),
//   so one consumer's epilogue runs beside the other's MMAs. kCoop = true ("cooperative"): both
//   take every tile, of 256 weight rows, 128 each: a third fewer operand bytes per MMA through
//   shared memory, the epilogue not overlapped (measured faster where each CTA has one or two
//   tiles of long K); in blocks its consumers issue each stage's MMAs in turn (the same named
//   barriers), so one consumer's scaling of a K block runs beside the other's MMAs;
// - the epilogue, per 32 tokens (kTokensM: per 64 weight columns): bias, rounding once, through
//   shared memory into token rows (stmatrix, transposed where the accumulator holds a token's
//   values across lanes), then 16-byte stores of each valid row into its owner's slot.
//
// Tokens: `groups` groups of `group_rows` rows each (sequence parallel: one per rank, the
// owner's segment; replicated: one, all rows, owner = row / seg_rows), tiled by BN; x rows of
// group g: first + g * step + j. Tile order: groups of 8 weight tiles x every token tile (weight
// tiles reused from L2), the token tiles rotated by `start`.
#pragma once

#include <cuda_fp8.h>

#include <type_traits>
#include <utility>

#include "tokenweave/common.cuh"
#include "tokenweave/hopper.cuh"
#include "tokenweave/signal.cuh"

namespace tokenweave {
namespace fit {

constexpr int kHalfM = 64;          // weight rows (output columns) of one m64 wgmma
constexpr int kRowBytes = 128;      // bytes of K per row and stage (the 128-byte swizzle)
constexpr int kBlockK = 128;        // e4m3 in blocks: K per scale block, one stage's
constexpr int kThreads = 384;       // producer + two consumer warpgroups
constexpr int kEpiTokens = 32;      // tokens per epilogue pass (two buffers per consumer), or
                                    // less staging where that frees a stage (Shape)
constexpr int kGroupM = 8;          // weight tiles per group of the tile order
constexpr int kMinBN = 16;
constexpr int kMaxBN = 176;         // 128-row consumers: BN fp32 accumulators a thread, no spills
constexpr int kMaxHalvesBlocksBN = 104;  // e4m3 in blocks, 128-row consumers: 2 x BN accumulators
constexpr int kMaxWideBN = 208;     // 64-row consumers (wgmma N to 208): BN / 2 accumulators a
                                    // thread, 2 x BN / 2 in blocks
constexpr int kScaleLead = 4;       // e4m3 in blocks: x scales per 16 bytes (a TMA box's start)
constexpr int kTokensMEpiCols = 64;  // kTokensM: weight columns per epilogue pass
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
  int xs_stride;               // blocks: the x scales' row stride (a K block's tokens)
  int n_out, k;                // output columns (hidden) and in-features
  int rank, slot_rows;         // this rank's slot in every owner's inbox; rows per slot
  int row0;                    // inbox row of a segment's row 0
  int first, step;             // x rows of group g: first + g * step + j
  int groups, group_rows;      // token groups (sequence parallel: world; replicated: 1)
  int seg_rows;                // replicated: rows per owner (owner = row / seg_rows)
  float inv_seg_rows;          // 1 / seg_rows (the owner of a row, corrected to the exact one)
  int group_tiles;             // token tiles per group: ceil(group_rows / a tile's tokens)
  int m_tiles;                 // weight tiles: ceil(n_out / a tile's weight rows)
  int tiles;                   // m_tiles * groups * group_tiles
  int start;                   // the first token tile (rotation)
  // Split K (the cooperative mode, 16-bit and per tensor): the last split_tiles tiles (0: none)
  // with their K steps laid end to end and dealt out split_steps a CTA; a tile's sums from CTAs
  // before the one holding its last K step come through split_sums (kTileM x BN fp32 a CTA, by
  // blockIdx), each with its flag in split_flags (zero between calls).
  int split_tiles;
  int split_steps;
  float* split_sums;
  unsigned* split_flags;
};

// Weight rows per consumer: two m64 halves (BN accumulators a thread), or one past kMaxBN
// tokens, in blocks past kMaxHalvesBlocksBN (a K block's products beside the sums: 2 x BN / 2 a
// thread), which takes a tile to kMaxWideBN tokens within the same registers. Why wider tiles
// of fewer weight rows: a count such as 777 fits 4 x 200 tokens (3 % padding) where tiles of at
// most 176 take 8 x 104 (7 %) for as many tiles; cuBLAS picks 128 x 200 there.
__host__ __device__ constexpr int consumer_rows(int bn, bool blocks) {
  return bn > (blocks ? kMaxHalvesBlocksBN : kMaxBN) ? kHalfM : 2 * kHalfM;
}

// The largest token extent of an instantiation: 64-row consumers past kMaxBN in blocks or in
// the cooperative mode (one CTA), not as ping-pong tiles of 64 weight rows (16-bit or per
// tensor), nor in pairs.
__host__ __device__ constexpr int max_bn(bool coop, bool blocks, bool pair) {
  return blocks || (coop && !pair) ? kMaxWideBN : kMaxBN;
}

// Pipeline stages of stage_bytes that fit beside epi_bytes of epilogue staging (at most 8).
__host__ __device__ constexpr int stages_beside(int stage_bytes, int epi_bytes) {
  const int fit = (kSmemLimit - kBarrierBytes - epi_bytes) / stage_bytes;
  return fit > 8 ? 8 : fit;
}

// Epilogue staging: two consumers, `buffers` buffers each of `rows` token rows by `cols` 16-bit
// columns.
__host__ __device__ constexpr int epi_bytes(int rows, int cols, int buffers) {
  return 2 * buffers * rows * cols * 2;
}

// An instantiation's tile. A is the MMA's M operand, B its N operand: the weight's rows and the
// tokens (BN of them), or with kTokensM the tokens (kHalfM a consumer) and the weight's rows (BN).
// kCoop: both consumers on one tile of 2 x kBM rows of A (each its own kBM); else each its own
// tiles of kBM rows of A, alternating ("ping-pong"). kBlocks without kTokensM: a stage also
// holds the tile's tokens' scales of its K block (BN fp32).
template <int BN, bool kCoop, bool kBlocks = false, bool kTokensM = false, bool kPair = false>
struct Shape {
  static constexpr int kN = BN;
  static constexpr bool kBlockScales = kBlocks, kTokensAsM = kTokensM;
  static constexpr int kCtas = kPair ? 2 : 1;  // CTAs a cluster
  static constexpr int kBM = kTokensM ? kHalfM : consumer_rows(BN, kBlocks);
  static constexpr int kSubs = kBM / kHalfM;  // m64 wgmma per 32 bytes of K
  static constexpr int kTileM = kCoop ? 2 * kBM : kBM;
  static constexpr int kTileTokens = kTokensM ? kTileM : BN;
  static constexpr int kTileWeights = kTokensM ? BN : kTileM;
  static constexpr int kAStage = kTileM * kRowBytes;
  static constexpr int kBStage = BN * kRowBytes;
  // kBlocks without kTokensM: the box of x scales, from the 16-byte-aligned token below the
  // tile's first, so kScaleLead more (a box at the tile's first token faulted, illegal
  // instruction, on an H100 wherever that token's offset was not a multiple of 16 bytes).
  static constexpr bool kScaleStage = kBlocks && !kTokensM;
  static constexpr int kScaleBox = BN + kScaleLead;
  static constexpr int kSStage = kScaleStage ? (kScaleBox * 4 + 127) / 128 * 128 : 0;
  static constexpr int kStageBytes = kAStage + kBStage + kSStage;
  // An epilogue pass stages kEpiRows token rows of kEpiCols columns in one of kEpiBuffers
  // buffers: kEpiTokens of the consumer's kBM weight rows, or with kTokensM its kBM tokens of
  // kTokensMEpiCols columns. Less staging where that gives the ring a fourth stage (cooperative
  // tiles of 136-176 tokens: three stages of 50-55 KB beside 32 KB of staging), so the copies
  // run further ahead of the MMAs: half the tokens a pass (136-160 tokens: 16 KB), and one
  // buffer (168 and 176: 8 KB; a second barrier a pass).
  static constexpr int kEpiCols = kTokensM ? kTokensMEpiCols : kBM;
  static constexpr bool kLessStaging =
      !kTokensM && stages_beside(kStageBytes, epi_bytes(kEpiTokens, kEpiCols, 2)) < 4;
  static constexpr int kEpiRows = kTokensM ? kBM : (kLessStaging ? kEpiTokens / 2 : kEpiTokens);
  static constexpr int kEpiBuffers =
      kLessStaging && stages_beside(kStageBytes, epi_bytes(kEpiRows, kEpiCols, 2)) < 4 ? 1 : 2;
  static constexpr int kEpiBuffer = kEpiRows * kEpiCols * 2;  // bytes
  static constexpr int kEpiBytes = epi_bytes(kEpiRows, kEpiCols, kEpiBuffers);
  static constexpr int kStages = stages_beside(kStageBytes, kEpiBytes);
  static constexpr int kSmem = kStages * kStageBytes + kEpiBytes + kBarrierBytes;
  // kTokensM: the same registers as 64-row consumers in blocks, 2 x BN / 2 floats a thread.
  static_assert(BN % 8 == 0 && BN >= kMinBN && BN <= max_bn(kCoop, kBlocks, kPair),
                "BN: a multiple of 8 in kMinBN..max_bn");
  static_assert(kStages >= (kLessStaging ? 4 : 3), "too few pipeline stages fit");
  static_assert(!kTokensM || kBlocks, "tokens as M: e4m3 operands in blocks only");
  static_assert(!kPair || (kCoop && !kBlocks), "pairs: the cooperative mode, not in blocks");
  static_assert(!kScaleStage || kBlockK % kBM == 0, "a consumer's weight rows: one scale block");
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

// (weight tile, token tile) of unit of work `unit` (units: p.tiles, kCtas token tiles of one
// weight tile each, the cluster's CTAs one token tile each, rank blockIdx.x % kCtas). False
// where the unit has no such token tile (pairs over an odd count of token tiles).
template <int kCtas>
__device__ __forceinline__ bool tile_coords(const FitGemmParams& p, int unit, int& mt, int& nt) {
  const int n_tiles = p.groups * p.group_tiles;
  const int per_group = kGroupM * ((n_tiles + kCtas - 1) / kCtas);
  const int first_m = (unit / per_group) * kGroupM;
  const int size = min(p.m_tiles - first_m, kGroupM);
  const int in_group = unit % per_group;
  mt = first_m + in_group % size;
  const int j = kCtas * (in_group / size) + static_cast<int>(blockIdx.x % kCtas);
  nt = (j + p.start) % n_tiles;
  return kCtas == 1 || j < n_tiles;
}

// A CTA's units of work, each a tile's K steps [kb, ke) of k_steps: its whole tiles, first +
// i * stride of the tiles before the split ones (all of them without split K); then with split
// K (kSplit, p.split_tiles > 0) its share [s, e) of the split tiles' K steps laid end to end, a
// unit per split tile it touches, taken from the last backwards. Why backwards: a split tile's
// K steps run in consecutive CTAs, and the one holding its last step adds the others' sums; its
// part lies at the start of its share, which it takes last, theirs at the end of theirs, which
// they take first, so it rarely waits. The members are worked out from p (kernel parameters)
// when asked, so that no registers hold them through the main loops.
template <int kCtas, bool kSplit>
struct Work {
  const FitGemmParams& p;
  int k_steps;

  __device__ __forceinline__ int first() const { return static_cast<int>(blockIdx.x) / kCtas; }
  __device__ __forceinline__ int stride() const { return static_cast<int>(gridDim.x) / kCtas; }
  __device__ __forceinline__ int split_tiles() const { return kSplit ? p.split_tiles : 0; }
  // Tiles taken whole, and this CTA's count of them.
  __device__ __forceinline__ int whole() const { return p.tiles - split_tiles(); }
  __device__ __forceinline__ int whole_count() const {
    return first() < whole() ? (whole() - 1 - first()) / stride() + 1 : 0;
  }
  // The CTA's share [s(), e()) of the split tiles' K steps, and its count of units there.
  __device__ __forceinline__ int s() const { return first() * p.split_steps; }
  __device__ __forceinline__ int e() const {
    return min(s() + p.split_steps, split_tiles() * k_steps);
  }
  __device__ __forceinline__ int split_count() const {
    return split_tiles() > 0 && s() < e() ? (e() - 1) / k_steps - s() / k_steps + 1 : 0;
  }
  __device__ __forceinline__ int count() const { return whole_count() + split_count(); }
  // Unit u: its unit index (tile_coords) and K steps [kb, ke).
  __device__ __forceinline__ int at(int u, int& kb, int& ke) const {
    if (!kSplit || u < whole_count()) {
      kb = 0;
      ke = k_steps;
      return first() + u * stride();
    }
    const int tile = (e() - 1) / k_steps - (u - whole_count());
    kb = max(s() - tile * k_steps, 0);
    ke = min(e() - tile * k_steps, k_steps);
    return whole() + tile;
  }
  // The CTA holding split unit `unit`'s first K step.
  __device__ __forceinline__ int first_cta(int unit) const {
    return (unit - whole()) * k_steps / p.split_steps;
  }
  // The ring's sequence number of unit u's first K step (the K steps of units 0 .. u - 1).
  __device__ __forceinline__ int seq0(int u) const {
    const int v = kSplit ? u - whole_count() : 0;
    if (v <= 0) return u * k_steps;
    return whole_count() * k_steps + e() -
           max(s(), min(e(), ((e() - 1) / k_steps - v + 1) * k_steps));
  }
  // K steps of all units.
  __device__ __forceinline__ int steps() const {
    return whole_count() * k_steps + (split_count() > 0 ? e() - s() : 0);
  }
};

// A consumer warp's release of a slot (lane 0): in pairs on both CTAs' barriers, as the other
// CTA's copies fill this CTA's slot too.
template <typename S>
__device__ __forceinline__ void release_slot(uint64_t* bar) {
  mbar_arrive(bar);
  if constexpr (S::kCtas == 2) hopper::mbar_arrive_cluster(bar, (blockIdx.x & 1) ^ 1);
}

// The x row of a token tile's first token.
__device__ __forceinline__ int tile_x_row(const FitGemmParams& p, int nt, int bn) {
  const int g = nt / p.group_tiles;
  return p.first + g * p.step + (nt - g * p.group_tiles) * bn;
}

// Byte offset of the 16-byte granule `granule` of token row `row` in a staging buffer: rows of
// kCols elements, granules XOR-swizzled by the row so that neither stmatrix's 8-row blocks nor
// the row reads meet bank conflicts.
template <int kCols>
__device__ __forceinline__ uint32_t stage_offset(int row, int granule) {
  return static_cast<uint32_t>(row * kCols * 2 + ((granule ^ (row & 7)) << 4));
}

// The owner of row j of a replicated call (j / seg_rows: the float estimate is off by at most one).
__device__ __forceinline__ int owner_of(const FitGemmParams& p, int j) {
  int owner = __float2int_rz(static_cast<float>(j) * p.inv_seg_rows);
  owner -= owner * p.seg_rows > j;
  owner += (owner + 1) * p.seg_rows <= j;
  return owner;
}

// The bias of weight columns col and col + 1 (0 without a bias or past n_out, a multiple of 8).
template <typename T>
__device__ __forceinline__ float2 bias_pair(const FitGemmParams& p, int col) {
  if (p.bias == nullptr || col >= p.n_out) return make_float2(0.f, 0.f);
  const T* b = static_cast<const T*>(p.bias) + col;
  return make_float2(to_float(b[0]), to_float(b[1]));
}

// A consumer's accumulators into the owners' inboxes: kSubs x 64 weight rows (from col0) by the
// tile's BN tokens, or with kTokensM its 64 tokens (from row0 of the tile) by the tile's BN
// weight rows (from col0). Per pass of S::kEpiRows tokens by S::kEpiCols columns: bias and
// rounding into a staging buffer of token rows (stmatrix, transposed where the accumulator
// holds a token's values across lanes, as they are where it holds token rows), then each
// thread's 16 bytes of kEpiRows x kEpiCols / 1024 rows, all loaded before any is stored, each
// valid row into its owner's slot. Two buffers, so one barrier per pass: a buffer is rewritten
// two passes later, after every thread passed the barrier between (one buffer: a second
// barrier a pass, after its reads). `pass` counts the
// consumer's passes over all its tiles. (Measured on one H200: faster than handing the staged
// rows to the copy engine, per row or per 8-row box, whose many small copies cost 2-3x this
// pass's time.)
template <typename T, typename S>
__device__ __forceinline__ void epilogue(const FitGemmParams& p,
                                         float (&acc)[S::kSubs][S::kN / 2], int col0, int row0,
                                         int nt, uint8_t* stage, int consumer, int& pass) {
  using namespace hopper;
  constexpr int BN = S::kN, kSubs = S::kSubs, kCols = S::kEpiCols;
  constexpr int kGranules = kCols * 2 / 16;            // 16-byte granules of a staged row
  constexpr int kSweepRows = 128 / kGranules;          // rows the consumer's threads read at once
  constexpr int kSweeps = S::kEpiRows / kSweepRows;    // rows per thread per pass
  // Tokens (kTokensM: weight columns) a pass.
  constexpr int kPassCols = S::kTokensAsM ? kCols : S::kEpiRows;
  constexpr int kPasses = (BN + kPassCols - 1) / kPassCols;
  const int tid = threadIdx.x - 128 * (consumer + 1);
  const int warp = tid >> 5, lane = tid & 31;
  float bias[kSubs][2] = {};  // weights as M: each fragment row's (a weight column's) bias
  if constexpr (!S::kTokensAsM) {
#pragma unroll
    for (int sub = 0; sub < kSubs; ++sub)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = col0 + sub * 64 + 16 * warp + (lane >> 2) + 8 * h;
        if (p.bias != nullptr && col < p.n_out)
          bias[sub][h] = to_float(static_cast<const T*>(p.bias)[col]);
      }
  }
  const int g = nt / p.group_tiles;
  const int j0 = (nt - g * p.group_tiles) * S::kTileTokens;  // the tile's first row in its group
  const int valid = min(S::kTileTokens, p.group_rows - j0);  // rows of the tile that hold rows
  // This thread's granule and first row of a pass (kGranules: a power of two).
  const int vcol = tid & (kGranules - 1), vrow = static_cast<unsigned>(tid) / kGranules;
  const int64_t row_bytes = static_cast<int64_t>(p.n_out) * sizeof(T);
  const int64_t slot_row0 = static_cast<int64_t>(p.rank) * p.slot_rows + p.row0;
  const bool sp = p.groups > 1;
#pragma unroll
  for (int c = 0; c < kPasses; ++c, ++pass) {
    uint8_t* buf = stage + (S::kEpiBuffers == 2 ? (pass & 1) * S::kEpiBuffer : 0);
    if constexpr (S::kTokensAsM) {
      // Columns 64 c ..: lane 8 * i + r addresses row r of block i = (token rows +8 or not,
      // column group of the pair); element 4 j + 2 h + e holds row 8 h, column 8 j + e.
      const float* a = acc[0];
#pragma unroll
      for (int jj = 0; jj < kCols / 8; jj += 2) {
        const int j = c * (kCols / 8) + jj;
        const int blk = lane >> 3;
        const uint32_t addr = smem_addr(buf) + stage_offset<kCols>(
            16 * warp + 8 * (blk & 1) + (lane & 7), jj + (blk >> 1));
        const int col = col0 + 8 * j + 2 * (lane & 3);
        const float2 b0 = bias_pair<T>(p, col);
        if (j + 1 < BN / 8) {
          const float2 b1 = bias_pair<T>(p, col + 8);
          stmatrix_x4(addr, Pack<T>::from_float2(a[4 * j] + b0.x, a[4 * j + 1] + b0.y),
                      Pack<T>::from_float2(a[4 * j + 2] + b0.x, a[4 * j + 3] + b0.y),
                      Pack<T>::from_float2(a[4 * j + 4] + b1.x, a[4 * j + 5] + b1.y),
                      Pack<T>::from_float2(a[4 * j + 6] + b1.x, a[4 * j + 7] + b1.y));
        } else if (j < BN / 8) {
          stmatrix_x2(addr, Pack<T>::from_float2(a[4 * j] + b0.x, a[4 * j + 1] + b0.y),
                      Pack<T>::from_float2(a[4 * j + 2] + b0.x, a[4 * j + 3] + b0.y));
        }
      }
    } else {
      // Token rows through stmatrix (transposed 8 x 8 blocks): lane 8 * i + r addresses row r
      // of block i = (weight rows +8 or not, token group of the pair).
#pragma unroll
      for (int jj = 0; jj < S::kEpiRows / 8; jj += 2) {
        const int j = c * (S::kEpiRows / 8) + jj;
        const int blk = lane >> 3;
        const int n = 8 * (jj + (blk >> 1)) + (lane & 7);
#pragma unroll
        for (int sub = 0; sub < kSubs; ++sub) {
          const int granule = sub * 8 + 2 * warp + (blk & 1);
          const uint32_t addr = smem_addr(buf) + stage_offset<kCols>(n, granule);
          const float b0 = bias[sub][0], b1 = bias[sub][1];
          if (j + 1 < BN / 8) {
            stmatrix_x4_trans(
                addr, Pack<T>::from_float2(acc[sub][4 * j] + b0, acc[sub][4 * j + 1] + b0),
                Pack<T>::from_float2(acc[sub][4 * j + 2] + b1, acc[sub][4 * j + 3] + b1),
                Pack<T>::from_float2(acc[sub][4 * j + 4] + b0, acc[sub][4 * j + 5] + b0),
                Pack<T>::from_float2(acc[sub][4 * j + 6] + b1, acc[sub][4 * j + 7] + b1));
          } else if (j < BN / 8) {
            stmatrix_x2_trans(
                addr, Pack<T>::from_float2(acc[sub][4 * j] + b0, acc[sub][4 * j + 1] + b0),
                Pack<T>::from_float2(acc[sub][4 * j + 2] + b1, acc[sub][4 * j + 3] + b1));
          }
        }
      }
    }
    bar_sync(3 + consumer, 128);
    // The pass's first row within the tile and this thread's column; a granule past the tile's
    // columns (kTokensM's last pass) holds nothing of this tile.
    const int pass_row = S::kTokensAsM ? row0 : c * S::kEpiRows;
    const int tile_col = (S::kTokensAsM ? c * kCols : 0) + vcol * 8;
    const bool col_ok = tile_col < (S::kTokensAsM ? BN : kCols) && col0 + tile_col < p.n_out;
    const int64_t col_bytes = (static_cast<int64_t>(col0) + tile_col) * sizeof(T);
    Vec16 v[kSweeps];
#pragma unroll
    for (int q = 0; q < kSweeps; ++q)
      v[q] = *reinterpret_cast<const Vec16*>(buf +
                                             stage_offset<kCols>(vrow + kSweepRows * q, vcol));
    // One buffer: every thread's reads done before the next pass (or tile) rewrites it.
    if constexpr (S::kEpiBuffers == 1) bar_sync(3 + consumer, 128);
#pragma unroll
    for (int q = 0; q < kSweeps; ++q) {
      const int row = pass_row + vrow + kSweepRows * q;  // within the tile
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

constexpr int kSplitBar = 5;  // named barrier of both consumers (256 threads)
// A split tile's wait for another CTA's sums gives up (a trap: the launch fails loudly) after
// this long; that CTA runs its whole tiles and at most its share of split steps first.
constexpr uint64_t kSplitWaitNs = 5'000'000'000ull;

// Split K: CTA cta's sums slot as this consumer thread sees it, 16 bytes a thread of each
// of its kSubs x BN / 8 vectors (a warp's stores: 512 contiguous bytes).
template <typename S>
__device__ __forceinline__ float4* split_slot(const FitGemmParams& p, int cta, int consumer) {
  constexpr int kVecs = S::kSubs * S::kN / 8;
  return reinterpret_cast<float4*>(p.split_sums + static_cast<int64_t>(cta) * S::kTileM * S::kN) +
         (consumer * kVecs) * 128 + (threadIdx.x & 127);
}

// Split K, a CTA whose part of a split tile ends before the tile's last K step: its sums into
// its slot (L2), then its flag raised once both consumers' stores are done.
template <typename S>
__device__ __forceinline__ void split_store(const FitGemmParams& p,
                                            const float (&acc)[S::kSubs][S::kN / 2],
                                            int consumer) {
  float4* dst = split_slot<S>(p, blockIdx.x, consumer);
#pragma unroll
  for (int sub = 0; sub < S::kSubs; ++sub)
#pragma unroll
    for (int v = 0; v < S::kN / 8; ++v)
      __stcg(dst + (sub * (S::kN / 8) + v) * 128,
             make_float4(acc[sub][4 * v], acc[sub][4 * v + 1], acc[sub][4 * v + 2],
                         acc[sub][4 * v + 3]));
  hopper::bar_sync(kSplitBar, 256);
  if (threadIdx.x == 128) {
    __threadfence();
    st_release_sys(p.split_flags + blockIdx.x, 1u);
  }
}

// Split K, the CTA holding a split tile's last K step: the sums of CTAs from .. blockIdx.x - 1
// (the tile's other parts) added into acc, each once its flag is up (those CTAs took their part
// first), then the flags lowered for the next call.
template <typename S>
__device__ __forceinline__ void split_add(const FitGemmParams& p,
                                          float (&acc)[S::kSubs][S::kN / 2], int consumer,
                                          int from) {
  for (int cta = static_cast<int>(blockIdx.x) - 1; cta >= from; --cta) {
    if (threadIdx.x == 128 && ld_acquire_sys(p.split_flags + cta) == 0) {
      const uint64_t t0 = global_timer_ns();
      while (ld_acquire_sys(p.split_flags + cta) == 0) {
        __nanosleep(64);
        if (global_timer_ns() - t0 > kSplitWaitNs) __trap();
      }
    }
    hopper::bar_sync(kSplitBar, 256);
    const float4* src = split_slot<S>(p, cta, consumer);
#pragma unroll
    for (int sub = 0; sub < S::kSubs; ++sub)
#pragma unroll
      for (int v = 0; v < S::kN / 8; ++v) {
        const float4 q = __ldcg(src + (sub * (S::kN / 8) + v) * 128);
        acc[sub][4 * v] += q.x;
        acc[sub][4 * v + 1] += q.y;
        acc[sub][4 * v + 2] += q.z;
        acc[sub][4 * v + 3] += q.w;
      }
  }
  hopper::bar_sync(kSplitBar, 256);  // every thread's loads done before the flags are lowered
  if (threadIdx.x == 128)
    for (int cta = from; cta < static_cast<int>(blockIdx.x); ++cta) p.split_flags[cta] = 0;
}

// The scales of a main loop's K blocks: load(kt) issues a K block's loads (before the wait for
// its MMAs, so they run meanwhile), apply(...) adds the block's products into the sums, scaled.
// 16-bit and per-tensor operands take none.
struct NoScales {};

// Weights as M, in blocks: a consumer's weight rows lie in one weight block (`ws`: its K blocks'
// scales; null past the weight's rows); the tokens' scales come with the stage, by TMA (the
// tile's first token `lead` places in the stage's box).
template <typename S>
struct ColScales {
  const float* ws;
  const uint8_t* s_smem;
  int lead;

  __device__ __forceinline__ float load(int kt) const {
    return ws != nullptr ? __ldg(ws + kt) : 0.f;
  }
  __device__ __forceinline__ void apply(float (&acc)[S::kSubs][S::kN / 2],
                                        const float (&part)[S::kSubs][S::kN / 2], float sw,
                                        int slot) const {
    const int lane = threadIdx.x & 31;
    // Accumulator element 4 j + 2 h + c holds token 8 j + 2 (lane % 4) + c.
    const float* xs =
        reinterpret_cast<const float*>(s_smem + slot * S::kSStage) + lead + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < S::kN / 8; ++j) {
      const float s0 = xs[8 * j] * sw, s1 = xs[8 * j + 1] * sw;
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub) {
        acc[sub][4 * j] = fmaf(part[sub][4 * j], s0, acc[sub][4 * j]);
        acc[sub][4 * j + 1] = fmaf(part[sub][4 * j + 1], s1, acc[sub][4 * j + 1]);
        acc[sub][4 * j + 2] = fmaf(part[sub][4 * j + 2], s0, acc[sub][4 * j + 2]);
        acc[sub][4 * j + 3] = fmaf(part[sub][4 * j + 3], s1, acc[sub][4 * j + 3]);
      }
    }
  }
};

// Tokens as M, in blocks: a thread's accumulators hold two token rows (16 * warp + lane / 4 and
// + 8) by the tile's BN columns, whose first lies kR rows into its weight block, so columns
// 8 j .. 8 j + 7 lie in the tile's block (kR + 8 j) / 128 (of kSpan), known at compile time. A
// K block takes two x scales and kSpan weight scales a thread, loaded from global memory (L1:
// the four lanes of a row share one address, every weight tile re-reads a token's) while its
// MMAs run; a stage's TMA box of them (the weights-as-M form) would cost the producer a third
// copy and an aligned box, and each thread a shared-memory load all the same. Rows past the x
// scales' (past x's rows, whose operand rows TMA fills with zeros, never stored) and weight
// blocks past the weight's read the last ones: finite loads in bounds.
template <typename S, int kR>
struct RowScales {
  static constexpr int kSpan = (kR + S::kN + kBlockK - 1) / kBlockK;
  // The thread's first row and the tile's first weight block (p: the kernel's parameters, so
  // the scales' bases, strides and bounds take no registers).
  const FitGemmParams& p;
  int x_row, w_block;

  struct Block {
    float x[2], w[kSpan];
  };
  __device__ __forceinline__ RowScales(const FitGemmParams& params, int row, int w_row)
      : p(params), x_row(row), w_block(w_row / kBlockK) {}
  __device__ __forceinline__ Block load(int kt) const {
    Block s;
    // 32-bit offsets (the op checks the x scales' size): one wide address sum a load.
    const int x_off = kt * p.xs_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      s.x[h] = __ldg(p.scale_inv[0] + (x_off + min(x_row + 8 * h, p.xs_stride - 1)));
#pragma unroll
    for (int b = 0; b < kSpan; ++b)
      s.w[b] = __ldg(p.scale_inv[1] + (min(w_block + b, p.w_blocks - 1) * p.ws_stride + kt));
    return s;
  }
  __device__ __forceinline__ void apply(float (&acc)[1][S::kN / 2],
                                        const float (&part)[1][S::kN / 2], const Block& s,
                                        int) const {
    // Block by block, two products live at a time (registers). Element 4 j + 2 h + c: row 8 h,
    // column 8 j + 2 (lane % 4) + c.
#pragma unroll
    for (int b = 0; b < kSpan; ++b) {
      const float f[2] = {s.x[0] * s.w[b], s.x[1] * s.w[b]};
#pragma unroll
      for (int j = 0; j < S::kN / 8; ++j) {
        if ((kR + 8 * j) / kBlockK != b) continue;
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[0][4 * j + e] = fmaf(part[0][4 * j + e], f[e >> 1], acc[0][4 * j + e]);
      }
    }
  }
};

// The places a tile's first weight row may take in its weight block: multiples of
// gcd(BN, kBlockK), every tile's first row being a multiple of BN.
__host__ __device__ constexpr int block_step(int bn) {
  return (bn & -bn) < kBlockK ? (bn & -bn) : kBlockK;
}

// f(std::integral_constant<int, r>{}) for r, a tile's first weight row's place in its block.
template <int BN, typename F, int... I>
__device__ __forceinline__ void with_block_offset_impl(int r, F&& f,
                                                       std::integer_sequence<int, I...>) {
  constexpr int kStep = block_step(BN);
  ((r == I * kStep ? f(std::integral_constant<int, I * kStep>{}) : void()), ...);
}
template <int BN, typename F>
__device__ __forceinline__ void with_block_offset(int r, F&& f) {
  with_block_offset_impl<BN>(r, f, std::make_integer_sequence<int, kBlockK / block_step(BN)>{});
}

// The main loop of one tile per consumer: its K steps' MMAs into acc. 16-bit or e4m3 per
// tensor: one wgmma group in flight while the next is issued, each slot released once the MMAs
// that read it are done; the last group is left in flight, its slot returned (the caller waits
// for it: a ping-pong consumer first lets the other one start). kBlocks: each step's MMAs into
// `part`, waited for, then added into acc scaled (`scales`: ColScales or RowScales); every slot
// released here (returns -1). Cooperative blocks: `consumer` and the CTA's last stage sequence
// number `last_seq` order the two consumers' issue.
template <typename In, typename S, bool kCoop, typename Scales>
__device__ __forceinline__ int main_loop(float (&acc)[S::kSubs][S::kN / 2],
                                          float (&part)[S::kSubs][S::kN / 2],
                                          const uint8_t* a_smem, const uint8_t* b_smem,
                                          uint64_t* full, uint64_t* empty, int seq0, int k_steps,
                                          uint32_t a_part, const Scales& scales, int consumer,
                                          int last_seq) {
  using namespace hopper;
  using Op = Operand<In>;
  constexpr bool kBlocks = S::kBlockScales;
  constexpr int BN = S::kN;
  const int lane = threadIdx.x & 31;
  int prev = -1;
  if constexpr (kBlocks) {
#pragma unroll
    for (int sub = 0; sub < S::kSubs; ++sub)
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
      for (int sub = 0; sub < S::kSubs; ++sub) {
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
      const auto block_scales = scales.load(kt);  // loaded while the MMAs run
      wgmma_wait<0>();
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub) fence_regs(part[sub]);
      scales.apply(acc, part, block_scales, s);
      __syncwarp();  // every lane read the slot (its scales, where the stage holds them)
      if (lane == 0) mbar_arrive(&empty[s]);
    } else {
      wgmma_wait<1>();  // the previous step's MMAs are done: release its slot
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub) fence_regs(acc[sub]);
      if (prev >= 0 && lane == 0) release_slot<S>(&empty[prev]);
      prev = s;
    }
  }
  return prev;
}

template <typename T, typename In, int BN, bool kCoop, bool kBlocks, bool kTokensM, bool kPair>
__global__ void __launch_bounds__(kThreads, 1)
    fit_gemm_kernel(const __grid_constant__ CUtensorMap w_map,
                    const __grid_constant__ CUtensorMap x_map,
                    const __grid_constant__ CUtensorMap s_map, const FitGemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace hopper;
  using S = Shape<BN, kCoop, kBlocks, kTokensM, kPair>;
  using Op = Operand<In>;
  static_assert(!kBlocks || Op::kFp8, "block scales are e4m3 operands'");
  // Dynamic shared memory starts 1024-byte aligned (no static shared memory here): the
  // 128-byte swizzle of the stages needs it.
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* a_smem = smem;
  uint8_t* b_smem = a_smem + S::kStages * S::kAStage;
  uint8_t* s_smem = b_smem + S::kStages * S::kBStage;  // kScaleStage: the tokens' scales
  uint8_t* epi = s_smem + S::kStages * S::kSStage;
  uint64_t* full = reinterpret_cast<uint64_t*>(epi + S::kEpiBytes);
  uint64_t* empty = full + S::kStages;

  const int wg = threadIdx.x / 128;
  const int k_steps = (p.k + Op::kStageK - 1) / Op::kStageK;
  // Split K: the cooperative mode, 16-bit or per tensor, one CTA a unit (ops.cu checks).
  constexpr bool kSplit = kCoop && !kBlocks && !kPair;
  // This CTA's units of work: its cluster's, clusters of S::kCtas CTAs.
  const Work<S::kCtas, kSplit> work{p, k_steps};
  if (threadIdx.x == 0) {
    if (smem_addr(smem) & 1023) __trap();  // the swizzled stages would read the wrong bytes
    // Pairs: the copies and releases address the other CTA by blockIdx.x's parity (a launch
    // without clusters of two would reach a CTA that is not there).
    if constexpr (kPair)
      if (cluster_ctas() != S::kCtas) __trap();
    for (int s = 0; s < S::kStages; ++s) {
      mbar_init(&full[s], 1);
      // Lane 0 of each warp that reads the slot, in pairs in both CTAs.
      mbar_init(&empty[s], (kCoop ? 8 : 4) * S::kCtas);
    }
    fence_mbar_init();
  }
  // Pairs: the other CTA's barriers are initialized before this CTA's copies or releases reach
  // them.
  if constexpr (kPair)
    cluster_sync();
  else
    __syncthreads();

  if (wg == 0) {
    regs_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      prefetch_map(&w_map);
      prefetch_map(&x_map);
      if constexpr (S::kScaleStage) prefetch_map(&s_map);
      for (int u = 0, seq = 0; u < work.count(); ++u) {
        int kb, ke, mt, nt;
        tile_coords<S::kCtas>(p, work.at(u, kb, ke), mt, nt);
        const int x_row = tile_x_row(p, nt, S::kTileTokens);
        const int w_row = mt * S::kTileWeights;
        // A (the MMA's M operand) and B: the weight's rows and the tokens, or the other way.
        const CUtensorMap* a_map = kTokensM ? &x_map : &w_map;
        const CUtensorMap* b_map = kTokensM ? &w_map : &x_map;
        const int a_row = kTokensM ? x_row : w_row, b_row = kTokensM ? w_row : x_row;
        for (int kt = kb; kt < ke; ++kt, ++seq) {
          const int s = seq % S::kStages, fill = seq / S::kStages;
          if (fill > 0) mbar_wait(&empty[s], (fill - 1) & 1);
          mbar_arrive_expect_tx(&full[s], S::kAStage + S::kBStage +
                                              (S::kScaleStage ? S::kScaleBox * 4 : 0));
          if constexpr (kPair)  // this CTA's half of the weight rows, into both CTAs
            tma_load_2d_multicast(a_smem + s * S::kAStage + (blockIdx.x & 1) * (S::kAStage / 2),
                                  a_map, kt * Op::kStageK,
                                  a_row + (blockIdx.x & 1) * (S::kTileM / 2), &full[s], 0x3);
          else
            tma_load_2d(a_smem + s * S::kAStage, a_map, kt * Op::kStageK, a_row, &full[s]);
          tma_load_2d(b_smem + s * S::kBStage, b_map, kt * Op::kStageK, b_row, &full[s]);
          if constexpr (S::kScaleStage)
            tma_load_2d(s_smem + s * S::kSStage, &s_map, x_row & -kScaleLead, kt, &full[s]);
        }
      }
      if constexpr (kPair) {
        // Every slot's last fill released by both CTAs' consumers before this CTA exits: the
        // other CTA's consumers arrive on these barriers.
        const int total = work.steps();
        for (int seq = total; seq < total + S::kStages; ++seq)
          if (seq >= S::kStages) mbar_wait(&empty[seq % S::kStages], (seq / S::kStages - 1) & 1);
      }
    }
    return;
  }
  regs_inc<kConsumerRegs>();
  const int consumer = wg - 1;
  uint8_t* stage = epi + consumer * S::kEpiBuffers * S::kEpiBuffer;
  const int a_rows = kCoop ? consumer * S::kBM : 0;  // this consumer's rows of A in the tile
  int pass = 0;
  // e4m3 per tensor: the product of the two dequantization scales, applied to each finished
  // tile.
  const float scale = Op::kFp8 && !kBlocks ? p.scale_inv[0][0] * p.scale_inv[1][0] : 1.f;
  float acc[S::kSubs][BN / 2];
  float part[S::kSubs][BN / 2];  // kBlocks: one K block's products
  for (int i = kCoop ? 0 : consumer; i < work.count(); i += kCoop ? 1 : 2) {
    // Ping-pong: the other consumer waited for all of tile i - 1's slots.
    if (!kCoop && i > 0) bar_sync(1 + consumer, 256);
    int prev = -1;
    {
      // The unit and its tile's coordinates here and again after the main loop: not held
      // through it (registers).
      int kb, ke, mt, nt;
      tile_coords<S::kCtas>(p, work.at(i, kb, ke), mt, nt);
      const auto run = [&](const auto& scales) {
        return main_loop<In, S, kCoop>(acc, part, a_smem, b_smem, full, empty, work.seq0(i),
                                       ke - kb, a_rows * kRowBytes, scales, consumer,
                                       work.steps() - 1);
      };
      const int x_row = tile_x_row(p, nt, S::kTileTokens);
      if constexpr (kTokensM) {
        const int w_row = mt * BN;
        const int row =
            x_row + a_rows + 16 * ((threadIdx.x >> 5) & 3) + ((threadIdx.x & 31) >> 2);
        with_block_offset<BN>(w_row % kBlockK, [&](auto r) {
          run(RowScales<S, decltype(r)::value>(p, row, w_row));
        });
      } else if constexpr (kBlocks) {
        const int block = (mt * S::kTileM + a_rows) / kBlockK;
        run(ColScales<S>{
            block < p.w_blocks ? p.scale_inv[1] + static_cast<int64_t>(block) * p.ws_stride
                               : nullptr,
            s_smem, x_row & (kScaleLead - 1)});
      } else {
        prev = run(NoScales{});
      }
    }
    if (!kCoop && i + 1 < work.count()) bar_arrive(1 + (1 - consumer), 256);
    if constexpr (!kBlocks) {
      wgmma_wait<0>();
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub) fence_regs(acc[sub]);
      if ((threadIdx.x & 31) == 0) release_slot<S>(&empty[prev]);
    }
    int kb, ke;
    const int unit = work.at(i, kb, ke);
    if constexpr (kSplit) {
      if (ke < k_steps) {  // a part before the tile's last K step
        split_store<S>(p, acc, consumer);
        continue;
      }
      if (kb > 0) split_add<S>(p, acc, consumer, work.first_cta(unit));
    }
    if constexpr (Op::kFp8 && !kBlocks) {
#pragma unroll
      for (int sub = 0; sub < S::kSubs; ++sub)
#pragma unroll
        for (int e = 0; e < BN / 2; ++e) acc[sub][e] *= scale;
    }
    int mt, nt;
    // The consumer's first weight column and first token in the tile (a pair's tile that is
    // none: nothing stored).
    if (tile_coords<S::kCtas>(p, unit, mt, nt))
      epilogue<T, S>(p, acc, mt * S::kTileWeights + (kTokensM ? 0 : a_rows),
                     kTokensM ? a_rows : 0, nt, stage, consumer, pass);
  }
#else
  __trap();  // sm_90a only: the launcher refuses other devices
#endif
}

}  // namespace fit
}  // namespace tokenweave
