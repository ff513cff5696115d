"""The benchmarks' results as markdown tables, and their progress while they run."""

import sys

from tqdm import tqdm


def progress(total, what):
    """A bar of the runs done, on stderr where it is a terminal (in a log, only lines of redraws)."""
    return tqdm(total=total, desc=f"bench: {what}", unit="run", leave=False, disable=not sys.stderr.isatty())


def md_table(header, rows):
    """A markdown table's lines: the header, its rule, a line for each row of cells."""
    lines = ["| " + " | ".join(map(str, cells)) + " |" for cells in (header, *rows)]
    return [lines[0], "|" + "---|" * len(header), *lines[1:]]


def dtype_name(model):
    return str(model.dtype).removeprefix("torch.")


def read(bandwidth):
    """A step's bytes and bandwidth against the device's measured read bandwidth (and datasheet peak)."""
    peak = f", {bandwidth['fraction_of_peak']:.0%} of {bandwidth['peak_bytes_per_s'] / 1e12:.2f} TB/s peak" \
        if bandwidth["fraction_of_peak"] else ""
    return (f"{bandwidth['bytes_per_step'] / 1e6:.3g} MB read, {bandwidth['achieved_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{bandwidth['fraction_of_limit']:.0%} of the {bandwidth['limit_bytes_per_s'] / 1e9:.1f} GB/s measured{peak}")


def peer_line(peer):
    """llama.cpp's modes (bench/llamacpp.py) and minispec against them."""
    return (f"llama.cpp, {peer['threads']} threads, decode phase: " + ", ".join(
        f"{mode} {m['tokens_per_second']:.1f} tok/s" for mode, m in peer["modes"].items())
        + f"; minispec's plain {peer['plain_vs_plain']:.2f}x its plain, minispec's best mode "
          f"{peer['best_vs_best']:.2f}x its best")


def markdown_table(result):
    """The main benchmark's report: its settings and single measurements, the table of γ rows, each fixed
    γ's departure from Theorem 3.8 in factors, and the speedup per prompt."""
    s, ar, rows = result["settings"], result["autoregressive"], result["rows"]
    seeds = f" x {s['seeds']} seeds" if s["seeds"] > 1 else ""
    weights = "".join(f", {role} {s[key]} weights"
                      for role, key in (("target", "quantize"), ("draft", "draft_quantize")) if s.get(key))
    compiled = ", compiled" if s["compile"] else ""
    bw, draft_bw, widths = result["memory_bandwidth"], result["draft_memory_bandwidth"], result.get("forward_bandwidth")
    memory, price, reference = result["memory"], result.get("row_invariance_price"), result.get("reference")
    growth = "" if not memory or memory["growth"] is None else f" (growth {memory['growth']:+.2%})"
    paragraphs = [
        f"target `{s['target']}`, draft `{s['draft']}` on {s['device']} ({s['dtype']}{weights}{compiled}): "
        f"{s['prompts']} prompts{seeds} x {s['max_new_tokens']} new tokens, temperature {s['temperature']}"
        f"{top_k_p(s)}, median of {s['repeats']}; step times at position {result['step_position']}",
        f"prompt forward (prefill): {result['prefill_s'] * 1e3:.1f} ms per prompt; tok/s and speedup count it, "
        "decode speedup and Theorem 3.8 (predicted) leave it out",
        f"warm-up pass over the prompts{' (compiling the graphs)' if compiled else ''}: plain "
        f"{ar['warmup_seconds']:.1f} s, then "
        + ", ".join(f"γ = {r['gamma']} {r['warmup_seconds']:.1f} s" for r in rows),
        bw and f"target decode step: {result['target_step_s'] * 1e3:.2f} ms, {read(bw)} ({bw['device_name']})",
        draft_bw and f"draft decode step: {step_ms(draft_bw):.2f} ms, {read(draft_bw)}",
        widths and "target forward by tokens fed (ms, share of the measured read bandwidth): " + ", ".join(
            f"{n}: {step_ms(w):.2f} ms {w['fraction_of_limit']:.0%}" for n, w in widths.items()),
        memory and f"peak memory: {memory['peak_short_bytes'] / 2**10:.1f} KiB of tensors alive at once while "
        f"generating {memory['short_tokens']} tokens, {memory['peak_long_bytes'] / 2**10:.1f} KiB for "
        f"{memory['long_tokens']}{growth}; "
        f"kept after them: {memory['kept_short_bytes']} and {memory['kept_long_bytes']} bytes",
        price and "row invariance: target forward with / without (ms): " + ", ".join(
            f"{n} tokens {price['with'][n] * 1e3:.1f} / {price['without'][n] * 1e3:.1f} "
            f"({price['with'][n] / price['without'][n]:.2f}x)" for n in price["with"]),
        result.get("llama_cpp") and peer_line(result["llama_cpp"]),
        reference and f"reference autoregressive: {reference['autoregressive']['tokens_per_second']:.1f} tokens/s, "
        f"identical to minispec: {yes_no(reference['autoregressive']['identical'])}"]
    lines = [line for paragraph in paragraphs if paragraph for line in (paragraph, "")]
    assisted = {r["gamma"]: r for r in reference["assisted"]} if reference else None
    header = ["γ", "AR tok/s", "spec tok/s", "speedup", "decode speedup", "α", "accept", "tok/call", "c",
              "verify cost", "predicted", "meas/pred", "best γ", "pred. at best γ"]
    header += ["ref assisted tok/s", "ref speedup", "ref identical"] if reference else []
    lines += md_table(header, (row_cells(result, r, assisted) for r in rows))
    fixed = [r for r in rows if r["gamma"] != "auto"]
    if fixed:
        lines += ["", "meas/pred = (tok/call after the prompt's forward ÷ i.i.d. expectation) × ((1 + γc) ÷ "
                  "(verify cost + γc)) × the rest (loop, syncs):"]
    for r in fixed:
        f = r["measured_over_predicted_factors"]
        lines.append(f"- γ = {r['gamma']}: {f['tokens_per_call']:.2f} × {f['verify_cost']:.2f} × {f['loop']:.2f} "
                     f"= {r['measured_over_predicted']:.2f}")
    for r in rows:
        if r["gamma"] == "auto":
            lines += ["", f"auto: guesses per step {r['guesses_histogram']} (0, 1, ...), expected "
                      f"{r['expected_tokens_per_call']:.2f} tokens per call, measured "
                      f"{r['tokens_per_target_call']:.2f}; its prediction is section 3.5's best fixed γ; acceptance "
                      "by the drafter's confidence (0-0.2, ..., 0.8-1): " + ", ".join(
                          "-" if rate is None else f"{rate:.2f}" for rate in r["acceptance_by_confidence"])]
    lines += ["", "speedup per prompt (end to end; median of the repeats / fastest against fastest):", ""]
    lines += md_table(["prompt", "AR tok/s", *(f"γ = {r['gamma']}" for r in rows)], (
        [f"prompt {i + 1}", f"{len(tokens) / ar['request_seconds'][i]:.1f}",
         *(f"{r['per_prompt_speedup'][i]:.2f}x / {r['per_prompt_speedup_fastest'][i]:.2f}x" for r in rows)]
        for i, tokens in enumerate(ar["outputs"])))
    return "\n".join(lines)


def step_ms(bandwidth):
    return bandwidth["bytes_per_step"] / bandwidth["achieved_bytes_per_s"] * 1e3


def row_cells(result, r, assisted):
    """A γ's row of the main table; `assisted`: the reference's assisted rows by γ, where compared."""
    gamma = f"auto (mean {r['mean_guesses']:.1f})" if r["gamma"] == "auto" else r["gamma"]
    cells = [gamma, f"{result['autoregressive']['tokens_per_second']:.1f}", f"{r['tokens_per_second']:.1f}",
             f"{r['speedup']:.2f}x", f"{r['decode_speedup']:.2f}x", f"{r['alpha']:.2f}", f"{r['acceptance_rate']:.2f}",
             f"{r['tokens_per_target_call']:.2f}", f"{r['c']:.3f}",
             f"{r['verify_cost_ratio']:.2f}" if "verify_cost_ratio" in r else "-",
             f"{r['predicted_speedup']:.2f}x", f"{r['measured_over_predicted']:.2f}", r["best_gamma"],
             f"{r['best_gamma_predicted_speedup']:.2f}x"]
    if assisted is None:
        return cells
    a = assisted.get(r["gamma"])
    return cells + ([f"{a['tokens_per_second']:.1f}", f"{a['speedup']:.2f}x", yes_no(a["identical"])] if a
                    else ["-", "-", "-"])


def top_k_p(settings):
    """", top-k 50, top-p 0.9" for the settings in force (greedy ignores both)."""
    if not settings["temperature"]:
        return ""
    return (f", top-k {settings['top_k']}" if settings["top_k"] else "") + \
        (f", top-p {settings['top_p']}" if settings["top_p"] < 1 else "")


def yes_no(value):
    return "n/a" if value is None else ("yes" if value else "NO")
