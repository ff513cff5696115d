"""llama.cpp as a peer in the bench (`--llama-cpp [DIR]`, binaries a user built; never a dependency): its plain,
speculative and prompt-lookup decoding of the same GGUF files and prompts in the same rounds as minispec's
decoders, each mode's decode phase as llama.cpp reports it."""

import re
import shutil
import subprocess
import time
from pathlib import Path

PROGRAMS = {"plain": "llama-completion", "speculative": "llama-speculative", "lookup": "llama-lookup"}
# What they print when done: the completion its context's perf line (the first token comes out of the
# prompt's forward), the other two their decode phase.
EVAL_LINE = re.compile(r"\S+:\s+eval time =\s+([\d.]+) ms /\s+(\d+) runs")
DECODED_LINE = re.compile(r"(?:^|\s)decoded\s+(\d+) tokens in\s+([\d.]+) seconds", re.M)
RUN_SECONDS = 600  # one request, however slow the model: past this the peer is hung


def find_programs(directory):
    """{mode: path} of the programs found in DIR, DIR/bin or DIR/build/bin (on PATH where DIR is ""); the
    plain one is needed."""
    if not directory:
        found = {mode: Path(path) for mode, name in PROGRAMS.items() if (path := shutil.which(name))}
        if "plain" not in found:
            raise ValueError(f"--llama-cpp: no {PROGRAMS['plain']} on PATH")
        return found
    directory = Path(directory).expanduser()
    folders = (directory, directory / "bin", directory / "build" / "bin")
    found = {mode: path for mode, name in PROGRAMS.items()
             if (path := next((folder / name for folder in folders if (folder / name).is_file()), None))}
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
        done = subprocess.run([str(program), *arguments], capture_output=True, text=True, errors="replace",
                              timeout=RUN_SECONDS)  # its text may cut a character: invalid UTF-8
    except subprocess.TimeoutExpired:
        raise ValueError(f"{program} took more than {RUN_SECONDS} s for one request") from None
    output = done.stdout + done.stderr
    found = (EVAL_LINE if mode == "plain" else DECODED_LINE).search(output)
    if done.returncode != 0 or found is None:
        last = output.strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{program} failed (exit {done.returncode}): {last[0]}")
    first, second = found.groups()  # plain: its milliseconds and runs; the others: tokens and seconds
    return (int(second), float(first) / 1e3) if mode == "plain" else (int(first), float(second))


def common_arguments(target, max_new_tokens, threads, seed, ignore_eos=True):
    """What every mode is given: greedy, EOS ignored as minispec ignores it, minispec's new tokens and threads."""
    return ["-m", str(target), "-n", str(max_new_tokens), "-t", str(threads), "--temp", "0",
            *(["--ignore-eos"] if ignore_eos else []), "-s", str(seed), "-c", "4096"]


PLAIN = ["-no-cnv", "--no-display-prompt"]  # the prompt as given (a chat turn already spelled out), not echoed


def peer_runners(directory, target, draft, texts, max_new_tokens, threads, seed, ignore_eos=True):
    """{mode: run_one} for time_generation: run_one((prompt ids, seed)) runs that mode's program on
    texts[tuple(prompt ids)], a placeholder per new token, all but the decode time it reports counted as
    prefill. Speculative only with a draft GGUF file."""
    programs = find_programs(directory)
    target, draft = check_files(target, draft)
    common = common_arguments(target, max_new_tokens, threads, seed, ignore_eos)
    extra = {"plain": PLAIN, "lookup": [], "speculative": ["-md", draft] if draft else None}

    def runner(mode, program):
        def run_one(request):
            start = time.perf_counter()
            decoded, seconds = decode_rate(program, [*common, *extra[mode], "-p", texts[tuple(request[0])]], mode)
            wall = time.perf_counter() - start
            # the first new token comes out of the prompt's forward, outside the decode phase
            return [0] * (decoded + 1), {"prefill_seconds": wall - seconds, "first_call_tokens": 1}
        return run_one

    return {mode: runner(mode, program) for mode, program in programs.items() if extra[mode] is not None}
