"""Benchmark: autoregressive vs speculative decoding side by side, against the paper's Theorem 3.8.

    python -m minispec.tools.bench --target gpt2-large --draft gpt2 --gamma 2 4 8

It prints a markdown table (tokens/s, α, the cost ratio c, the speedup beside its prediction and section 3.5's
best γ) and writes every number to a JSON file; `--help` lists the other benchmarks.
"""
