"""Benchmark: autoregressive vs speculative decoding side by side, against the paper's Theorem 3.8.

    python -m minispec.tools.bench --target gpt2-large --draft gpt2 --gamma 2 4 8

For each γ: tokens/s of both decoders (median of --repeats rounds taken in turn, after a warm-up pass),
end to end and after the prompt's forward; α, tokens per target call, the cost ratio c and the verify
cost; the speedup beside Theorem 3.8's prediction, their ratio split into its factors, and section 3.5's
best γ. It prints a markdown table and writes every number to a JSON file. `--help` lists the other
benchmarks (batches, beams, drafters side by side, fresh processes, threads, llama.cpp, the reference).
"""
