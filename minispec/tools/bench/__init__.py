"""Benchmark: autoregressive vs speculative decoding side by side, against the paper's Theorem 3.8.

    python -m minispec.tools.bench --target gpt2-large --draft gpt2 --gamma 2 4 8
    python -m minispec.tools.bench --target ./ckpt --draft lookup --prompt-ids 1,2,3,1,2 --compare-reference

For each γ it measures tokens/s of both decoders (median of --repeats timed passes over all prompts,
after one warm-up pass), end to end and for the decode phase after the prompt's forward; the measured
α, acceptance rate and tokens per target call; the cost ratio c = draft step / target step and the
verify cost of a (γ+1)-token target forward. It puts the decode-phase speedup next to Theorem 3.8's
prediction (1 - α^(γ+1)) / ((1 - α)(γc + 1)), splits their ratio into the factors that make it up,
and gives the γ that section 3.5 would pick. On CUDA it adds the target decode step's memory bandwidth
against the GPU's peak; with --memory-tokens, the peak memory of a short and a long generation.
Prints a markdown table and writes everything to a JSON file.

--compare-reference runs the reference implementation (transformers, imported only then) on the same
checkpoints and prompts: its greedy/sampled `generate` and its assisted generation, timed the same way.

The package, by concern: cli.py (the command line), prompts.py (the built-in prompts, prompts files),
benchmarks.py (the three benchmarks in one process), theory.py (Theorem 3.8 and section 3.5), timing.py (timing decoders and single forwards), memory.py
(bytes read per step, bandwidth, peak memory), reference.py (the reference implementation's runners),
oneshot.py (each request in a fresh process, as run.py runs it), threads.py (the default threads against
each --threads setting, one core busy), report.py (the markdown tables, progress bars).
"""
