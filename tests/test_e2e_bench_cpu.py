"""The end-to-end benchmark's own bookkeeping (bench/e2e.py), run on 2 gloo ranks with the tiny
shape through Megatron's static engine: every model and the no-communication ceiling get a row
per prompt length and per output length, and every model generates exactly the tokens asked
for. (Its GPU figures are in docs/results/; this checks what produces them.)"""

from __future__ import annotations

import torch
from _dist import run_ranks

ARGS = ["--model", "tiny", "--layers", "2", "--engine", "static", "--prefill-tokens", "6", "9",
        "--reps", "1", "--prompts", "5", "--mixed-min", "4", "--mixed-max", "12",
        "--output-tokens", "2", "5", "--max-batch", "2", "--chunk", "64",
        "--throughput-reps", "2"]


def _worker(rank: int, world: int) -> list[dict]:
    from megatron_tokenweave.bench import e2e
    from megatron_tokenweave.cpu_compat import cpu_inference_scope

    torch.manual_seed(11)
    with cpu_inference_scope():
        return e2e._run(rank, world, e2e.parse_args(ARGS))


def test_e2e_benchmark_rows_on_the_static_engine():
    from megatron_tokenweave.bench import e2e

    args = e2e.parse_args(ARGS)
    prompt_tokens = sum(len(p) for p in e2e._workload(args, buckets=True))
    impls = {"local", "tokenweave", "local_nocomm"}
    for rows in run_ranks(_worker):
        prefill = {(r["impl"], r["prompt_tokens"]): r for r in rows
                   if r["metric"] == "prefill_ms"}
        assert set(prefill) == {(i, t) for i in impls for t in (6, 9)}
        assert all(r["value"] > 0 and r["engine"] == "static" for r in prefill.values())
        tput = {(r["impl"], r["output_tokens"]): r for r in rows if r["metric"] == "tokens_per_s"}
        assert set(tput) == {(i, n) for i in impls for n in (2, 5)}
        for (_, n), row in tput.items():
            # No early stop: every model, the ceiling included, generates exactly n per prompt.
            assert row["generated_tokens"] == 5 * n
            assert row["prompt_tokens"] == prompt_tokens and row["prompts"] == 5
            assert row["value"] > 0 and row["engine"] == "static"
        assert all(r["model"] == "tiny" and r["layers"] == 2 and r["tp"] == 2 for r in rows)
