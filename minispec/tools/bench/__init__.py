"""Benchmark: autoregressive vs speculative decoding side by side, against the paper's Theorem 3.8
(`python -m minispec.tools.bench --target gpt2-large --draft gpt2 --gamma 2 4 8`): a markdown table on stdout,
every number in a JSON file; `--help` lists the other benchmarks."""
