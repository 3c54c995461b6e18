#!/usr/bin/env bash
# A GPU round on the 2-GPU device machine, run from the repo root there after the staged wheels
# were received: ../shared/device/stage.sh base / te / fa4 / cutlass, .ci/stage_serve.sh and
# .ci/stage_flashinfer.sh, carried in back-to-back calls that each run `bash .dw/recv.sh`
# (one call carries at most 64 MiB with the working tree, so each 56 MiB part of TE's core wheel
# goes alone; ~6 s each). Carry `te/small` only after the five parts: TE's meta package
# installed without its core wheel makes `import megatron.core` raise. The first phase run
# builds the extension (`python -m pip install -v ...` below, ~100 s; a bare `pip install -q -e .`
# in a staging call did not build it on 2026-11-30).
# Results under $OUT; the per-step logs of the call in /tmp/gpu_round_logs on the device
# machine, packed into one $OUT/logs.tgz after every step (a call brings back at most 8 files
# from $OUT, so results and one archive; a call killed at its limit keeps the steps before). The
# extension builds with one nvcc per kernel family in parallel (~50 s on 16 cores).
# Phases, one or more per call (`gpu_round.sh moe_tests
# moe_bench`; each phase fits one 10-minute device call):
#   tune   split-policy tables for the 70B/Qwen shapes (hidden 8192), both layouts, graph and
#          eager, on TE (4-layer blocks: one call per model); copied to
#          $OUT/tables (commit them as megatron_tokenweave/tables/)
#   tune8b the same for the 8B shapes (hidden 4096)
#   bench  block benchmark vs the TE spec: dense shapes as CUDA graphs; the same layers as
#          HybridModel stacks beside the GPT ones (70B, 8B; --model-classes gpt hybrid);
#          Mixtral's table, then its block (eager)
#   tests  TE-spec parity, static-engine serving (graph replay: moe_tests)
#   e2e    dynamic engine / OpenAI server tests (flash-attn-4), then the e2e benchmark
#          (throughput through the dynamic engine if those passed, else the static engine)
#   kernel the kernel benchmark (FlashInfer where staged: .ci/stage_flashinfer.sh --aot)
#   kernel_fp8  the kernel benchmark's FP8 rows per Hopper recipe (`stage.sh te` carried): the
#          replicated op's FP8 form against NCCL + norm + TE's quantizer, 16 and 64 CTAs
#   verify kernel tests across two GPUs (every data path; `one_gpu` has the ranks-sharing-one-GPU
#          cases)
#   sanitize  compute-sanitizer (memcheck, racecheck) on the current kernels
#   ce     the copy-engine data path: kernel benchmark (op alone and beside the GEMM) and the 70B
#          block with both layouts on it, beside the SM-driven path
#   graphs dynamic engine under Megatron's inference CUDA graphs (layer, block scope)
#   e2e_graphs  the e2e benchmark with them
#   more   local-spec layer tests
#   moe_tests  GPU parity of the model families (Mixtral: all-gather and padded all-to-all
#          dispatch, local and TE specs), CUDA-graph replay == eager (every comm, padded MoE),
#          a capture after an eager warm-up with per-mode tables
#   tune_moe   graph tables for Mixtral with the padded (capturable) dispatch
#   moe_bench  its block as CUDA graphs, the split placed by always / never variants
#   prefill    e2e prefill latency only, with the stock model's no-communication ceiling
#   ce_main    kernel tests (the copy-engine op in phases among them), then the 70B block with
#          the split on the SM-driven path and on the copy-engine path (reductions on the main
#          stream)
#   tune_rep   tables for the 70B shapes, replicated layout only (what the engines run)
#   tune_rep4  its CUDA-graph table from 4-layer blocks (three cross-layer hand-offs, not one)
#   one_gpu  what one GPU can check: the kernel protocol with two processes on it (every data
#          path), and the token split's GEMM cost (bench split_cost)
#   serve_one_gpu  the serving tests with both ranks sharing one GPU over gloo (static engine +
#          Flask, dynamic engine, OpenAI-server soak and SIGTERM stop; the CUDA-graph ones skip):
#          stage.sh fa4 and .ci/stage_serve.sh carried, TE optional
#   gemm   the GEMM-fused mechanism on one GPU: its protocol with 2, 4 and 8 ranks sharing the GPU,
#          the woven layer's parity with it (ranks sharing the GPU)
#   gemm_sweep  the communicating GEMM against cuBLAS / TE (bench gemm_fused's default sweep:
#          23 counts, every dense family, TP 2/4/8, 10 replays; TE rows where `stage.sh te` was
#          carried), bf16, one process per model (`sweep` below: ~30-70 s each on one H200);
#          gemm_sweep_fp16 the same in fp16
#   gemm_fp8  the communicating GEMM's FP8 forms: their GPU tests (loopback inbox; operands in
#          padded rows among them), then bench
#          gemm_fused's default sweep with e4m3 operands scaled per tensor against cuBLAS's FP8
#          GEMM, the one-consumer tiles beside the pick where the pick is the ping-pong kernel
#          (~6 min); gemm_fp8_blocks the same sweep with TE's blockwise scales
#   gemm_cutlass  the communicating GEMM beside CUTLASS's sm90 kernels and cluster shapes (bench
#          gemm_fused --cutlass; needs `stage.sh cutlass` carried; builds the reference, minutes)
#   gemm2  the GEMM-fused mechanism on 2 GPUs: its protocol test across NVLink, then the row GEMM +
#          all-reduce + norm per mechanism (bench gemm_pair), both layouts, 512-8K tokens
#   gemm2_tiles  the same pair with each tile shape forced, replicated, 1K / 4K tokens: how
#          much of the reduce-scatter a CTA's last tiles leave exposed; then with each release
#          forced (the GEMM's CTAs or the consumer publish the tiles), 1K / 2K / 4K
#   tput   throughput through the dynamic engine, eager, with the no-communication ceiling, for
#          32 and 256 generated tokens per prompt (flash-attn-4 staged)
#   layer_one_gpu  the woven layers with ranks sharing one GPU: GPTModel against the stock spec,
#          HybridModel against Megatron's hybrid_stack_spec (TE where staged), hybrid graph replays
#   calls  the kernel protocol with 2, 4 and 8 ranks sharing one GPU, the divergence checks (a
#          rank that misses a call) among them, then what the call check costs the one-shot
#          path (bench call_check)
#   padded the operands in padded rows (ops/gemm_rows.py): their GPU test and op check, the
#          woven FP8 layer whose fc2 rows are padded against the TE spec (`stage.sh te`
#          carried; skips without TE), then Qwen2.5-72B's shards in FP8 (its fc2 at TP 8 is the
#          shard they change; `tokenweave_prepadded` rows: the copy's cost) (~6 min together)
#   gemm_diag  where the communicating GEMM falls short of cuBLAS: each Triton tile shape and
#          each fitted extent and mode forced, cuBLAS over the covered rows (bench gemm_fused
#          --breakdown) at the counts the sweep found short (512-1279, 5003), the shards that
#          were shortest (Llama-3-8B, Qwen2.5-7B, Qwen2.5-72B) at TP 2 and 8, one JSON per
#          family (a run cut at its limit keeps the families before)
#   gemm_diag_blocks  the fitted kernel in FP8 blocks beside itself per tensor at the same token
#          extents (bench gemm_fused --breakdown, both scalings: 64 and 96 tokens in both modes,
#          and each pick's), Llama-3.3-70B at TP 2 and 8, 1000 / 4099 / 8192 tokens: whether
#          the blocks kernel is short for its scaling or for its extent (kernel.md "Speed, in
#          blocks")
#   gemm_blocks_wide  the fitted kernel in FP8 blocks at extents past 104 (consumers of 64
#          weight rows): the FP8 GEMM test and the op checks, then the breakdown of
#          gemm_diag_blocks in blocks only (the forced extents to 208 among its rows)
#   fp8    FP8 through the woven layer with ranks sharing one GPU (`stage.sh te` carried): GPTModel
#          parity against Megatron's TE spec in each Hopper recipe at TP 2 and 4, HybridModel at
#          TP 2, CUDA-graph replays; then the woven FP8 GEMMs' split cost beside bf16 (bench
#          split_cost --fp8-recipe), 70B shards at TP 2 and 8
#   fp8_rows  the extension's own argument checks called directly (tests/gpu/test_op_checks.py),
#          then the fused op writing the next linear's input in FP8 (`stage.sh te` carried): its
#          GPU test against the reference and TE's quantizers (TP 2 and 4), bench fp8_rows at
#          TP 2 and 4 (~2 min together)
#   fp8_rows_layer  the woven FP8 layer tests that have not run with FP8 rows in use (TP 4
#          parity, hybrid, graph replays, the padding wrapper, the checkpoint both ways)
#   serve_hybrid  the serving tests of GPTModel and HybridModel with ranks sharing one GPU, but
#          the OpenAI soak and the SIGTERM stop (fa4 and .ci/stage_serve.sh carried)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENWEAVE_CACHE=/tmp/twcache
out=${OUT:-/tmp/out}; logs=/tmp/gpu_round_logs; rm -rf "$logs"; mkdir -p "$out" "$logs"
pack_logs() { tar czf "$out/logs.tgz" -C /tmp gpu_round_logs 2>/dev/null; }
quiet() { grep -v "arn\|DEPRECATED\|func(\|^\s*$" ; }
step() {
  local name=$1 limit=$2; shift 2; echo "== $name ($(date +%T))"
  timeout "$limit" "$@" 2>&1 | quiet > "$logs/$name.log"; local rc=${PIPESTATUS[0]}
  tail -"${TAIL:-12}" "$logs/$name.log"; echo "-- $name rc=$rc"; pack_logs; return "$rc"
}
# bench gemm_fused's default sweep in DTYPE, one process per dense model (a call cut at its limit
# keeps the models before), the JSONs packed after each into $out/gemm_sweep_DTYPE.tgz (a call
# brings back few files); join them with docs/results/gemm_join.py.
sweep() {
  local dt=$1 dir=/tmp/gemm_sweep_$1 m models
  rm -rf "$dir"; mkdir -p "$dir"
  models=$(python -c "from megatron_tokenweave.bench.gemm_fused import DENSE; print(*DENSE)" \
             2> "$logs/gemm_sweep_models.log") || { echo "sweep: no model list"; \
                                                     tail -3 "$logs/gemm_sweep_models.log"; return 1; }
  for m in $models; do
    TAIL=2 step "gemm_sweep_${dt}_$m" 200 python -m megatron_tokenweave.bench gemm_fused \
      --dtypes "$dt" --models "$m" --iters 10 --out "$dir/$m.json"
    (cd "$dir" && ls ./*.json > /dev/null 2>&1 && tar czf "$out/gemm_sweep_$dt.tgz" ./*.json)
  done
}
python -c "import torch, megatron_tokenweave._C" 2>/dev/null \
  || step build 200 python -m pip install -v --no-build-isolation --no-deps -e .
python -c "import torch, megatron_tokenweave._C; print('extension: built by setup.py')" 2>&1 | tail -1
python -c "import importlib.metadata as m; print('TE', m.version('transformer_engine'))" 2>&1 | tail -1
for phase in "${@:-tests}"; do
case "$phase" in
  gemm)
    TAIL=6 step gemm_protocol 420 python -m pytest -x -v -s tests/gpu/test_gemm_fused.py
    TAIL=6 step gemm_layer 300 python -m pytest -x -v -s tests/gpu/test_layer_gpu.py -k one_gpu
    ;;
  gemm_fp8|gemm_fp8_blocks)
    dt=fp8; [ "$phase" = gemm_fp8 ] || dt=fp8_blocks
    [ "$dt" = fp8_blocks ] || TAIL=8 step gemm_fp8_test 300 python -m pytest -x -v -s \
      tests/gpu/test_gemm_fused.py -k "fp8 or padded_rows"
    sweep "$dt"
    ;;
  gemm_sweep|gemm_sweep_fp16)
    dt=bf16; [ "$phase" = gemm_sweep ] || dt=fp16
    sweep "$dt"
    ;;
  fp8)
    TAIL=30 step fp8_layer 560 python -m pytest -x -v -s tests/gpu/test_layer_gpu.py -k fp8
    for tp in 2 8; do
      TAIL=14 step "fp8_split_tp$tp" 300 python -m megatron_tokenweave.bench split_cost \
        --model llama-3.3-70b --tp "$tp" --fp8-recipe delayed tensorwise blockwise \
        --out "$out/split_cost_fp8_tp$tp.json"
    done
    ;;
  fp8_rows)
    TAIL=8 step op_checks 120 python -m pytest -v tests/gpu/test_op_checks.py
    TAIL=8 step fp8_rows_op 420 python -m pytest -x -v -s tests/gpu/test_fp8_rows_gpu.py
    TAIL=34 step fp8_rows_bench 300 python -m megatron_tokenweave.bench fp8_rows --tp 2 4 \
      --iters 20 --out "$out/fp8_rows_1gpu.json"
    ;;
  fp8_rows_layer)
    TAIL=30 step fp8_rows_layer 560 python -m pytest -v -s tests/gpu/test_layer_gpu.py \
      -k "(fp8_logits and 4-) or fp8_hybrid or fp8_under or fp8_delayed_scaling"
    ;;
  gemm_cutlass)
    TAIL=6 step cutlass_test 420 python -m pytest -x -v -s tests/gpu/test_cutlass_gemm.py
    TAIL=40 step cutlass_bench 300 python -m megatron_tokenweave.bench gemm_fused --cutlass \
      --tokens 1024 2048 4096 8192 --iters 20 --out "$out/gemm_cutlass_1gpu.json"
    ;;
  gemm2)
    TAIL=6 step gemm_two_gpus 300 python -m pytest -x -v -s tests/gpu/test_gemm_fused.py -k two_gpus
    TAIL=24 step gemm_pair 420 python -m megatron_tokenweave.bench gemm_pair \
      --out "$out/gemm_pair_tp2.json"
    ;;
  gemm2_tiles)
    TAIL=24 step gemm_pair_tiles 420 python -m megatron_tokenweave.bench gemm_pair \
      --layouts replicated --tokens 1024 4096 --tiles auto large pingpong small \
      --out "$out/gemm_pair_tiles_tp2.json"
    TAIL=24 step gemm_pair_release 420 python -m megatron_tokenweave.bench gemm_pair \
      --layouts replicated --tokens 1024 2048 4096 --release gemm consumer \
      --out "$out/gemm_pair_release_tp2.json"
    ;;
  tune)
    TAIL=14 step tune70b 520 python -m megatron_tokenweave.tune --model llama-3.3-70b --budget-s 460
    mkdir -p "$out/tables" && cp /tmp/twcache/tuning/*.json "$out/tables/"
    ;;
  tune8b)
    TAIL=14 step tune8b 300 python -m megatron_tokenweave.tune --model llama-3-8b --budget-s 250
    mkdir -p "$out/tables" && cp /tmp/twcache/tuning/*.json "$out/tables/"
    ;;
  bench)
    TAIL=40 step block 300 python -m megatron_tokenweave.bench block --modes graph --iters 15 \
      --models llama-3.3-70b qwen2.5-72b llama-3-8b --variants tokenweave tokenweave_sp \
      --out "$out/block_tp2.json"
    TAIL=24 step block_hybrid 250 python -m megatron_tokenweave.bench block --modes graph \
      --iters 15 --batch 1 --models llama-3.3-70b llama-3-8b --variants tokenweave \
      --model-classes gpt hybrid --out "$out/block_hybrid_tp2.json"
    TAIL=14 step tune_moe 130 python -m megatron_tokenweave.tune --model mixtral-8x7b \
      --iters 5 --budget-s 100
    mkdir -p "$out/tables" && cp /tmp/twcache/tuning/*_moe*.json "$out/tables/"
    TAIL=12 step block_moe 150 python -m megatron_tokenweave.bench block --iters 10 \
      --models mixtral-8x7b --variants tokenweave tokenweave_sp --out "$out/block_moe_tp2.json"
    ;;
  tests)
    TAIL=8 step te_parity 180 python -m pytest -x -v -s tests/gpu/test_layer_gpu.py -k te_spec
    TAIL=8 step serving 100 python -m pytest -v -rs tests/gpu/test_serving_gpu.py -k static
    ;;
  e2e)
    engine=static
    TAIL=20 step serving_dynamic 220 python -m pytest -v -rs tests/gpu/test_serving_gpu.py \
      -k "(dynamic or openai) and not cuda_graphs" && engine=auto
    TAIL=12 step e2e 330 python -m megatron_tokenweave.bench e2e --engine "$engine" --reps 3 \
      --throughput-reps 3 --out "$out/e2e_tp2.json"
    ;;
  kernel)
    TAIL=60 step kernel 400 python -m megatron_tokenweave.bench kernel --ctas 8 16 32 64 \
      --out "$out/kernel_tp2.json" --record-out docs/results/kernel_tp2.json
    ;;
  kernel_fp8)
    for recipe in blockwise delayed tensorwise; do
      TAIL=20 step "kernel_fp8_$recipe" 180 python -m megatron_tokenweave.bench kernel \
        --fp8-recipe "$recipe" --ctas 16 --replicated-ctas 16 64 --no-flashinfer \
        --out "$out/kernel_tp2_fp8_$recipe.json" \
        --record-out "docs/results/kernel_tp2_fp8_$recipe.json"
    done
    ;;
  verify)
    TAIL=12 step kernel_tests 300 python -m pytest -v -s tests/gpu/test_kernel.py -k two_gpus
    ;;
  sanitize)
    TAIL=8 step sanitizer 480 python -m pytest -v tests/gpu/test_sanitizer.py
    ;;
  ce)
    TAIL=45 step kernel_ce 220 python -m megatron_tokenweave.bench kernel --tokens 1024 2048 \
      4096 8192 --ctas 8 16 32 --no-flashinfer --replicated-ctas --carveout-ctas --regs-ctas \
      --iters 15 --out "$out/kernel_tp2_copy_engine.json" \
      --record-out docs/results/kernel_tp2_copy_engine.json
    TAIL=30 step block_ce 330 python -m megatron_tokenweave.bench block --modes graph --iters 15 \
      --models llama-3.3-70b --batch 1 \
      --variants tokenweave tokenweave_sp tokenweave_ce tokenweave_sp_ce \
      --out "$out/block_tp2_copy_engine.json"
    ;;
  graphs)
    TAIL=20 step dynamic_graphs 250 python -m pytest -v -rs tests/gpu/test_serving_gpu.py \
      -k "dynamic and cuda_graphs"
    ;;
  e2e_graphs)
    TAIL=12 step e2e_graphs 330 python -m megatron_tokenweave.bench e2e --engine dynamic \
      --cuda-graphs 16 --metrics throughput --throughput-reps 3 --out "$out/e2e_tp2_graphs.json"
    ;;
  one_gpu)
    TAIL=12 step kernel_one_gpu 560 python -m pytest -v -s tests/gpu/test_kernel.py
    TAIL=8 step split_cost 200 python -m megatron_tokenweave.bench split_cost \
      --out "$out/split_cost.json"
    ;;
  serve_one_gpu)
    TAIL=12 step serving_one_gpu 560 python -m pytest -v -rs tests/gpu/test_serving_gpu.py
    ;;
  tput)
    TAIL=12 step e2e_tput 560 python -m megatron_tokenweave.bench e2e --engine dynamic \
      --metrics throughput --output-tokens 32 256 --throughput-reps 3 \
      --out "$out/e2e_tp2_tput.json"
    ;;
  moe_tests)
    TAIL=10 step moe_tests 420 python -m pytest -v -s tests/gpu/test_layer_gpu.py \
      -k "families or graph_replay or capture_after"
    ;;
  tune_moe)
    TAIL=14 step tune_moe_graph 230 python -m megatron_tokenweave.tune --model mixtral-8x7b \
      --moe-dispatch padded --budget-s 200
    mkdir -p "$out/tables" && cp /tmp/twcache/tuning/*_moe.json "$out/tables/"
    ;;
  moe_bench)
    TAIL=14 step block_moe_graph 330 python -m megatron_tokenweave.bench block --modes graph \
      --iters 15 --models mixtral-8x7b --moe-dispatch padded --batch 1 --stock-sp --variants tokenweave \
      tokenweave_sp tokenweave_sp_split tokenweave_sp_nosplit --out "$out/block_moe_graph_tp2.json"
    ;;
  prefill)
    TAIL=10 step prefill 330 python -m megatron_tokenweave.bench e2e --metrics prefill --reps 5 \
      --out "$out/e2e_prefill_tp2.json"
    ;;
  ce_main)
    TAIL=12 step kernel_tests 300 python -m pytest -v -s tests/gpu/test_kernel.py -k two_gpus
    TAIL=30 step block_ce_main 300 python -m megatron_tokenweave.bench block --modes graph \
      --iters 15 --models llama-3.3-70b --batch 1 \
      --variants tokenweave tokenweave_split tokenweave_ce_split --out "$out/block_tp2_ce_main.json"
    ;;
  tune_rep)
    TAIL=16 step tune70b_rep 470 python -m megatron_tokenweave.tune --model llama-3.3-70b \
      --layouts replicated --budget-s 400
    mkdir -p "$out/tables" && cp /tmp/twcache/tuning/*.json "$out/tables/"
    ;;
  tune_rep4)
    TAIL=16 step tune70b_rep4 300 python -m megatron_tokenweave.tune --model llama-3.3-70b \
      --layouts replicated --modes graph --layers 4 --budget-s 240
    mkdir -p "$out/tables" && cp /tmp/twcache/tuning/*.json "$out/tables/"
    ;;
  layer_one_gpu)
    TAIL=12 step layer_one_gpu 500 python -m pytest -v -s tests/gpu/test_layer_gpu.py -k one_gpu
    ;;
  calls)
    TAIL=12 step kernel_one_gpu 500 python -m pytest -v -s tests/gpu/test_kernel.py -k one_gpu
    TAIL=40 step call_check 200 python -m megatron_tokenweave.bench call_check \
      --out "$out/call_check_1gpu.json"
    ;;
  padded)
    TAIL=8 step padded_tests 200 python -m pytest -v -s tests/gpu/test_gemm_fused.py \
      tests/gpu/test_op_checks.py -k "padded_rows or fit_gemm"
    TAIL=8 step padded_layer 300 python -m pytest -v -s tests/gpu/test_layer_gpu.py -k padded_rows
    TAIL=4 step padded_sweep 200 python -m megatron_tokenweave.bench gemm_fused --dtypes fp8 \
      --models qwen2.5-72b --iters 10 --out "$out/gemm_fused_1gpu_fp8_qwen2.5-72b.json"
    ;;
  gemm_diag)
    for m in llama-3-8b qwen2.5-7b qwen2.5-72b; do
      TAIL=30 step "gemm_diag_$m" 180 python -m megatron_tokenweave.bench gemm_fused --breakdown \
        --models "$m" --tp 2 8 --tokens 512 513 641 777 1024 1279 5003 --iters 10 \
        --out "$out/gemm_diag_1gpu_$m.json"
    done
    ;;
  gemm_diag_blocks)
    TAIL=30 step gemm_diag_blocks 540 python -m megatron_tokenweave.bench gemm_fused --breakdown \
      --dtypes fp8 fp8_blocks --models llama-3.3-70b --tp 2 8 --tokens 1000 4099 8192 \
      --iters 10 --out "$out/gemm_diag_fp8_blocks_1gpu.json"
    ;;
  gemm_blocks_wide)
    TAIL=4 step blocks_wide_test 300 python -m pytest -x -v tests/gpu/test_gemm_fused.py \
      tests/gpu/test_op_checks.py -k "fp8 or fit_gemm"
    TAIL=30 step blocks_wide 300 python -m megatron_tokenweave.bench gemm_fused --breakdown \
      --dtypes fp8_blocks --models llama-3.3-70b --tp 2 8 --tokens 1000 4099 8192 \
      --iters 10 --out "$out/gemm_blocks_wide_1gpu.json"
    ;;
  serve_hybrid)
    TAIL=14 step serve_hybrid 560 python -m pytest -v -rs tests/gpu/test_serving_gpu.py \
      -k "not soak and not sigterm"
    ;;
  more)
    TAIL=20 step layer_tests 150 python -m pytest -v -s tests/gpu/test_layer_gpu.py -k "not te_spec"
    ;;
esac
done
exit 0
