"""What both communicating row-parallel GEMM kernels share (owner_gemm.py's and
owner_gemm_pingpong.py's): the call's epoch, the tile order, where a tile goes in its owner's
inbox and the release of a CTA's tiles (the call's tag, then the flags), as Triton device
functions (Gluon kernels call them too), and the launch arguments that change from call to
call."""

from __future__ import annotations

import triton
import triton.language as tl

# gemm_reduce.cuh next_inbox_epoch: epochs run 1 .. 2^31 - 1
EPOCH_WRAP = tl.constexpr(0x7FFFFFFF)
TAG_SLOTS = tl.constexpr(8)  # tag[set][src] words per set in an inbox (kernels/inbox.py)


@triton.jit
def call_epoch(control_ptr, set_index):
    """This call's epoch: the set's last one (the consumer writes it back) + 1, wrapping."""
    last = tl.load(control_ptr + set_index)
    return tl.where(last >= EPOCH_WRAP, 1, last + 1)


@triton.jit
def tile_of(tile, start, blocks, num_m, per_group, GROUP_M: tl.constexpr):
    """(owner, row block within its segment, column tile) of linear tile indices: grouped
    order (GROUP_M row blocks share the weight tiles in L2) over the call's non-empty row blocks
    (segment c's at c * blocks + m), rotated to begin at `start` (segment rank + 1's)."""
    group = tile // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    vm = (first_m + (tile % per_group) % group_size + start) % num_m
    pn = (tile % per_group) // group_size
    return vm // blocks, vm % blocks, pn


@triton.jit
def region_base(owner, r0, r1, r2, r3, r4, r5, r6, r7):
    """The base address of rank `owner`'s inbox region: selected among scalar arguments, so
    neither the epilogue nor the flags wait on a load for it."""
    base = tl.where(owner == 1, r1, r0)
    base = tl.where(owner == 2, r2, base)
    base = tl.where(owner == 3, r3, base)
    base = tl.where(owner == 4, r4, base)
    base = tl.where(owner == 5, r5, base)
    base = tl.where(owner == 6, r6, base)
    return tl.where(owner == 7, r7, base)


@triton.jit
def tile_destination(owner, m, pn, seg_rows, total, r0, r1, r2, r3, r4, r5, r6, r7, slots_off,
                     rank, slot_rows, row0, N, dtype: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr):
    """Where tile (owner, row block m, column tile pn) goes: its first element in the owner's
    slot `rank` (16-byte aligned: inbox slots are 256-byte aligned, so the stores become
    16-byte vectors), and how many of its rows hold the segment's rows."""
    region = region_base(owner, r0, r1, r2, r3, r4, r5, r6, r7)
    dst = tl.multiple_of((region + slots_off).to(tl.pointer_type(dtype)), 16)
    dst += (rank * slot_rows + row0 + m * BM).to(tl.int64) * N + pn * BN
    return dst, tl.minimum(seg_rows, total - owner * seg_rows) - m * BM


@triton.jit
def _publish_flags(mine, tiles, epoch, start, blocks, num_m, per_group, GROUP_M: tl.constexpr,
                   r0, r1, r2, r3, r4, r5, r6, r7, rank, set_index, set_words, flag_blocks,
                   flag_tiles):
    """flag = epoch of each tile in `mine` (those below `tiles`), in its owner's inbox: a relaxed
    system-scope store by warp 0's threads, a release after their fence (`release_tiles`)."""
    f_owner, f_m, f_pn = tile_of(mine, start, blocks, num_m, per_group, GROUP_M)
    flags = region_base(f_owner, r0, r1, r2, r3, r4, r5, r6, r7).to(tl.pointer_type(tl.int32))
    flag = flags + set_index * set_words + (rank * flag_blocks + f_m) * flag_tiles + f_pn
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, 32; "
        "setp.ne.and.s32 p, $3, 0, p; @p st.relaxed.sys.global.b32 [$1], $2; mov.b32 $0, $2; }",
        "=r,l,r,r", [flag, epoch, (mine < tiles).to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _publish_tag(lanes, call_tag, r0, r1, r2, r3, r4, r5, r6, r7, tags_off, rank, set_index):
    """tag[set][rank] = call_tag in every owner's inbox (lanes below TAG_SLOTS; past the group
    the region bases repeat rank 0's, which then gets the same value again): relaxed
    system-scope stores by warp 0's threads, before their fence (`release_tiles`)."""
    owner = lanes % TAG_SLOTS
    tags = (region_base(owner, r0, r1, r2, r3, r4, r5, r6, r7) + tags_off).to(
        tl.pointer_type(tl.int32))
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, 32; "
        "setp.ne.and.s32 p, $3, 0, p; @p st.relaxed.sys.global.b32 [$1], $2; mov.b32 $0, $2; }",
        "=r,l,r,r", [tags + set_index * TAG_SLOTS + rank, call_tag + lanes * 0,
                     (lanes < TAG_SLOTS).to(tl.int32)],
        dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def release_tiles(lanes, tiles, epoch, start, blocks, num_m, per_group, GROUP_M: tl.constexpr,
                  r0, r1, r2, r3, r4, r5, r6, r7, tags_off, rank, set_index, call_tag,
                  set_words, flag_blocks, flag_tiles, num_ctas):
    """Both kernels' tail, once per CTA after a barrier of all its threads: the call's tag into
    every owner's inbox, then the flags of the CTA's tiles (program_id, + num_ctas, ... below
    `tiles`), `lanes` (0 .. L - 1, in the caller's layout) at once. Warp 0 alone stores and
    fences: after the barrier its system-scope fence is cumulative over every thread's stores,
    so its relaxed flag stores are releases of the tiles and of the tag. (A fence per tile cost
    5-10 % of the GEMM; a fence in every warp of the CTA 0.5 us more than one at 1K tokens;
    measured, docs/kernel.md.)"""
    tagged = _publish_tag(lanes, call_tag, r0, r1, r2, r3, r4, r5, r6, r7, tags_off, rank,
                          set_index)
    done = tl.inline_asm_elementwise(
        "{ .reg .pred q; .reg .b32 t; mov.u32 t, %tid.x; setp.lt.u32 q, t, 32; "
        "@q fence.acq_rel.sys; mov.b32 $0, $1; }",
        "=r,r", [epoch + tagged * 0], dtype=tl.int32, is_pure=False, pack=1)
    for chunk in range(tl.program_id(0), tiles, num_ctas * lanes.shape[0]):
        _publish_flags(chunk + lanes * num_ctas, tiles, done, start, blocks, num_m, per_group,
                       GROUP_M, r0, r1, r2, r3, r4, r5, r6, r7, rank, set_index, set_words,
                       flag_blocks, flag_tiles)


# The call's geometry changes from call to call: not specialized (no recompilation per token
# count; N and K stay specialized, their divisibility gives the 16-byte stores).
PER_CALL = ("rank", "set_index", "call_tag", "first", "step", "seg_rows", "total", "row0",
            "num_m", "start", "num_ctas")
