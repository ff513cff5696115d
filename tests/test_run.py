"""The command line (run.py): JSON output equals minispec.generate, --show rendering, clean errors.

The tiny checkpoints have no tokenizer files, so prompts are given as --prompt-ids."""

import dataclasses
import inspect
import json
import os
import re
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_reference, save_reference

import minispec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402

PROMPT = [5, 17, 33, 8, 5, 17]
PROMPT_FLAG = ["--prompt-ids", ",".join(map(str, PROMPT))]


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    return str(save_reference(make_reference("gpt2"), tmp_path_factory.mktemp("run_gpt2")))


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    """A GPT-2 with 64 tokens instead of conftest's 96: not a valid draft for the others."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                                     bos_token_id=1, eos_token_id=2)
    return str(save_reference(transformers.GPT2LMHeadModel(config).eval(), tmp_path_factory.mktemp("vocab64")))


def run_json(capsys, *argv):
    assert run.main([*argv, "--device", "cpu", "--json"]) == 0
    stdout = capsys.readouterr().out
    return json.loads(stdout)  # fails unless stdout is exactly one JSON object


def test_trees_are_the_default_and_a_fixed_gamma_keeps_algorithm_1s_chains(gpt2_dir, capsys):
    """--tree defaults to auto, as generate's and the server's do: the policy chooses a tree or a chain
    each step under --gamma auto; under a fixed gamma every step is a chain; --tree off: chains."""
    from minispec.serve.__main__ import parse_args as serve_args
    assert run.parse_args(["--target", gpt2_dir, *PROMPT_FLAG]).tree == "auto"
    assert run.parse_args(["--target", gpt2_dir, *PROMPT_FLAG, "--tree", "off"]).tree is None
    assert serve_args(["--target", gpt2_dir]).tree == "auto"
    assert inspect.signature(minispec.generate).parameters["tree"].default == "auto"
    fixed = run_json(capsys, "--target", gpt2_dir, *PROMPT_FLAG, "--draft", "lookup", "--gamma", "3")
    assert fixed["stats"]["target_calls"] > 1 and "tree_nodes" not in fixed["stats"]


def test_json_equals_generate(gpt2_dir, capsys):
    target = minispec.load(gpt2_dir, device="cpu")
    settings = dict(max_new_tokens=20, temperature=0.9, top_k=30, top_p=0.95, seed=7, gamma=3, ignore_eos=True)
    flags = ["--max-new-tokens", "20", "--temperature", "0.9", "--top-k", "30", "--top-p", "0.95", "--seed", "7",
             "--gamma", "3", "--ignore-eos"]
    drafts = {"none": None, gpt2_dir: minispec.load(gpt2_dir, device="cpu"), "ngram": "ngram"}
    for draft, draft_arg in drafts.items():
        out = run_json(capsys, "--target", gpt2_dir, "--draft", draft, *PROMPT_FLAG, *flags)
        expected = minispec.generate(target, PROMPT, draft=draft_arg, **settings)
        assert out["tokens"] == expected.tokens
        assert len(out["tokens"]) == 20
        assert out["text"] is None
        assert (out["target"], out["draft"]) == (gpt2_dir, draft)
        assert (out["temperature"], out["top_k"], out["top_p"], out["seed"], out["gamma"]) == (0.9, 30, 0.95, 7, 3)
        assert out["stats"].keys() == expected.stats.keys()
        assert out["stats"]["new_tokens"] == 20


def test_same_checkpoint_draft_is_exact_and_always_accepted(gpt2_dir, capsys):
    common = ["--target", gpt2_dir, *PROMPT_FLAG, "--max-new-tokens", "24", "--ignore-eos"]
    plain = run_json(capsys, *common)
    spec = run_json(capsys, *common, "--draft", gpt2_dir, "--gamma", "4")
    assert spec["tokens"] == plain["tokens"]
    assert len(set(plain["tokens"])) > 1
    stats = spec["stats"]
    assert stats["acceptance_rate"] == 1.0
    assert stats["accepted"] == stats["verified"] == stats["proposed"] > 0
    # 24 tokens with gamma 4: steps of 5 tokens (the first verified in the prompt's forward), the last
    # one shortened to fit max_new_tokens.
    assert stats["target_calls"] == 5
    assert stats["tokens_per_target_call"] == pytest.approx(24 / 5)
    for key in ("draft_calls", "alpha", "accepted_lengths", "encoder_calls", "draft_encoder_calls",
                "seconds", "tokens_per_second"):
        assert key in stats
    assert "acceptance_rate" not in plain["stats"]


def test_lookup_draft(gpt2_dir, capsys):
    common = ["--target", gpt2_dir, *PROMPT_FLAG, "--max-new-tokens", "30", "--ignore-eos"]
    plain = run_json(capsys, *common)
    lookup = run_json(capsys, *common, "--draft", "lookup")
    assert lookup["tokens"] == plain["tokens"]
    assert lookup["draft"] == "lookup"
    assert lookup["stats"]["proposed"] > 0


def test_compare_repeats_each_side_in_turn_and_reports_medians_and_spread(gpt2_dir, capsys, monkeypatch):
    """--compare: after a short warm-up of each side, --repeats runs of each, taking turns; the speedup
    is the ratio of their median tokens/s, and the summary gives each side's median and range."""
    calls, generate = [], minispec.generate
    monkeypatch.setattr(minispec, "generate", lambda target, prompt, draft=None, **settings: calls.append(
        (draft, settings["max_new_tokens"])) or generate(target, prompt, draft=draft, **settings))
    common = ["--target", gpt2_dir, *PROMPT_FLAG, "--draft", "lookup", "--max-new-tokens", "8", "--compare"]
    out = run_json(capsys, *common, "--repeats", "3")
    assert calls == [("lookup", 2), (None, 2)] + [("lookup", 8), (None, 8)] * 3
    speeds, baselines = out["tokens_per_second"], out["baseline_tokens_per_second"]
    assert len(speeds) == len(baselines) == 3 and speeds[0] == out["stats"]["tokens_per_second"]
    assert out["speedup"] == pytest.approx(statistics.median(speeds) / statistics.median(baselines))
    calls.clear()
    assert run.main([*common, "--device", "cpu", "--repeats", "2"]) == 0
    assert calls == [("lookup", 2), (None, 2), (None, 8), ("lookup", 8), (None, 8)]  # and the streamed first run
    summary = capsys.readouterr().err
    assert re.search(r"x the speed of decoding without the draft, median of 2 runs each: [\d.]+ tokens/s "
                     r"\([\d.]+-[\d.]+\) against [\d.]+ tokens/s \([\d.]+-[\d.]+\), same output$", summary.strip())


def test_compiled_run_gives_the_same_tokens(gpt2_dir, capsys):
    flags = ["--target", gpt2_dir, "--draft", gpt2_dir, *PROMPT_FLAG, "--max-new-tokens", "12", "--gamma", "3",
             "--ignore-eos", "--threads", "1"]
    compiled = run_json(capsys, *flags, "--compile")
    assert compiled["tokens"] == run_json(capsys, *flags)["tokens"]
    assert compiled["stats"]["acceptance_rate"] == 1.0


def test_plain_and_show_output_without_tty(gpt2_dir, capsys):
    common = ["--target", gpt2_dir, *PROMPT_FLAG, "--max-new-tokens", "16", "--ignore-eos", "--device", "cpu",
              "--draft", "ngram"]
    tokens = run_json(capsys, *common)["tokens"]

    assert run.main(common) == 0
    out, err = capsys.readouterr()
    assert out.strip() == ",".join(map(str, tokens))  # no tokenizer: the ids
    assert "16 new tokens" in err and "tokens/s" in err and "acceptance rate" in err

    assert run.main([*common, "--show"]) == 0
    out = capsys.readouterr().out
    assert "\033" not in out
    assert "[~" in out  # the tiny model rejects some bigram guesses
    shown = re.sub(r"\[~.*?~\]", " ", out).split()  # drop rejected drafts (a tree's: a|b): the generated ids remain
    assert [int(x) for x in shown] == tokens


def render_trace(trace, text, colour):
    """A whole Generation.trace, as --show prints it."""
    return run.render_pieces(run.segment_pieces(trace, text), colour) + text.flush()


def test_render_trace_colours():
    trace = [([1, 2], "target"), ([3], "accepted"), ([4], "rejected"), ([5], "corrected")]
    coloured = render_trace(trace, run.TokenIds(" "), colour=True)
    assert coloured == ("\033[34m1 2\033[0m" "\033[32m 3\033[0m" "\033[31;9m4\033[0m" "\033[34m 5\033[0m")
    assert render_trace(trace, run.TokenIds(" "), colour=False) == "1 2 3[~4~] 5"
    assert render_trace(trace, run.TokenIds(","), colour=False) == "1,2,3[~4~],5"


def test_render_trace_shows_a_trees_rejected_candidates():
    """A token tree's step: the accepted path, then every candidate rejected where it ends, as
    alternatives a|b (at most SHOWN_CANDIDATES, then …), then the target's token."""
    trace = [([3], "accepted"), ([4, 6], "rejected"), ([5], "corrected"), ([7, 8, 9, 10], "rejected"),
             ([11], "corrected")]
    assert render_trace(trace, run.TokenIds(" "), colour=False) == "3[~4|6~] 5[~7|8|9|…~] 11"
    coloured = render_trace(trace[:3], run.TokenIds(" "), colour=True)
    assert coloured == "\033[32m3\033[0m" "\033[31;9m4|6\033[0m" "\033[34m 5\033[0m"


def test_show_under_a_tree_prints_the_rejected_candidates(gpt2_dir, capsys):
    """run.py --show --tree on the tiny GPT-2 with ngram trees: the whole output, fixed (greedy, fixed
    weights). Where a step's accepted path ends, every successor the tree offered there is shown
    rejected: after a token never followed yet, the most counted of all (5|17|8, the likeliest 8 nodes
    holding three of them); after the accepted 27, the two tokens seen after 27 (17|27). Without them,
    the output is plain greedy decoding's. The summary counts the tree nodes verified."""
    flags = ["--target", gpt2_dir, *PROMPT_FLAG, "--max-new-tokens", "12", "--ignore-eos", "--device", "cpu"]
    assert run.main([*flags, "--draft", "ngram", "--gamma", "3", "--tree", "8", "--show"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"tokens per target call, \d+ tree nodes verified$", err.strip())
    assert out == ("[~33~]42[~5|17|8~] 73[~5|17|8~] 84[~5|17|8~] 27[~5|17|8~] 27[~27~] 17[~33|42~] "
                   "64[~17|5|27|…~] 64[~64~] 84 27[~17|27~] 84 43\n")
    plain = run_json(capsys, *flags)["tokens"]
    assert [int(x) for x in re.sub(r"\[~.*?~\]", " ", out).split()] == plain


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-k", "-1"], "top_k"),
    (["--draft", "lookup", "--gamma", "0"], "gamma"),
    (["--draft", "lookup", "--lenience", "0"], "lenience"),
    (["--draft", "lookup", "--lenience", "1.5"], "lenience"),
    (["--draft", "./nope"], "nope does not exist"),
    (["--max-new-tokens", "0"], "max_new_tokens"),
    (["--threads", "0"], "threads"),
    (["--threads", "100000"], "--threads must be between 1 and this machine's"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--compare", "--repeats", "0"], "--repeats must be >= 1"),
    (["--prompt", "a", "--prompt", "b", "--show"], "--show and --compare take one prompt"),
    (["--prompt", "a", "--prompt", "b", "--compare"], "--show and --compare take one prompt"),
    (["--prompt", "a\udcffb"], "--prompt is not UTF-8 text: byte 0xff at character 1"),
    (["--stop", "\udcfe"], "--stop is not UTF-8 text: byte 0xfe at character 0"),
    (["--max-new-tokens", "200"], "context of 128"),
    (["--prompt-ids", ",".join(["3"] * 129)], "longer than"),
    (["--prompt", "hello"], "tokenizer"),
    (["--prompt-ids", "3,96"], "[0, 96)"),
    (["--device", "nonsense"], "device 'nonsense' is not a torch device"),
    (["--device", "cuda:7"] if not torch.cuda.is_available() else ["--device", "cuda:99"], "cuda"),
    (["--device", "mps"], "MPS (Apple's GPU) is not available"),
])
def test_bad_input_exits_2_with_message(gpt2_dir, capsys, monkeypatch, tmp_path, flags, message):
    monkeypatch.chdir(tmp_path)  # so ./nope surely does not exist
    prompt = [] if flags[0].startswith("--prompt") else PROMPT_FLAG
    assert run.main(["--target", gpt2_dir, "--device", "cpu", *prompt, *flags]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1  # one line, no traceback


def test_a_cuda_device_index_this_machine_lacks_is_named(gpt2_dir, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert run.main(["--target", gpt2_dir, *PROMPT_FLAG, "--device", "cuda:7"]) == 2
    err = capsys.readouterr().err
    assert err == "error: device cuda:7 does not exist: this machine has 2 CUDA device(s), cuda:0 to cuda:1\n"


def test_missing_target(tmp_path, capsys):
    assert run.main(["--target", str(tmp_path / "missing"), *PROMPT_FLAG]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "missing does not exist" in err


def test_vocabulary_mismatch_fails_before_generating(gpt2_dir, small_vocab_dir, capsys, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("generation started despite mismatched vocabularies")

    monkeypatch.setattr(sys.modules["minispec.decoding.engine"], "decode", must_not_run)
    assert run.main(["--target", gpt2_dir, "--draft", small_vocab_dir, "--device", "cpu", *PROMPT_FLAG]) == 2
    err = capsys.readouterr().err
    assert "different vocabularies" in err and "96 vs 64" in err


def run_cli(*argv):
    return subprocess.run([sys.executable, str(ROOT / "run.py"), "--device", "cpu", *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_end_to_end_subprocess(gpt2_dir, small_vocab_dir):
    # A fixed γ: a draft as large as its target is a borderline bet for "auto", which guessed in some
    # runs and not in others, on the machine's timing noise (before and after the verify-cost refit).
    result = run_cli("--target", gpt2_dir, "--draft", gpt2_dir, *PROMPT_FLAG, "--max-new-tokens", "12", "--gamma", "3",
                     "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    target = minispec.load(gpt2_dir, device="cpu")
    assert out["tokens"] == minispec.generate(target, PROMPT, max_new_tokens=12).tokens
    assert out["stats"]["acceptance_rate"] == 1.0

    result = run_cli("--target", gpt2_dir, "--draft", small_vocab_dir, *PROMPT_FLAG)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr and "vocabularies" in result.stderr


def test_stop_strings_and_tokens_from_the_command_line(llama_with_tokenizer, capsys):
    """Text prompts, printed as they are generated: the printed text is the output's, ending before
    the stop string; stop token ids end it like EOS."""
    common = ["--target", str(llama_with_tokenizer), "--prompt", "the cat sat", "--max-new-tokens", "40",
              "--ignore-eos", "--device", "cpu", "--draft", "lookup"]
    target = minispec.load(llama_with_tokenizer)
    plain = minispec.generate(target, "the cat sat", max_new_tokens=40, ignore_eos=True)
    stop = plain.text[len(plain.text) // 2:][:2]
    assert run.main([*common, "--stop", "no such text", "--stop", stop]) == 0
    out = capsys.readouterr().out
    assert out == plain.text[:plain.text.index(stop)] + "\n"
    token = plain.tokens[20]
    assert run.main([*common, "--stop-token-ids", str(token), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == plain.tokens[: plain.tokens.index(token) + 1]
    assert run.main([*common, "--system", "Be brief."]) == 2
    assert "--system needs a chat prompt" in capsys.readouterr().err


def test_several_prompts_are_decoded_together(gpt2_dir, llama_with_tokenizer, tmp_path, capsys):
    """--prompts-file (JSON lines of ids, or text lines) and a repeated --prompt: one output per prompt,
    each what that prompt gives alone."""
    prompts = [PROMPT, [9, 4, 9], [3, 3, 7, 11, 13]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    target = minispec.load(gpt2_dir)
    alone = [minispec.generate(target, p, max_new_tokens=8, draft="lookup").tokens for p in prompts]
    assert run.main(["--target", gpt2_dir, "--device", "cpu", "--prompts-file", str(path), "--max-new-tokens", "8",
                     "--draft", "lookup", "--batch-size", "2", "--json"]) == 0
    assert [out["tokens"] for out in json.loads(capsys.readouterr().out)] == alone

    llama = minispec.load(llama_with_tokenizer)
    texts = ["the cat sat", "a dog ran"]
    expected = [minispec.generate(llama, t, max_new_tokens=6, ignore_eos=True).text for t in texts]
    (tmp_path / "texts.txt").write_text("\n".join(texts) + "\n")
    for flags in (["--prompt", texts[0], "--prompt", texts[1]], ["--prompts-file", str(tmp_path / "texts.txt")]):
        assert run.main(["--target", str(llama_with_tokenizer), "--device", "cpu", *flags, "--max-new-tokens", "6",
                         "--ignore-eos"]) == 0
        captured = capsys.readouterr()
        assert captured.out == "".join(f"[{i}] {text}\n" for i, text in enumerate(expected))
        assert "2 prompts, 12 new tokens in" in captured.err
    assert run.main(["--target", gpt2_dir, "--device", "cpu", "--prompts-file", str(tmp_path / "none.txt")]) == 2
    assert "error: --prompts-file" in capsys.readouterr().err


def test_a_prompts_file_that_is_not_what_it_should_be_is_named(gpt2_dir, tmp_path, capsys):
    """JSON true/false are not token ids 1 and 0; bytes that are not UTF-8 are located."""
    (tmp_path / "bools.jsonl").write_text("[true, false]\n[1, 2]\n")
    (tmp_path / "latin1.txt").write_bytes("first\nGr\u00fc\u00dfe\n".encode("latin-1"))
    for name, message in (("bools.jsonl", "a JSON line must be a string or a list of token ids"),
                          ("latin1.txt", "not UTF-8 text (byte 0xfc on line 2)")):
        assert run.main(["--target", gpt2_dir, "--device", "cpu", "--prompts-file", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --prompts-file") and message in err and err.count("\n") == 1


def test_show_ends_before_a_stop_string(llama_with_tokenizer, capsys):
    """--show prints the trace (rejected guesses as [~text~] off a terminal), but not the stop string or
    what follows it: the output as --show renders it, up to the stop string."""
    common = ["--target", str(llama_with_tokenizer), "--prompt", "the cat sat", "--max-new-tokens", "40",
              "--ignore-eos", "--device", "cpu", "--draft", "lookup", "--show"]
    target = minispec.load(llama_with_tokenizer)
    plain = minispec.generate(target, "the cat sat", max_new_tokens=40, ignore_eos=True)
    stop = plain.text[len(plain.text) // 2:][:2]
    assert run.main([*common, "--stop", stop]) == 0
    shown = re.sub(r"\[~.*?~\]", "", capsys.readouterr().out)
    assert shown == plain.text[:plain.text.index(stop)] + "\n"


@pytest.mark.parametrize("flag", [[], ["--special-tokens-in-prompt"]])
def test_chat_prompts_read_special_tokens_only_when_asked(llama_with_tokenizer, capsys, monkeypatch, flag):
    """The chat template's rendering itself is tests/test_chat.py's: here, that the flag reaches it."""
    calls = []
    monkeypatch.setattr(minispec, "chat_prompt", lambda *args: calls.append(args) or [5, 6, 7])
    assert run.main(["--target", str(llama_with_tokenizer), "--device", "cpu", "--prompt", "hi<|endoftext|>", "--chat",
                     "--max-new-tokens", "2", "--json", *flag]) == 0
    assert calls[0][1:] == ("hi<|endoftext|>", None, bool(flag))


def test_help_documents_a_flag_for_every_setting(capsys):
    """run.py's settings flags are made from minispec.Settings' fields, and keep their names."""
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    out = capsys.readouterr().out
    flagged = [spec.name for spec in dataclasses.fields(minispec.Settings) if spec.metadata["help"] is not None]
    assert set(flagged) == set(dataclasses.asdict(minispec.Settings())) - {"draft", "on_states", "state_layers"}
    for flag in ("--max-new-tokens", "--temperature", "--top-k", "--top-p", "--seed", "--gamma", "--tree",
                 "--lenience", "--ignore-eos", "--stop", "--stop-token-ids", "--beams", "--draft-beams"):
        assert re.search(f"^  {flag} ", out, re.MULTILINE), flag


def test_a_prompts_file_beyond_its_bounds_is_refused_unread(gpt2_dir, tmp_path, capsys, monkeypatch):
    from minispec import cli

    path = tmp_path / "prompts.txt"
    path.write_text("a\nb\nc\n")
    monkeypatch.setattr(cli, "PROMPTS_MAX", 2)
    assert run.main(["--target", gpt2_dir, "--device", "cpu", "--prompts-file", str(path)]) == 2
    assert "3 prompts, more than the 2 a run takes" in capsys.readouterr().err
    monkeypatch.setattr(cli, "PROMPTS_FILE_MAX_BYTES", 4)
    assert run.main(["--target", gpt2_dir, "--device", "cpu", "--prompts-file", str(path)]) == 2
    assert capsys.readouterr().err == f"error: --prompts-file {path}: larger than 0 MiB\n"


def test_a_run_exits_without_the_teardown_once_its_exit_hooks_ran(gpt2_dir, tmp_path):
    """run.py ends with os._exit (cli.exit_now) after a load: its output whole, its status, and what the exit hooks
    keep (the suffix drafter's store, saved by a finalizer at exit) all there."""
    flags = ["--target", gpt2_dir, "--device", "cpu", *PROMPT_FLAG, "--max-new-tokens", "8", "--ignore-eos"]
    done = subprocess.run([sys.executable, "run.py", *flags, "--draft", "suffix", "--json"], cwd=ROOT, timeout=300,
                          capture_output=True, text=True, env={**os.environ, "MINISPEC_PROFILES": str(tmp_path)})
    assert done.returncode == 0 and len(json.loads(done.stdout)["tokens"]) == 8, done.stderr
    assert len([path for path in tmp_path.iterdir() if path.name.startswith("suffix-")]) == 1
    code = ("import atexit, sys, torch; from minispec.cli import exit_now; atexit.register(print, 'hook', flush=True); "
            "sys.stdout.write('unflushed'); exit_now(3)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (3, "unflushedhook\n"), done.stderr


# run.py with each step of its stream slowed down, so that a signal surely comes mid-generation.
SLOW_RUN = """
import runpy, sys, time
import minispec
stream = minispec.stream
def slow(*args, **kwargs):
    for chunk in stream(*args, **kwargs):
        time.sleep(0.05)
        yield chunk
minispec.stream = slow
sys.argv = ["run.py", *sys.argv[1:]]
runpy.run_path("run.py", run_name="__main__")
"""


def slow_run(gpt2_dir):
    """A run as a terminal starts it: Ctrl-C reaches it even where the suite itself runs as a background job,
    whose children inherit SIGINT ignored (and Python then keeps it ignored). Its threads are chosen, so that a
    busy machine's line about free CPUs is not among what its stderr is checked for."""
    return subprocess.Popen([sys.executable, "-c", SLOW_RUN, "--target", gpt2_dir, "--device", "cpu", *PROMPT_FLAG,
                             "--max-new-tokens", "100", "--ignore-eos", "--threads", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_ctrl_c_ends_a_run_with_status_130_and_one_line(gpt2_dir):
    process = slow_run(gpt2_dir)
    process.stdout.read(1)  # generating
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130 and err.decode() == "interrupted\n", err.decode()[-500:]


def test_a_closed_pipe_ends_a_run_quietly(gpt2_dir):
    """`run.py ... | head -c 10`: once its reader has gone, the run ends without a word."""
    process = slow_run(gpt2_dir)
    process.stdout.read(10)
    process.stdout.close()
    err = process.stderr.read()
    assert process.wait(timeout=120) == 128 + signal.SIGPIPE and err == b"", err.decode()[-500:]


def test_chat_template_kwargs_reach_the_template(llama_with_tokenizer, tmp_path, capsys):
    """--chat-template-kwargs: the template's own variables (Qwen3's enable_thinking), as chat_prompt takes
    them; names chat_prompt sets itself, or text that is not a JSON object, end in one line."""
    from test_chat import REAL

    directory = tmp_path / "qwen3_chat"
    directory.mkdir()
    for file in Path(llama_with_tokenizer).iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    (directory / "chat_template.jinja").write_text(REAL["qwen3"], encoding="utf-8")
    common = ["--target", str(directory), "--prompt", "the cat", "--max-new-tokens", "4", "--ignore-eos", "--json"]
    assert run.main([*common, "--chat-template-kwargs", '{"enable_thinking": false}']) == 0
    out = json.loads(capsys.readouterr().out)
    model = minispec.load(directory)
    ids = minispec.chat_prompt(model.tokenizer, "the cat", enable_thinking=False)
    assert ids != minispec.chat_prompt(model.tokenizer, "the cat")  # the variable changes the prompt
    assert out["tokens"] == minispec.generate(model, ids, max_new_tokens=4, ignore_eos=True).tokens
    for bad, message in (('{"messages": []}', "'messages' is set by run.py"), ("[1]", "expected a JSON object")):
        with pytest.raises(SystemExit) as exit:
            run.main([*common, "--chat-template-kwargs", bad])
        assert exit.value.code == 2 and message in capsys.readouterr().err
