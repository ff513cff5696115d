"""llama.cpp as a peer in the bench (`--llama-cpp DIR`): its plain, speculative and prompt-lookup
decoding of the same GGUF files, prompts, number of new tokens and threads, in the same run. Never a
dependency: DIR holds llama.cpp binaries a user built (docs/performance.md, "Against llama.cpp", has the
recipe). Each mode's figure is its decode phase (the prompt's forward left out), as llama.cpp reports it,
so it is compared with minispec's decode tokens/s."""

import re
import statistics
import subprocess
from pathlib import Path

# llama.cpp's programs for each mode: a plain completion, a draft model's speculation, and prompt lookup
# (n-grams of the context: minispec's `lookup`).
PROGRAMS = {"plain": "llama-completion", "speculative": "llama-speculative", "lookup": "llama-lookup"}
# What they print when done, after a log prefix (a timestamp) or none: the completion its context's perf
# line (the first token comes out of the prompt's forward), the other two their decode phase.
EVAL_LINE = re.compile(r"\S+:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")
DECODED_LINE = re.compile(r"(?:^|\s)decoded\s+(\d+) tokens in\s+([\d.]+) seconds", re.M)
RUN_SECONDS = 600  # one request, however slow the model: past this the peer is hung


def find_programs(directory):
    """{mode: path} of the programs found in DIR, DIR/bin or DIR/build/bin; the plain one is needed."""
    directory = Path(directory).expanduser()
    found = {}
    for mode, name in PROGRAMS.items():
        found.update({mode: path for folder in (directory, directory / "bin", directory / "build" / "bin")
                      if (path := folder / name).is_file() and mode not in found})
    if "plain" not in found:
        raise ValueError(f"--llama-cpp {directory}: no {PROGRAMS['plain']} in it, its bin/ or build/bin/ "
                         "(build llama.cpp's llama-completion, llama-speculative and llama-lookup targets)")
    return found


def check_files(target, draft):
    """The GGUF files llama.cpp reads: the target's, and a draft model's if it is one (else None)."""
    if not str(target).endswith(".gguf") or not Path(target).expanduser().is_file():
        raise ValueError(f"--llama-cpp needs --target as a GGUF file (llama.cpp reads it too), got {target}")
    return str(target), str(draft) if str(draft).endswith(".gguf") and Path(draft).expanduser().is_file() else None


def decode_rate(program, arguments, mode):
    """(new tokens, seconds) of the decode phase of one llama.cpp run."""
    try:
        done = subprocess.run([str(program), *arguments], capture_output=True, text=True, timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{program} took more than {RUN_SECONDS} s for one request") from None
    output = done.stdout + done.stderr
    found = (EVAL_LINE if mode == "plain" else DECODED_LINE).search(output)
    if done.returncode != 0 or found is None:
        last = output.strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{program} failed (exit {done.returncode}): {last[0]}")
    if mode == "plain":
        milliseconds, runs = found.groups()
        return int(runs), float(milliseconds) / 1e3
    tokens, seconds = found.groups()
    return int(tokens), float(seconds)


def peer_benchmark(directory, target, draft, prompts, max_new_tokens, repeats, threads, seed):
    """llama.cpp's decode tokens/s per mode (median of `repeats` passes over the text `prompts`, greedy,
    EOS ignored), {mode: {"tokens_per_second", "tokens_per_second_repeats", "program"}}; speculative
    only with a draft GGUF file."""
    programs = find_programs(directory)
    target, draft = check_files(target, draft)
    common = ["-m", target, "-n", str(max_new_tokens), "-t", str(threads), "--temp", "0", "--ignore-eos",
              "-s", str(seed), "-c", "4096"]
    extra = {"plain": ["-no-cnv", "--no-display-prompt"], "lookup": [],
             "speculative": ["-md", draft] if draft else None}
    result = {}
    for mode, program in programs.items():
        if extra[mode] is None:
            continue
        rates = []
        for _ in range(repeats):
            runs = [decode_rate(program, [*common, *extra[mode], "-p", prompt], mode) for prompt in prompts]
            rates.append(sum(tokens for tokens, _ in runs) / sum(seconds for _, seconds in runs))
        result[mode] = {"tokens_per_second": statistics.median(rates), "tokens_per_second_repeats": rates,
                        "program": str(program)}
    return result
