"""Benchmarks: `python -m megatron_tokenweave.bench {kernel,block} [options]`."""
