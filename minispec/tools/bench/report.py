"""The benchmarks' tables in markdown, and their progress while they run."""

import string
import sys

from tqdm import tqdm


def progress(total, what):
    """A bar of the runs done, on stderr where it is a terminal (in a log, only lines of redraws)."""
    return tqdm(total=total, desc=f"bench: {what}", unit="run", leave=False, disable=not sys.stderr.isatty())


def yes_no(value):
    return ("yes" if value else "NO") if isinstance(value, bool) else value


def cell(column, row):
    """A cell: a column's function of the row, or its format of the row's fields ("{speedup:.2f}x"), a truth
    value as yes/NO; "-" where the function gives None or a field is None or missing."""
    if callable(column):
        value = column(row)
        return "-" if value is None else str(yes_no(value))
    fields = [name for _, name, _, _ in string.Formatter().parse(column) if name]
    if any(row.get(name) is None for name in fields):
        return "-"
    return column.format(**{name: yes_no(value) for name, value in row.items()})


def md_table(columns, rows):
    """A markdown table's lines: the headers of `columns` [(header, cell's column)], the rule, a line of
    cells per row (a dict, or what the columns' functions read)."""
    lines = ["| " + " | ".join(map(str, line)) + " |"
             for line in ([header for header, _ in columns], *([cell(c, r) for _, c in columns] for r in rows))]
    return [lines[0], "|" + "---|" * len(columns), *lines[1:]]


def title(args, target=None, *more):
    """A table's first line: the models, the request, and whatever `more` adds."""
    on = f" on {target.device} ({dtype_name(target)})" if target is not None else ""
    return ", ".join([f"target `{args.target}`, draft `{args.draft}`{on}",
                      f"{args.max_new_tokens} new tokens a request", *more])


def dtype_name(model):
    return str(model.dtype).removeprefix("torch.")


def read(bandwidth):
    """A step's bytes and bandwidth against the device's measured read bandwidth (and datasheet peak)."""
    peak = f", {bandwidth['fraction_of_peak']:.0%} of {bandwidth['peak_bytes_per_s'] / 1e12:.2f} TB/s peak" \
        if bandwidth["fraction_of_peak"] else ""
    return (f"{bandwidth['bytes_per_step'] / 1e6:.3g} MB read, {bandwidth['achieved_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{bandwidth['fraction_of_limit']:.0%} of the {bandwidth['limit_bytes_per_s'] / 1e9:.1f} GB/s measured{peak}")


def step_ms(bandwidth):
    return bandwidth["bytes_per_step"] / bandwidth["achieved_bytes_per_s"] * 1e3


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
    weights = "".join(f", {role} {s[key]} weights"
                      for role, key in (("target", "quantize"), ("draft", "draft_quantize")) if s.get(key))
    sampled = (f", top-k {s['top_k']}" if s["top_k"] else "") + (f", top-p {s['top_p']}" if s["top_p"] < 1 else "")
    compiled, seeds = ", compiled" if s["compile"] else "", f" x {s['seeds']} seeds" if s["seeds"] > 1 else ""
    bw, draft_bw, widths = result["memory_bandwidth"], result["draft_memory_bandwidth"], result.get("forward_bandwidth")
    memory, price, reference = result["memory"], result.get("row_invariance_price"), result.get("reference")
    growth = "" if not memory or memory["growth"] is None else f" (growth {memory['growth']:+.2%})"
    paragraphs = [
        f"target `{s['target']}`, draft `{s['draft']}` on {s['device']} ({s['dtype']}{weights}{compiled}): "
        f"{s['prompts']} prompts{seeds} x {s['max_new_tokens']} new tokens, temperature {s['temperature']}"
        f"{sampled if s['temperature'] else ''}, median of {s['repeats']}; step times at position "
        f"{result['step_position']}",
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
        f"{memory['long_tokens']}{growth}; kept after them: {memory['kept_short_bytes']} and "
        f"{memory['kept_long_bytes']} bytes",
        price and "row invariance: target forward with / without (ms): " + ", ".join(
            f"{n} tokens {price['with'][n] * 1e3:.1f} / {price['without'][n] * 1e3:.1f} "
            f"({price['with'][n] / price['without'][n]:.2f}x)" for n in price["with"]),
        result.get("llama_cpp") and peer_line(result["llama_cpp"]),
        reference and f"reference autoregressive: {reference['autoregressive']['tokens_per_second']:.1f} tokens/s, "
        f"identical to minispec: {cell('{identical}', reference['autoregressive'])}"]
    lines = [line for paragraph in paragraphs if paragraph for line in (paragraph, "")]
    columns = [("γ", lambda r: f"auto (mean {r['mean_guesses']:.1f})" if r["gamma"] == "auto" else r["gamma"]),
               ("AR tok/s", f"{ar['tokens_per_second']:.1f}"), ("spec tok/s", "{tokens_per_second:.1f}"),
               ("speedup", "{speedup:.2f}x"), ("decode speedup", "{decode_speedup:.2f}x"), ("α", "{alpha:.2f}"),
               ("accept", "{acceptance_rate:.2f}"), ("tok/call", "{tokens_per_target_call:.2f}"), ("c", "{c:.3f}"),
               ("verify cost", "{verify_cost_ratio:.2f}"), ("predicted", "{predicted_speedup:.2f}x"),
               ("meas/pred", "{measured_over_predicted:.2f}"),
               ("best γ", "{best_gamma}"), ("pred. at best γ", "{best_gamma_predicted_speedup:.2f}x")]
    if reference:
        assisted = {a["gamma"]: a for a in reference["assisted"]}
        columns += [(header, lambda r, column=column: cell(column, assisted.get(r["gamma"], {})))
                    for header, column in (
            ("ref assisted tok/s", "{tokens_per_second:.1f}"), ("ref speedup", "{speedup:.2f}x"),
            ("ref identical", "{identical}"))]
    lines += md_table(columns, rows)
    fixed = [r for r in rows if r["gamma"] != "auto"]
    if fixed:
        lines += ["", "meas/pred = (tok/call after the prompt's forward ÷ i.i.d. expectation) × ((1 + γc) ÷ "
                  "(verify cost + γc)) × the rest (loop, syncs):"]
    lines += [f"- γ = {r['gamma']}: " + " × ".join(f"{f:.2f}" for f in r["measured_over_predicted_factors"].values())
              + f" = {r['measured_over_predicted']:.2f}" for r in fixed]
    lines += ["\n" + f"auto: guesses per step {r['guesses_histogram']} (0, 1, ...), expected "
              f"{r['expected_tokens_per_call']:.2f} tokens per call, measured {r['tokens_per_target_call']:.2f}; its "
              "prediction is section 3.5's best fixed γ; acceptance by the drafter's confidence (0-0.2, ..., 0.8-1): "
              + ", ".join("-" if rate is None else f"{rate:.2f}" for rate in r["acceptance_by_confidence"])
              for r in rows if r["gamma"] == "auto"]
    lines += ["", "speedup per prompt (end to end; median of the repeats / fastest against fastest):", ""]
    per_prompt = [{"i": i, "rate": len(tokens) / ar["request_seconds"][i]} for i, tokens in enumerate(ar["outputs"])]
    lines += md_table([("prompt", lambda p: f"prompt {p['i'] + 1}"), ("AR tok/s", "{rate:.1f}"), *(
        (f"γ = {r['gamma']}", lambda p, r=r: f"{r['per_prompt_speedup'][p['i']]:.2f}x / "
                                              f"{r['per_prompt_speedup_fastest'][p['i']]:.2f}x") for r in rows)],
                      per_prompt)
    return "\n".join(lines)
