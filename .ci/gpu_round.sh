#!/usr/bin/env bash
# One GPU round on the 2-GPU device machine (run from the repo root there, after the wheels of
# ../shared/device/stage.sh base were received): build, tune, benchmark, test. Results under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TOKENWEAVE_CACHE=/tmp/twcache
out=${OUT:-/tmp/out}; mkdir -p "$out" /tmp/logs
quiet() { grep -v "arn\|DEPRECATED\|func(\|^\s*$" ; }
step() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" 2>&1 | quiet | tee "/tmp/logs/$name.log" | tail -${TAIL:-12}; }
step build 240 python -m pip install -v --no-build-isolation --no-deps -e .
python -c "import megatron_tokenweave._C" && echo "extension built by setup.py" || echo "no _C: JIT"
step tune70 150 python -m megatron_tokenweave.tune --model llama-3.3-70b --budget-s 100
step tune8 120 python -m megatron_tokenweave.tune --model llama-3-8b --budget-s 80
TAIL=24 step block 240 python -m megatron_tokenweave.bench block --iters 15 --out "$out/block_tp2.json"
step layer_tests 200 python -m pytest -q -s tests/gpu/test_layer_gpu.py
step timeline 90 python -m megatron_tokenweave.bench timeline --out "$out/timeline_tp2.png"
step sanitizer 200 python -m pytest -q tests/gpu/test_sanitizer.py
tar -C /tmp -czf "$out/tables.tgz" twcache
tar -C /tmp -czf "$out/logs.tgz" logs
