// torch.library bindings of the fused all-reduce + residual add + RMSNorm kernels.
//
// A Communicator (one per TP group, dtype, hidden size and device: megatron_tokenweave.
// communicator) owns everything that describes the symmetric buffer and the data-path settings
// every rank agreed on when it was created; Python holds it as an integer handle (comm_create /
// comm_destroy). The ops take that handle, the tensors and a few scalars:
//   fused_allreduce_rmsnorm(comm, partial!, residual, weight?, eps, residual_out!, normed_out?!,
//                           ctas, path, tag, normed_scales!, scaling)
//   gemm_reduce_rmsnorm(comm, partial!, residual, weight?, eps, residual_out!, normed_out?!,
//                       call, normed_scales!, scaling)
//   fit_gemm(x, weight, bias?, regions, geometry, ctas, scales, out_dtype?, split!): the
//       GEMM-fused mechanism's row-parallel GEMM with tiles fitted to the call (fit_gemm.cuh),
//       storing into the inboxes at `regions` (bf16/fp16 operands, or e4m3 ones with their two
//       per-tensor scales and the rows' dtype; split K's flags and sums where it splits); it
//       takes no communicator (a benchmark's loopback inbox has none).
// `tag` is the call's tag (signal.cuh: every rank passes the same for the same call; a peer on
// another call is an error, never a combination of two calls' rows); `call` the GEMM-fused
// consumer's call as one list: its geometry (SegmentGeometry), its CTA count and its tag
// (consumer_call_of); `normed_scales` / `scaling` describe FP8 normed rows (fp8_rows_of; both
// empty for rows in the activations' dtype). partial is mutated too: the two-shot and GEMM-fused
// replicated paths write y back into it.
// Nothing here reads the environment: a setting that changes the protocol must be the same on
// every rank, so it is agreed once, in Python, and stored in the Communicator.
// Schemas (vLLM style: mutated arguments annotated Tensor(a!)) are defined here; fake
// implementations live in Python (megatron_tokenweave/kernels/_ext.py). The Python side validates
// first and raises TokenWeaveInputError; the TW_CHECKs below (check.h) are the last line of
// defence.
// No host sync, no allocation: the op only enqueues kernels (the copy-engine op: barrier kernels,
// copies and one kernel) on the current stream (CUDA-graph capturable).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "launch.cuh"
#include "tokenweave/copy_engine.cuh"
#include "tokenweave/fit_gemm_host.cuh"
#include "tokenweave/signal.cuh"
#include "tokenweave/twoshot.cuh"

namespace tokenweave {

// Data paths of one call (the op's `path` argument; the Python names are in
// megatron_tokenweave/kernels/comm.py): the SM-driven kernels (one-shot, two-shot, bulk copies or
// registers, chosen below by layout, size and TP and the communicator's settings; multimem
// instead where the communicator has a multicast address), or the copy-engine op, whole or one
// of its two phases (copy_engine.cuh: the transfer, then the local reduction).
enum Path : int64_t {
  kPathSm = 0,
  kPathCopyEngine = 1,
  kPathCopyEngineTransfer = 2,
  kPathCopyEngineReduce = 3,
};

// What every rank of a TP group agreed on for one symmetric buffer. Owned by Python through an
// integer handle (vLLM keeps its custom all-reduce the same way); the tensors it holds stay alive
// as long as it does.
struct Communicator {
  static constexpr uint64_t kMagic = 0x74776561766563ull;  // "tweavec": a handle, not garbage
  uint64_t magic = kMagic;
  at::Tensor bases;       // device int64 [2 * world]: data-region bases, then signal-pad bases
  int64_t rank = 0, world = 0, local_base = 0, buffer_bytes = 0, timeout_ns = 0;
  int device = 0;
  int arch = 0;                   // the device's compute capability, 90 = sm_90
  bool bulk = true;               // the bulk-copy pipeline where its stages fit (sm_90 only)
  bool oneshot = true;            // the one-shot path for small replicated calls
  bool twoshot = true;            // the two-shot path for larger replicated calls at TP >= 4
  bool local_stores_only = false; // benchmark diagnostic (wrong results): no remote normed stores
  bool check_calls = true;        // the call tags are checked (off: a benchmark diagnostic)
  int64_t multicast_base = 0;     // multimem data path (never set on this project's machines)
  // Copy-engine path (comm_attach_mirror): the kernel's sources, the mirror, its layout.
  at::Tensor sources, mirror;
  std::vector<int64_t> peer_data, mirrors;
  int64_t mirror_bytes = 0;
  // GEMM-fused path (comm_attach_inbox): this rank's inbox (megatron_tokenweave/kernels/inbox.py
  // lays it out): slots of `slot_rows` rows of `row_bytes` at `inbox_data`, flags of set s at
  // `inbox_flags + s * flag_set_words` ([world][blocks][tiles] words), then epoch[2], done[2]
  // and tag[2][kMaxRanks] words at `inbox_control`; `inbox_regions` every rank's inbox (its
  // flags first, its control words as far after them as here).
  int64_t inbox_data = 0, slot_rows = 0, row_bytes = 0, inbox_flags = 0, flag_set_words = 0;
  int64_t inbox_control = 0, flag_blocks = 0, flag_tiles = 0;
  std::vector<int64_t> inbox_regions;
};

// Words before the tags in an inbox's control words: epoch[2], done[2] (kernels/inbox.py).
constexpr int64_t kInboxTagWords = 4;

// Bits of comm_create's `flags`.
enum Flags : int64_t {
  kFlagBulk = 1,
  kFlagOneShot = 2,
  kFlagLocalStoresOnly = 4,
  kFlagTwoShot = 8,
  kFlagCheckCalls = 16,
};

namespace {

Communicator& comm_of(int64_t handle) {
  auto* c = reinterpret_cast<Communicator*>(handle);
  TW_CHECK(c != nullptr && c->magic == Communicator::kMagic,
           "tokenweave: not a live communicator handle (destroyed, or never created)");
  return *c;
}

// The kernels move 16-byte vectors (and bulk copies of whole rows) from and to every tensor.
void check_aligned(const at::Tensor& t, const char* name) {
  TW_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % kVecBytes == 0, "tokenweave: ", name,
           " is not 16-byte aligned");
}

void check_in_buffer(const at::Tensor& t, const char* name, const Communicator& c,
                     int64_t extent_bytes) {
  const int64_t off = reinterpret_cast<int64_t>(t.data_ptr()) - c.local_base;
  TW_CHECK(off >= 0 && off + extent_bytes <= c.buffer_bytes, "tokenweave: ", name,
           " is not inside the symmetric buffer (offset ", off, ", extent ", extent_bytes,
           ", buffer ", c.buffer_bytes, " bytes)");
  TW_CHECK(off % kVecBytes == 0, "tokenweave: ", name, " is not 16-byte aligned");
}

// The layout follows from partial's chunks: `world` (sequence parallel: chunk r is reduced onto
// rank r) or 1 (replicated).
// FP8 normed rows (normed_out of dtype float8_e4m3fn, replicated layout): `scaling` [1] with
// `scales` [scale, amax, scale_inv] (one known scale), or [2, amax_eps, pow2] with `scales`
// [scale_inv of [hidden / 128, round_up(rows, 4)]] (1 x 128 blocks); fp32 tensors on the device.
Fp8Rows fp8_rows_of(const at::Tensor& partial, int64_t rows, int64_t hidden,
                    at::TensorList scales, at::ArrayRef<double> scaling) {
  Fp8Rows f{};
  TW_CHECK(!scaling.empty() && (scaling[0] == kFp8TensorScale || scaling[0] == kFp8Blocks),
           "tokenweave: FP8 normed rows need their scaling: [1] (one known scale) or "
           "[2, amax_eps, pow2] (1 x 128 blocks)");
  f.mode = static_cast<int>(scaling[0]);
  const size_t want = f.mode == kFp8TensorScale ? 3 : 1;
  TW_CHECK(scales.size() == want && scaling.size() == (f.mode == kFp8TensorScale ? 1u : 3u),
           "tokenweave: FP8 scaling mode ", f.mode, " takes ", want, " scale tensors");
  for (const at::Tensor& t : scales)
    TW_CHECK(t.device() == partial.device() && t.scalar_type() == at::kFloat &&
                 t.is_contiguous(),
             "tokenweave: FP8 scales must be contiguous fp32 tensors on partial's device");
  if (f.mode == kFp8TensorScale) {
    for (const at::Tensor& t : scales)
      TW_CHECK(t.numel() == 1, "tokenweave: a tensor scale, its amax and its scale_inv are "
               "one element each");
    f.scale = scales[0].data_ptr<float>();
    f.amax = scales[1].data_ptr<float>();
    f.scale_inv = scales[2].data_ptr<float>();
    return f;
  }
  const int64_t stride = (rows + 3) / 4 * 4;
  TW_CHECK(hidden % kFp8BlockCols == 0, "tokenweave: 1 x 128 block scales need hidden a "
           "multiple of 128, got ", hidden);
  TW_CHECK(scales[0].dim() == 2 && scales[0].size(0) == hidden / kFp8BlockCols &&
               scales[0].size(1) == stride,
           "tokenweave: block scale_inv must be [hidden / 128, round_up(rows, 4)] = [",
           hidden / kFp8BlockCols, ", ", stride, "]");
  f.scale_inv = scales[0].data_ptr<float>();
  f.stride = static_cast<int>(stride);
  f.amax_eps = static_cast<float>(scaling[1]);
  f.pow2 = scaling[2] != 0 ? 1 : 0;
  f.inf_scale = partial.scalar_type() == at::kBFloat16 ? 3.38953139e38f : 65504.f;
  return f;
}

FusedParams make_params(const Communicator& c, const at::Tensor& partial,
                        const at::Tensor& residual, const std::optional<at::Tensor>& weight,
                        double eps, at::Tensor& residual_out,
                        const std::optional<at::Tensor>& normed_out, int64_t ctas, int64_t tag,
                        at::TensorList scales = {}, at::ArrayRef<double> scaling = {}) {
  TW_CHECK(tag > 0 && tag <= 0xFFFFFFFFll, "tokenweave: the call tag must be in 1..2^32-1, "
           "got ", tag);
  TW_CHECK(partial.is_cuda() && partial.dim() == 3 && partial.is_contiguous(),
           "tokenweave: partial must be a contiguous [chunks, rows, hidden] CUDA tensor");
  TW_CHECK(partial.get_device() == c.device, "tokenweave: partial is on cuda:",
           partial.get_device(), ", the communicator on cuda:", c.device);
  const auto dt = partial.scalar_type();
  TW_CHECK(dt == at::kBFloat16 || dt == at::kHalf, "tokenweave: dtype must be bf16 or fp16");
  TW_CHECK(ctas >= 1 && ctas <= kMaxCtas, "tokenweave: ctas ", ctas, " out of range 1..",
           kMaxCtas);
  const int64_t chunks = partial.size(0), rows = partial.size(1), hidden = partial.size(2);
  TW_CHECK(chunks == c.world || chunks == 1, "tokenweave: partial has ", chunks,
           " chunks: ", c.world, " (sequence parallel) or 1 (replicated)");
  const bool sequence_parallel = chunks == c.world;
  TW_CHECK(hidden % kVecElems == 0, "tokenweave: hidden must be a multiple of 8");
  TW_CHECK(rows < (int64_t{1} << 31) / 4, "tokenweave: too many rows");
  const int64_t es = partial.element_size();
  for (const at::Tensor* t : {&residual, static_cast<const at::Tensor*>(&residual_out)}) {
    TW_CHECK(t->device() == partial.device() && t->scalar_type() == dt &&
                 t->is_contiguous() && t->numel() == rows * hidden,
             "tokenweave: residual/residual_out must be contiguous [rows, hidden] of partial's "
             "dtype on its device");
    check_aligned(*t, "residual/residual_out");
  }
  check_in_buffer(partial, "partial", c, chunks * rows * hidden * es);

  FusedParams p{};
  p.bases = c.bases.data_ptr<int64_t>();
  p.partial_off = reinterpret_cast<int64_t>(partial.data_ptr()) - c.local_base;
  p.partial_cstride = rows * hidden * es;
  p.residual = residual.data_ptr();
  p.residual_out = residual_out.data_ptr();
  p.rows = static_cast<int>(rows);
  p.hidden = static_cast<int>(hidden);
  p.rank = static_cast<int>(c.rank);
  p.world = static_cast<int>(c.world);
  p.sequence_parallel = sequence_parallel ? 1 : 0;
  p.eps = static_cast<float>(eps);
  p.timeout_ns = static_cast<uint64_t>(c.timeout_ns);
  p.local_stores_only = c.local_stores_only ? 1 : 0;
  p.tag = c.check_calls ? static_cast<uint32_t>(tag) : 0u;
  if (weight.has_value()) {
    TW_CHECK(normed_out.has_value(), "tokenweave: normed_out required with a weight");
    const at::Tensor& w = *weight;
    const at::Tensor& no = *normed_out;
    TW_CHECK(w.device() == partial.device() && w.scalar_type() == dt && w.is_contiguous() &&
                 w.numel() == hidden,
             "tokenweave: weight must be a contiguous [hidden] tensor of partial's dtype on "
             "its device");
    check_aligned(w, "weight");
    check_aligned(no, "normed_out");
    const bool fp8 = no.scalar_type() == at::kFloat8_e4m3fn;
    TW_CHECK(fp8 || (scales.empty() && scaling.empty()),
             "tokenweave: FP8 scales given for normed rows of ", no.scalar_type());
    if (fp8) {
      TW_CHECK(!sequence_parallel && c.multicast_base == 0,
               "tokenweave: FP8 normed rows take the replicated layout (not sequence "
               "parallel, not multimem)");
      TW_CHECK(c.arch >= kFp8MinArch, "tokenweave: FP8 normed rows need sm_", kFp8MinArch,
               " or newer (e4m3 conversion instructions); this GPU is sm_", c.arch);
      p.fp8 = fp8_rows_of(partial, rows, hidden, scales, scaling);
    }
    TW_CHECK(no.device() == partial.device() && (fp8 || no.scalar_type() == dt) &&
                 no.dim() == 3 &&
                 no.size(0) == chunks && no.size(1) == rows && no.size(2) == hidden &&
                 no.stride(2) == 1 && (rows <= 1 || no.stride(1) == hidden),
             "tokenweave: normed_out must be [chunks, rows, hidden] of partial's dtype (or "
             "float8_e4m3fn) with dense rows");
    p.weight = w.data_ptr();
    if (sequence_parallel) {
      TW_CHECK(chunks == 1 || no.stride(0) >= 0, "tokenweave: negative normed_out stride");
      const int64_t extent = ((chunks - 1) * no.stride(0) + rows * hidden) * es;
      check_in_buffer(no, "normed_out", c, extent);
      TW_CHECK((no.stride(0) * es) % kVecBytes == 0,
               "tokenweave: normed_out chunk stride must be a multiple of 16 bytes");
      p.normed_off = reinterpret_cast<int64_t>(no.data_ptr()) - c.local_base;
      p.normed_cstride = no.stride(0) * es;
    } else {
      p.normed_local = no.data_ptr();
    }
  } else {
    TW_CHECK(!normed_out.has_value(), "tokenweave: normed_out given without a weight");
  }
  return p;
}

// Stages of the bulk-copy pipeline for this shape, or 0 to use the register path: the
// communicator has the pipeline off (a setting, or a GPU before sm_90), or fewer than 2 stages of
// `world` + 1 rows fit in kStageSmemBytes.
int bulk_stages(const Communicator& c, int64_t hidden, int64_t elem_bytes) {
  if (!c.bulk) return 0;
  const int64_t stage = (c.world + 1) * hidden * elem_bytes;
  const int64_t n = kStageSmemBytes / stage;
  return n < 2 ? 0 : static_cast<int>(n < kMaxStages ? n : kMaxStages);
}

// Calls f(T) with T the CUDA type of `dt` (bf16 or fp16; make_params checked it).
template <typename F>
void with_dtype(at::ScalarType dt, F&& f) {
  if (dt == at::kBFloat16)
    f(__nv_bfloat16{});
  else
    f(__half{});
}

// f(T{}, stream) on the current stream of partial's device, T the CUDA type of its dtype; nothing
// for a call without rows (every rank skips it alike: the rows are the same everywhere).
template <typename F>
void on_stream(const at::Tensor& partial, const FusedParams& p, F&& f) {
  if (p.rows == 0) return;
  c10::cuda::CUDAGuard guard(partial.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(partial.get_device()).stream();
  with_dtype(partial.scalar_type(), [&](auto t) { f(t, stream); });
}

// The one-shot path takes replicated-layout calls whose P rows per row fit one receive buffer,
// where the communicator allows it.
bool use_oneshot(const Communicator& c, const FusedParams& p, int64_t elem_bytes) {
  return c.oneshot && !p.sequence_parallel &&
         p.world * static_cast<int64_t>(p.rows) * p.hidden * elem_bytes <= kOneShotRoundBytes;
}

// The two-shot path takes the other replicated-layout calls from kTwoShotMinWorld ranks on, where
// the communicator allows it (else every rank pulls every row: the barrier path).
bool use_twoshot(const Communicator& c, const FusedParams& p) {
  return c.twoshot && !p.sequence_parallel && p.world >= kTwoShotMinWorld;
}

template <typename T>
void launch_sm(const Communicator& c, const FusedParams& p, int64_t ctas, cudaStream_t stream) {
  if (c.multicast_base != 0)
    launch_multimem<T>(p, ctas, reinterpret_cast<char*>(c.multicast_base), stream);
  else if (use_oneshot(c, p, sizeof(T)))
    launch_oneshot<T>(p, ctas, stream);
  else if (use_twoshot(c, p))
    launch_twoshot<T>(p, ctas, stream);
  else
    launch_barrier_path<T>(p, ctas, bulk_stages(c, p.hidden, sizeof(T)), stream);
}

// One GEMM-fused call's geometry (ops/segments.py Segments.geometry): inbox set `set`, its rows
// from inbox row `row0`, segments of `seg_rows` rows, the GEMM's `block_rows` x `col_tiles`
// flags; `publish`: the consumer releases the GEMM's tiles (one flag per source and owner).
struct SegmentGeometry {
  int64_t set, row0, seg_rows, block_rows, col_tiles;
  bool publish;
};

// The consumer's call list: its geometry, then its CTA count (the protocol's G: every rank's
// CTA b takes the same rows) and its tag.
constexpr size_t kConsumerCallWords = 8;

// The geometry from the op's call list, checked against the call and the inbox (the one place).
SegmentGeometry geometry_of(const Communicator& c, const FusedParams& p, int64_t elem_bytes,
                            at::IntArrayRef list) {
  const SegmentGeometry g{list[0], list[1], list[2], list[3], list[4], list[5] != 0};
  TW_CHECK(c.inbox_data != 0, "tokenweave: the GEMM-fused path needs the communicator's "
           "inbox (comm_attach_inbox)");
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * elem_bytes;
  TW_CHECK(row_bytes == c.row_bytes, "tokenweave: rows of ", row_bytes, " bytes, the inbox "
           "holds rows of ", c.row_bytes, " (another hidden size or dtype)");
  TW_CHECK(g.set == 0 || g.set == 1, "tokenweave: inbox set must be 0 or 1, got ", g.set);
  TW_CHECK(list[5] == 0 || list[5] == 1, "tokenweave: publish must be 0 or 1");
  TW_CHECK(g.block_rows >= 1 && g.col_tiles >= 1 && g.col_tiles <= c.flag_tiles,
           "tokenweave: block_rows must be positive and col_tiles in 1..", c.flag_tiles);
  TW_CHECK(g.seg_rows >= 1 && g.row0 >= 0 && g.row0 + g.seg_rows <= c.slot_rows,
           "tokenweave: inbox rows [", g.row0, ", ", g.row0 + g.seg_rows, ") outside the ",
              c.slot_rows, " rows of a slot");
  TW_CHECK((g.seg_rows + g.block_rows - 1) / g.block_rows <= c.flag_blocks,
           "tokenweave: ", g.seg_rows, " rows of ", g.block_rows, "-row blocks need more than "
           "the ", c.flag_blocks, " flag blocks of the inbox");
  if (p.sequence_parallel) {
    TW_CHECK(g.seg_rows == p.rows, "tokenweave: sequence parallel: seg_rows (", g.seg_rows,
             ") must equal the rows of a chunk (", p.rows, ")");
  } else {
    TW_CHECK(g.seg_rows * c.world >= p.rows && g.seg_rows % g.block_rows == 0,
             "tokenweave: replicated: ", c.world, " segments of seg_rows (", g.seg_rows,
             ") must cover the ", p.rows, " rows and be whole blocks of ", g.block_rows);
  }
  return g;
}

// The GEMM-fused path's consumer (gemm_reduce.cuh) of the call of geometry `s`.
template <typename T>
void launch_gemm_reduce(const Communicator& c, const FusedParams& p, int64_t ctas,
                        const SegmentGeometry& s, cudaStream_t stream) {
  const int64_t row_bytes = static_cast<int64_t>(p.hidden) * sizeof(T);
  InboxParams g{};
  g.data = reinterpret_cast<const char*>(c.inbox_data);
  g.slot_bytes = c.slot_rows * row_bytes;
  g.row0 = static_cast<int>(s.row0);
  g.seg_rows = static_cast<int>(s.seg_rows);
  const int64_t mine = p.sequence_parallel ? p.rows : p.rows - c.rank * s.seg_rows;
  g.my_rows = static_cast<int>(mine < 0 ? 0 : (mine < s.seg_rows ? mine : s.seg_rows));
  g.block_rows = static_cast<int>(s.block_rows);
  g.col_tiles = static_cast<int>(s.col_tiles);
  g.flags = reinterpret_cast<const uint32_t*>(c.inbox_flags) + s.set * c.flag_set_words;
  g.src_stride = c.flag_blocks * c.flag_tiles;
  g.tiles_stride = static_cast<int>(c.flag_tiles);
  auto* control = reinterpret_cast<uint32_t*>(c.inbox_control);
  g.epoch = control + s.set;
  g.done = control + 2 + s.set;
  g.tags = control + kInboxTagWords + s.set * kMaxRanks;
  if (s.publish) {
    g.block_rows = g.seg_rows;  // one block of one tile: flag[set][src][0][0]
    g.col_tiles = 1;
    const int64_t control_off = c.inbox_control - c.inbox_flags;  // the same in every region
    for (int64_t q = 0; q < c.world; ++q) {
      g.publish[q] = reinterpret_cast<uint32_t*>(c.inbox_regions[q]) + s.set * c.flag_set_words +
                     c.rank * g.src_stride;
      g.publish_tag[q] = reinterpret_cast<uint32_t*>(c.inbox_regions[q] + control_off) +
                         kInboxTagWords + s.set * kMaxRanks + c.rank;
    }
  }
  launch_gemm_reduce_kernel<T>(p, g, s.seg_rows, ctas, stream);
}

// The copy-engine data path (copy_engine.cuh): `c.sources` are the fused kernel's bases on this
// path (data: the mirror of q, or this rank's data base at q = rank; then the signal pads);
// `c.peer_data` every rank's data base; `c.mirrors` this rank's mirror of each rank.
template <typename T>
void launch_copy_engine(const Communicator& c, const FusedParams& p, int64_t ctas, int64_t path,
                        cudaStream_t stream) {
  const int64_t phase = path == kPathCopyEngineTransfer ? kCeTransfer
                        : path == kPathCopyEngineReduce ? kCeReduce
                                                        : kCeWhole;
  const bool gather_normed = p.sequence_parallel && p.weight != nullptr;
  TW_CHECK(c.mirror_bytes > 0, "tokenweave: the copy-engine path needs the communicator's "
           "mirror (comm_attach_mirror)");
  TW_CHECK(phase == kCeWhole || !gather_normed,
           "tokenweave: the copy-engine op runs in two phases only when it gathers no normed "
           "rows (replicated layout, or no norm)");
  const int64_t bytes = static_cast<int64_t>(p.rows) * p.hidden * sizeof(T);  // one chunk's rows
  const int64_t src_off = p.partial_off + (p.sequence_parallel ? p.rank : 0) * p.partial_cstride;
  TW_CHECK(src_off + bytes <= c.mirror_bytes, "tokenweave: partial rows end at byte ",
           src_off + bytes, " of the data region, past the mirrored ", c.mirror_bytes);
  auto copy = [&](int64_t dst, int64_t src) {
    const cudaError_t err =
        cudaMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                        static_cast<size_t>(bytes), cudaMemcpyDefault, stream);
    TW_CHECK(err == cudaSuccess, "tokenweave: cudaMemcpyAsync failed: ",
             cudaGetErrorString(err));
  };
  // Barriers after which nothing else of this call writes outputs poison them on failure.
  auto barrier = [&](int which, bool poison) {
    const int flag = poison ? 1 : 0;
    if (which == kCeStart)
      copy_engine_barrier_kernel<kCeStart><<<1, 32, 0, stream>>>(p, nan_pair<T>(), flag);
    else if (which == kCeMid)
      copy_engine_barrier_kernel<kCeMid><<<1, 32, 0, stream>>>(p, nan_pair<T>(), flag);
    else
      copy_engine_barrier_kernel<kCeEnd><<<1, 32, 0, stream>>>(p, nan_pair<T>(), flag);
    check_launch();
  };

  if (phase != kCeReduce) {
    barrier(kCeStart, false);
    for (int64_t q = 0; q < c.world; ++q)
      if (q != c.rank) copy(c.mirrors[q] + src_off, c.peer_data[q] + src_off);
    if (phase == kCeTransfer) {  // every peer has pulled my rows: the rest is local
      barrier(kCeEnd, false);   // the reduce phase's kernel poisons
      return;
    }
  }
  FusedParams local = p;
  local.bases = c.sources.data_ptr<int64_t>();
  local.copy_engine = 1;
  launch_barrier_path<T>(local, ctas, bulk_stages(c, p.hidden, sizeof(T)), stream);
  if (gather_normed) {  // pull every peer's normed chunk
    barrier(kCeMid, true);
    for (int64_t q = 0; q < c.world; ++q) {
      const int64_t normed = p.normed_off + q * p.normed_cstride;
      if (q != c.rank) copy(c.local_base + normed, c.peer_data[q] + normed);
    }
  }
  if (phase == kCeWhole) barrier(kCeEnd, true);
}

}  // namespace

// A communicator over the symmetric buffer whose bases are `bases` (device int64 [2 * world]).
// `flags`: Flags bits; `multicast_base`: 0, or the multimem path's address (opt-in, untested
// here). Paths that need sm_90 instructions are refused (multimem) or left out (the bulk
// pipeline: the register path runs instead) on an older GPU.
int64_t comm_create(const at::Tensor& bases, int64_t rank, int64_t world, int64_t local_base,
                    int64_t buffer_bytes, int64_t timeout_ns, int64_t flags,
                    int64_t multicast_base) {
  TW_CHECK(world >= 2 && world <= kMaxRanks, "tokenweave: world size ", world,
           " out of range 2..", kMaxRanks);
  TW_CHECK(rank >= 0 && rank < world, "tokenweave: bad rank ", rank);
  TW_CHECK(bases.is_cuda() && bases.scalar_type() == at::kLong && bases.numel() == 2 * world &&
               bases.is_contiguous(),
           "tokenweave: bases must be a contiguous CUDA int64 tensor of 2 * world entries");
  TW_CHECK(buffer_bytes > 0 && timeout_ns > 0, "tokenweave: buffer_bytes and timeout_ns must "
           "be positive");
  int major = 0, minor = 0;
  const int device = bases.get_device();
  TW_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
                   cudaSuccess &&
               cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) ==
                   cudaSuccess,
           "tokenweave: cudaDeviceGetAttribute failed");
  TW_CHECK(multicast_base == 0 || major >= 9,
           "tokenweave: the multimem path needs sm_90 or newer (this GPU is sm_", major, "x)");
  auto* c = new Communicator();
  c->bases = bases;
  c->rank = rank;
  c->world = world;
  c->local_base = local_base;
  c->buffer_bytes = buffer_bytes;
  c->timeout_ns = timeout_ns;
  c->device = device;
  c->arch = major * 10 + minor;
  c->bulk = (flags & kFlagBulk) != 0 && major >= 9;  // mbarrier + cp.async.bulk are sm_90
  c->oneshot = (flags & kFlagOneShot) != 0;
  c->twoshot = (flags & kFlagTwoShot) != 0;
  c->local_stores_only = (flags & kFlagLocalStoresOnly) != 0;
  c->check_calls = (flags & kFlagCheckCalls) != 0;
  c->multicast_base = multicast_base;
  return reinterpret_cast<int64_t>(c);
}

// The copy-engine path's mirror: `sources` (device int64 [2 * world]), `mirror` (this rank's
// local copies of the peers' rows), `peer_data` (every rank's data base; entry `rank` =
// local_base), `mirrors` (this rank's mirror of each rank, `mirror_bytes` long, inside `mirror`).
void comm_attach_mirror(int64_t handle, const at::Tensor& sources, const at::Tensor& mirror,
                        at::IntArrayRef peer_data, at::IntArrayRef mirrors, int64_t mirror_bytes) {
  Communicator& c = comm_of(handle);
  TW_CHECK(sources.is_cuda() && sources.scalar_type() == at::kLong &&
               sources.numel() == 2 * c.world && sources.get_device() == c.device,
           "tokenweave: sources must be a CUDA int64 tensor of 2 * world entries on the "
           "communicator's device");
  TW_CHECK(mirror.is_cuda() && mirror.get_device() == c.device,
           "tokenweave: the mirror must be on the communicator's device");
  TW_CHECK(static_cast<int64_t>(peer_data.size()) == c.world &&
               static_cast<int64_t>(mirrors.size()) == c.world,
           "tokenweave: peer_data and mirrors need one entry per rank");
  TW_CHECK(peer_data[c.rank] == c.local_base, "tokenweave: peer_data[rank] is not local_base");
  TW_CHECK(mirror_bytes > 0 && mirror_bytes <= c.buffer_bytes,
           "tokenweave: mirror_bytes must be in (0, buffer_bytes]");
  const int64_t mirror_base = reinterpret_cast<int64_t>(mirror.data_ptr());
  const int64_t mirror_end = mirror_base + mirror.numel() * mirror.element_size();
  for (int64_t q = 0; q < c.world; ++q)
    TW_CHECK(q == c.rank || (mirrors[q] >= mirror_base && mirrors[q] % kVecBytes == 0 &&
                             mirrors[q] + mirror_bytes <= mirror_end),
             "tokenweave: the mirror of rank ", q,
             " is not a 16-byte aligned region inside the mirror tensor");
  c.sources = sources;
  c.mirror = mirror;
  c.peer_data.assign(peer_data.begin(), peer_data.end());
  c.mirrors.assign(mirrors.begin(), mirrors.end());
  c.mirror_bytes = mirror_bytes;
}

// The GEMM-fused path's inbox (a second peer-mapped buffer, laid out by Python: see the
// Communicator's fields). The GEMMs of every rank store into it; the consumer reads it.
void comm_attach_inbox(int64_t handle, int64_t data, int64_t slot_rows, int64_t row_bytes,
                    int64_t flags, int64_t flag_blocks, int64_t flag_tiles, int64_t control,
                    at::IntArrayRef regions) {
  Communicator& c = comm_of(handle);
  TW_CHECK(static_cast<int64_t>(regions.size()) == c.world && regions[c.rank] == flags,
           "tokenweave: the inbox needs every rank's region (", c.world, "), its own at its "
           "flags");
  for (const int64_t r : regions)
    TW_CHECK(r != 0 && r % 4 == 0, "tokenweave: inbox regions must be non-null and aligned");
  TW_CHECK(data != 0 && flags != 0 && control != 0 && data % kVecBytes == 0 &&
               flags % 4 == 0 && control % 4 == 0,
           "tokenweave: inbox addresses must be non-null and aligned");
  TW_CHECK(slot_rows >= 1 && row_bytes >= kVecBytes && row_bytes % kVecBytes == 0 &&
               flag_blocks >= 1 && flag_tiles >= 1,
           "tokenweave: inbox sizes must be positive (rows whole 16-byte vectors)");
  c.inbox_data = data;
  c.slot_rows = slot_rows;
  c.row_bytes = row_bytes;
  c.inbox_flags = flags;
  c.flag_blocks = flag_blocks;
  c.flag_tiles = flag_tiles;
  c.flag_set_words = c.world * flag_blocks * flag_tiles;
  c.inbox_control = control;
  c.inbox_regions.assign(regions.begin(), regions.end());
}

void comm_destroy(int64_t handle) {
  Communicator* c = &comm_of(handle);
  c->magic = 0;
  delete c;
}

// Queue a copy of this rank's error words (SignalPad.error: signal.cuh ErrorWord) into `host`
// (pinned int32 [kErrorWords]) on the current stream: no host synchronisation, and captured into
// a CUDA graph like any copy, so every replay refreshes them. The host reads them later and
// raises.
void comm_copy_errors(int64_t handle, at::Tensor& host) {
  const Communicator& c = comm_of(handle);
  TW_CHECK(host.device().is_cpu() && host.is_pinned() && host.scalar_type() == at::kInt &&
               host.numel() == kErrorWords && host.is_contiguous(),
           "tokenweave: the error words' destination must be a pinned int32 tensor of ",
           kErrorWords);
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(c.device));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(c.device).stream();
  const void* pad = reinterpret_cast<const void*>(c.local_base - kHeaderBytes);
  const cudaError_t err = cudaMemcpyAsync(host.data_ptr(), pad, kErrorWords * sizeof(uint32_t),
                                       cudaMemcpyDeviceToHost, stream);
  TW_CHECK(err == cudaSuccess, "tokenweave: copying the error words failed: ",
           cudaGetErrorString(err));
}

// y = sum over the group of partial + residual -> residual_out; RMSNorm(y) * weight -> normed_out.
// `path`: Path; `tag`: the call's tag.
void fused_allreduce_rmsnorm(int64_t handle, at::Tensor& partial, const at::Tensor& residual,
                          const std::optional<at::Tensor>& weight, double eps,
                          at::Tensor& residual_out, const std::optional<at::Tensor>& normed_out,
                          int64_t ctas, int64_t path, int64_t tag, at::TensorList normed_scales,
                          at::ArrayRef<double> scaling) {
  const Communicator& c = comm_of(handle);
  TW_CHECK(path >= kPathSm && path <= kPathCopyEngineReduce, "tokenweave: path must be 0 "
           "(SM), 1 (copy engine), 2 (its transfer) or 3 (its reduction), got ", path);
  const FusedParams p = make_params(c, partial, residual, weight, eps, residual_out, normed_out,
                                 ctas, tag, normed_scales, scaling);
  on_stream(partial, p, [&](auto t, cudaStream_t stream) {
    using T = decltype(t);
    if (path == kPathSm)
      launch_sm<T>(c, p, ctas, stream);
    else
      launch_copy_engine<T>(c, p, ctas, path, stream);
  });
}

// The GEMM-fused path's consumer: y = sum of the P slots of this rank's inbox rows + residual
// -> residual_out; RMSNorm(y) * weight -> normed_out (sequence parallel: stored to every rank;
// replicated: y to every rank's `partial` rows, then each rank normalizes all rows locally).
// `call`: the call's SegmentGeometry, CTA count and tag (its GEMM's too) as one list; normed
// rows in FP8 as the fused op writes them (replicated layout: the local normalization's rows).
void gemm_reduce_rmsnorm(int64_t handle, at::Tensor& partial, const at::Tensor& residual,
                      const std::optional<at::Tensor>& weight, double eps,
                      at::Tensor& residual_out, const std::optional<at::Tensor>& normed_out,
                      at::IntArrayRef call, at::TensorList normed_scales,
                      at::ArrayRef<double> scaling) {
  const Communicator& c = comm_of(handle);
  TW_CHECK(call.size() == kConsumerCallWords, "tokenweave: the consumer's call must be [set, "
           "row0, seg_rows, block_rows, col_tiles, publish, ctas, tag], got ", call.size(),
           " entries");
  const int64_t ctas = call[6];
  const FusedParams p = make_params(c, partial, residual, weight, eps, residual_out, normed_out,
                                    ctas, call[7], normed_scales, scaling);
  const SegmentGeometry g = geometry_of(c, p, partial.element_size(), call);
  on_stream(partial, p, [&](auto t, cudaStream_t stream) {
    launch_gemm_reduce<decltype(t)>(c, p, ctas, g, stream);
  });
}

// The fitted communicating GEMM: partial rows of x [rows, K] @ weight [n_out, K]^T (+ bias on
// one rank) into every owner's inbox slot. `regions`: each rank's inbox region as this rank maps
// it (one per rank); `geometry` (ops/segments.Segments.fitted_geometry): [slots_off, rank,
// slot_rows, row0, first, step, groups, group_rows, seg_rows, block_rows, cooperative, start,
// weight_rows, split_tiles, split_steps] (cooperative: 0 ping-pong, 1 cooperative, 2
// cooperative in pairs of CTAs sharing each weight tile's loads, not in blocks; weight_rows: 0,
// or with the tokens as the MMA's M, e4m3 in blocks, the tiles' weight rows, block_rows then 64
// tokens a consumer; split_tiles: 0, or split K in the cooperative mode outside pairs and
// blocks, the K steps of the call's last split_tiles tiles dealt out split_steps a CTA after
// every CTA's whole tiles, `split` = [flags int32, sums float32]: a flag and a tile's fp32 sums
// a CTA of those, the flags zero).
// bf16/fp16 operands: `scales` empty, rows of x's dtype (out_dtype none or that). e4m3 operands
// (ops/fp8_operands.py): `scales` = [x's, the weight's scale_inv], per tensor one float32 each,
// in blocks x's [ceil(K / 128), cols] (cols a multiple of 4, at least x's rows) and the
// weight's [ceil(N / 128), at least ceil(K / 128)], contiguous float32; out_dtype the rows'
// (and bias's) bf16 or fp16.
void fit_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
              at::IntArrayRef regions, at::IntArrayRef geometry, int64_t ctas,
              at::TensorList scales, std::optional<at::ScalarType> out_dtype,
              at::TensorList split) {
  TW_CHECK(x.is_cuda() && x.dim() == 2 && weight.dim() == 2 && weight.device() == x.device(),
           "tokenweave: fit_gemm takes 2-D x and weight on one CUDA device");
  const auto in = x.scalar_type();
  const bool fp8 = in == at::kFloat8_e4m3fn;
  TW_CHECK((in == at::kBFloat16 || in == at::kHalf || fp8) && weight.scalar_type() == in,
           "tokenweave: fit_gemm: x and weight must both be bf16, both fp16 or both e4m3");
  const auto dt = out_dtype.value_or(in);
  TW_CHECK(fp8 ? (dt == at::kBFloat16 || dt == at::kHalf) : dt == in,
           "tokenweave: fit_gemm: rows of bf16 or fp16, of the operands' dtype where they are "
           "16-bit");
  TW_CHECK(static_cast<int64_t>(scales.size()) == (fp8 ? 2 : 0),
           "tokenweave: fit_gemm: e4m3 operands take [x scale_inv, weight scale_inv], 16-bit "
           "ones none; got ", scales.size());
  for (const at::Tensor& s : scales)
    TW_CHECK(s.device() == x.device() && s.scalar_type() == at::kFloat && s.is_contiguous(),
             "tokenweave: fit_gemm: a scale_inv must be contiguous float32 on x's device");
  const int64_t k = x.size(1), n_out = weight.size(0);
  // One x scale is per tensor whatever its shape (block scales of x hold a multiple of 4).
  const bool blocks = fp8 && scales[0].numel() > 1;
  if (fp8 && !blocks) {
    TW_CHECK(scales[0].numel() == 1, "tokenweave: fit_gemm: x's scale_inv is empty");
    TW_CHECK(scales[1].numel() == 1,
             "tokenweave: fit_gemm: x's one scale is per tensor, so the weight's must be one "
             "float32 too; got ", scales[1].numel());
  }
  if (blocks) {
    const int64_t kb = (k + fit::kBlockK - 1) / fit::kBlockK;
    const int64_t nb = (n_out + fit::kBlockK - 1) / fit::kBlockK;
    const at::Tensor &xs = scales[0], &ws = scales[1];
    TW_CHECK(xs.dim() == 2 && ws.dim() == 2, "tokenweave: fit_gemm: block scales are 2-D, "
             "x's has ", xs.dim(), " dims and the weight's ", ws.dim());
    // x's scales are a TMA operand: its base address must be 16-byte aligned.
    check_aligned(xs, "fit_gemm: x's block-scale tensor");
    // (The kernel's offsets into either are 32-bit.)
    TW_CHECK(xs.size(0) == kb && xs.size(1) % 4 == 0 && xs.size(1) >= x.size(0) &&
                 ws.size(0) == nb && ws.size(1) >= kb && xs.numel() < (int64_t{1} << 31) &&
                 ws.numel() < (int64_t{1} << 31),
             "tokenweave: fit_gemm: block scales must be x's [", kb, ", a multiple of 4 >= ",
             x.size(0), "] and the weight's [", nb, ", >= ", kb, "], got [", xs.size(0), ", ",
             xs.size(1), "] and [", ws.size(0), ", ", ws.size(1), "]");
  }
  TW_CHECK(weight.size(1) == k, "tokenweave: fit_gemm: x has ", k, " in-features, weight ",
           weight.size(1));
  const int64_t k_align = kVecBytes / x.element_size();
  TW_CHECK(k % k_align == 0 && n_out % kVecElems == 0 && k > 0 && n_out > 0,
           "tokenweave: fit_gemm: in-features must be a positive multiple of ", k_align,
           " and out-features of 8 (16-byte rows), got ", k, " and ", n_out);
  // Rows of an operand: contiguous, a multiple of 16 bytes apart (a TMA stride), at least K.
  const auto check_rows = [k](const at::Tensor& t, const char* name) {
    check_aligned(t, name);
    TW_CHECK(t.stride(1) == 1 && t.stride(0) >= k && (t.stride(0) * t.element_size()) %
                 kVecBytes == 0,
             "tokenweave: fit_gemm: ", name, "'s rows must be contiguous, at least K apart and "
             "a multiple of 16 bytes apart; got strides (", t.stride(0), ", ", t.stride(1), ")");
  };
  check_rows(x, "x");
  check_rows(weight, "weight");
  if (bias) {
    TW_CHECK(bias->device() == x.device() && bias->scalar_type() == dt &&
                 bias->is_contiguous() && bias->numel() == n_out,
             "tokenweave: fit_gemm: bias must be a contiguous [out-features] tensor of the "
             "rows' dtype on x's device");
  }
  const c10::cuda::CUDAGuard guard(x.device());
  int major = 0, minor = 0;
  const int device = x.get_device();
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TW_CHECK(major == 9 && minor == 0, "tokenweave: fit_gemm needs an sm_90 GPU (wgmma, TMA), "
           "this one is sm_", major, minor);
  TW_CHECK(geometry.size() == 15, "tokenweave: fit_gemm geometry must be [slots_off, rank, "
           "slot_rows, row0, first, step, groups, group_rows, seg_rows, block_rows, "
           "cooperative, start, weight_rows, split_tiles, split_steps], got ", geometry.size(),
           " entries");
  const int64_t world = static_cast<int64_t>(regions.size());
  TW_CHECK(world >= 1 && world <= kMaxRanks, "tokenweave: fit_gemm takes 1..", kMaxRanks,
           " inbox regions, got ", world);
  const int64_t slots_off = geometry[0], rank = geometry[1], slot_rows = geometry[2];
  const int64_t row0 = geometry[3], first = geometry[4], step = geometry[5];
  const int64_t groups = geometry[6], group_rows = geometry[7], seg_rows = geometry[8];
  const int64_t bn = geometry[9], coop = geometry[10], start = geometry[11];
  const int64_t weight_rows = geometry[12], split_tiles = geometry[13];
  const int64_t split_steps = geometry[14];
  const bool tokens_m = weight_rows != 0;
  TW_CHECK(rank >= 0 && rank < world && slots_off >= 0 && slot_rows > 0,
           "tokenweave: fit_gemm: rank ", rank, " of ", world, ", slots at ", slots_off,
           " of ", slot_rows, " rows");
  TW_CHECK(groups == 1 || groups == world, "tokenweave: fit_gemm: groups must be 1 "
           "(replicated) or the world (sequence parallel), got ", groups);
  TW_CHECK(group_rows >= 1 && seg_rows >= 1 && (groups == 1 ? seg_rows * world >= group_rows
                                                              : seg_rows == group_rows),
           "tokenweave: fit_gemm: ", group_rows, " rows do not split into ", world,
           " segments of ", seg_rows);
  TW_CHECK(first >= 0 && step >= 0 && first + (groups - 1) * step + group_rows <= x.size(0),
           "tokenweave: fit_gemm: rows [", first, ", +", group_rows, ") of ", groups,
           " groups ", step, " apart exceed x's ", x.size(0), " rows");
  TW_CHECK(row0 >= 0 && row0 + seg_rows <= slot_rows, "tokenweave: fit_gemm: inbox rows [",
           row0, ", ", row0 + seg_rows, ") outside the slot's ", slot_rows);
  TW_CHECK(coop >= 0 && coop <= 2, "tokenweave: fit_gemm: cooperative must be 0, 1 or 2 (pairs)");
  const bool pair = coop == 2;
  TW_CHECK(!pair || (!blocks && ctas >= 2),
           "tokenweave: fit_gemm: pairs take 16-bit or per-tensor e4m3 operands and at least 2 "
           "CTAs; got ", blocks ? "block scales, " : "", ctas, " CTAs");
  if (tokens_m) {
    // A tile's 64 or 128 token rows may reach past its group's and x's rows: x's tensor map ends
    // at x's rows (the copy engine fills zeros past them), the x scales past their columns are
    // read from the last one, and such rows are never stored, so x needs no extra rows.
    TW_CHECK(blocks && weight_rows > 0 && weight_rows <= fit::kMaxWideBN &&
                 fit::one_of(static_cast<int>(weight_rows), fit::TokensMExtents{}) &&
                 bn == fit::kHalfM * (coop + 1) && !pair,
             "tokenweave: fit_gemm: the tokens as M take e4m3 operands in blocks, weight_rows "
             "one of ", fit::spelled(fit::TokensMExtents{}), " and block_rows 64 (ping-pong) or "
             "128 (cooperative); got weight_rows ", weight_rows, ", block_rows ", bn,
             blocks ? "" : ", no block scales");
  } else {
    const int max_bn = fit::max_bn(coop != 0, blocks, pair);
    TW_CHECK(bn >= fit::kMinBN && bn <= max_bn && bn % 8 == 0,
             "tokenweave: fit_gemm: block_rows must be a multiple of 8 in ", fit::kMinBN, "..",
             max_bn, blocks ? " (block scales)" : coop == 1 ? " (cooperative)" : "", ", got ",
             bn);
  }
  TW_CHECK(ctas >= 1 && start >= 0, "tokenweave: fit_gemm: ctas ", ctas, ", start ", start);
  TW_CHECK(x.size(0) < (int64_t{1} << 31) && static_cast<int64_t>(slot_rows) * world *
               n_out < (int64_t{1} << 40), "tokenweave: fit_gemm: too many rows");
  fit::FitGemmParams p{};
  for (int64_t q = 0; q < kMaxRanks; ++q) p.regions[q] = regions[q < world ? q : 0];
  for (int64_t q = 0; q < world; ++q)
    TW_CHECK(regions[q] != 0 && (regions[q] + slots_off) % kVecBytes == 0,
             "tokenweave: fit_gemm: inbox region ", q, " is null or not 16-byte aligned");
  p.slots_off = slots_off;
  p.bias = bias ? bias->data_ptr() : nullptr;
  for (size_t q = 0; q < scales.size(); ++q) p.scale_inv[q] = scales[q].data_ptr<float>();
  if (blocks) {
    p.ws_stride = static_cast<int>(scales[1].size(1));
    p.w_blocks = static_cast<int>(scales[1].size(0));
    p.xs_stride = static_cast<int>(scales[0].size(1));
  }
  p.n_out = static_cast<int>(n_out);
  p.k = static_cast<int>(k);
  p.rank = static_cast<int>(rank);
  p.slot_rows = static_cast<int>(slot_rows);
  p.row0 = static_cast<int>(row0);
  p.first = static_cast<int>(first);
  p.step = static_cast<int>(step);
  p.groups = static_cast<int>(groups);
  p.group_rows = static_cast<int>(group_rows);
  p.seg_rows = static_cast<int>(seg_rows);
  p.inv_seg_rows = 1.0f / static_cast<float>(seg_rows);
  p.group_tiles = static_cast<int>((group_rows + bn - 1) / bn);
  const int64_t tile_w =
      tokens_m ? weight_rows : (coop ? 2 : 1) * fit::consumer_rows(static_cast<int>(bn), blocks);
  p.m_tiles = static_cast<int>((n_out + tile_w - 1) / tile_w);
  // Units of work: tiles, or in pairs a weight tile with two token tiles.
  p.tiles = p.m_tiles * ((p.groups * p.group_tiles + (pair ? 1 : 0)) / (pair ? 2 : 1));
  p.start = static_cast<int>(start % (p.groups * p.group_tiles));
  const int stage_k = fit::kRowBytes / static_cast<int>(x.element_size());  // K a step
  const int64_t k_steps = (k + stage_k - 1) / stage_k;
  const bool split_ok =
      split_tiles == 0 || (split_steps >= 1 && split_steps <= split_tiles * k_steps);
  TW_CHECK(split_tiles >= 0 && split_tiles <= p.tiles && split_ok,
           "tokenweave: fit_gemm: split K takes 0..", p.tiles, " split tiles and 1..split tiles x ",
           k_steps, " K steps a CTA, got ", split_tiles, " tiles, ", split_steps, " steps");
  if (split_tiles > 0) {
    p.split_tiles = static_cast<int>(split_tiles);
    p.split_steps = static_cast<int>(split_steps);
    const int64_t split_grid = fit::split_ctas(p, stage_k);
    const int64_t sums = split_grid * tile_w * bn;
    TW_CHECK(coop == 1 && !blocks && !tokens_m,
             "tokenweave: fit_gemm: split K takes the cooperative mode outside pairs, 16-bit or "
             "per-tensor e4m3 operands");
    TW_CHECK(split_grid <= ctas, "tokenweave: fit_gemm: ", split_tiles, " split tiles at ",
             split_steps, " K steps a CTA take ", split_grid, " CTAs, more than the ", ctas,
             " given");
    TW_CHECK(split.size() == 2 && split[0].device() == x.device() &&
                 split[0].scalar_type() == at::kInt && split[0].is_contiguous() &&
                 split[0].numel() >= split_grid && split[1].device() == x.device() &&
                 split[1].scalar_type() == at::kFloat && split[1].is_contiguous() &&
                 split[1].numel() >= sums,
             "tokenweave: fit_gemm: split K takes [flags, sums]: contiguous int32 of at least ",
             split_grid, " and float32 of at least ", sums, " elements on x's device");
    check_aligned(split[1], "fit_gemm: split sums");
    p.split_flags = reinterpret_cast<unsigned*>(split[0].data_ptr<int>());
    p.split_sums = split[1].data_ptr<float>();
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  // The instantiation's BN: the tiles' tokens, or with the tokens as M their weight rows.
  const int b = static_cast<int>(tokens_m ? weight_rows : bn), g = static_cast<int>(ctas);
  const float* x_scales = blocks ? scales[0].data_ptr<float>() : nullptr;
  const int64_t scale_cols = blocks ? scales[0].size(1) : 0;
  // The instantiation of the rows' type T, the operands' In, their scaling and layout, in the
  // call's mode.
  const auto run = [&](auto t, auto o, auto blocks_c, auto tokens_m_c) {
    using T = decltype(t);
    using In = decltype(o);
    constexpr bool kBlocks = decltype(blocks_c)::value;
    constexpr bool kTokensM = decltype(tokens_m_c)::value;
    const auto go = [&](auto coop_c, auto pair_c) {
      return fit::launch<T, In, decltype(coop_c)::value, kBlocks, kTokensM,
                         decltype(pair_c)::value>(x.data_ptr(), x.size(0), x.stride(0),
                                                  weight.data_ptr(), weight.stride(0), x_scales,
                                                  scale_cols, p, b, g, stream);
    };
    if constexpr (!kBlocks)  // pairs: checked above to be none in blocks
      if (pair) return go(std::true_type{}, std::true_type{});
    return coop ? go(std::true_type{}, std::false_type{})
                : go(std::false_type{}, std::false_type{});
  };
  const bool bf16 = dt == at::kBFloat16;
  const std::false_type no;
  const auto e4m3 = [&](auto t) {
    const __nv_fp8_e4m3 o{};
    return !blocks ? run(t, o, no, no)
                   : (tokens_m ? run(t, o, std::true_type{}, std::true_type{})
                               : run(t, o, std::true_type{}, no));
  };
  const fit::LaunchStatus status =
      fp8 ? (bf16 ? e4m3(__nv_bfloat16{}) : e4m3(__half{}))
          : (bf16 ? run(__nv_bfloat16{}, __nv_bfloat16{}, no, no)
                  : run(__half{}, __half{}, no, no));
  TW_CHECK(status != fit::LaunchStatus::kNoDriverEntry,
           "tokenweave: fit_gemm: the driver has no cuTensorMapEncodeTiled (CUDA 12+ driver)");
  TW_CHECK(status != fit::LaunchStatus::kTensorMap,
           "tokenweave: fit_gemm: the driver refused the operands' tensor maps");
  TW_CHECK(status == fit::LaunchStatus::kOk, "tokenweave: fit_gemm launch failed: ",
           cudaGetErrorString(cudaGetLastError()));
}

}  // namespace tokenweave

TORCH_LIBRARY(tokenweave, m) {
  m.def(
      "comm_create(Tensor bases, int rank, int world, int local_base, int buffer_bytes, "
      "int timeout_ns, int flags, int multicast_base) -> int");
  m.def(
      "comm_attach_mirror(int comm, Tensor sources, Tensor mirror, int[] peer_data, "
      "int[] mirrors, int mirror_bytes) -> ()");
  m.def(
      "comm_attach_inbox(int comm, int data, int slot_rows, int row_bytes, int flags, "
      "int flag_blocks, int flag_tiles, int control, int[] regions) -> ()",
      &tokenweave::comm_attach_inbox);
  m.def("comm_destroy(int comm) -> ()", &tokenweave::comm_destroy);
  m.def("comm_copy_errors(int comm, Tensor(a!) host) -> ()", &tokenweave::comm_copy_errors);
  m.def(
      "fused_allreduce_rmsnorm(int comm, Tensor(a!) partial, Tensor residual, Tensor? weight, "
      "float eps, Tensor(b!) residual_out, Tensor(c!)? normed_out, int ctas, int path, "
      "int tag, Tensor(d!)[] normed_scales, float[] scaling) -> ()");
  m.def(
      "gemm_reduce_rmsnorm(int comm, Tensor(a!) partial, Tensor residual, Tensor? weight, "
      "float eps, Tensor(b!) residual_out, Tensor(c!)? normed_out, int[] call, "
      "Tensor(d!)[] normed_scales, float[] scaling) -> ()");
  m.def(
      "fit_gemm(Tensor x, Tensor weight, Tensor? bias, int[] regions, int[] geometry, int ctas, "
      "Tensor[] scales, ScalarType? out_dtype, Tensor(a!)[] split) -> ()");
}

TORCH_LIBRARY_IMPL(tokenweave, CUDA, m) {
  m.impl("comm_create", &tokenweave::comm_create);
  m.impl("comm_attach_mirror", &tokenweave::comm_attach_mirror);
  m.impl("fused_allreduce_rmsnorm", &tokenweave::fused_allreduce_rmsnorm);
  m.impl("gemm_reduce_rmsnorm", &tokenweave::gemm_reduce_rmsnorm);
  m.impl("fit_gemm", &tokenweave::fit_gemm);
}

#ifdef TORCH_EXTENSION_NAME
// Importable as a Python module (megatron_tokenweave._C); the ops register on load.
#include <Python.h>
#define TW_CAT_(a, b) a##b
#define TW_CAT(a, b) TW_CAT_(a, b)
extern "C" PyObject* TW_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr,
                            nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
#endif
