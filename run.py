"""Command line for minispec: generate from a target model, speculatively when given a draft.

    python run.py                       # the demo: DEFAULT_ARGS below (fetches SmolLM2-135M-Instruct once)
    python run.py --target gpt2-large --draft gpt2 --prompt "Once upon a time" --show
"""

import argparse
import json
import os
import statistics
import sys
import time

# What the flags need, none of it torch, so that --help and a bad flag answer at once.
import minispec
from minispec.cli import (AT_LEAST_ONE, add_model_flags, add_setting_flags, check_threads, check_values, exit_now,
                          exit_status, read_prompts_file, settings_of, tp_rank)
from minispec.settings import flag_type, token_ids

# ANSI colours of the paper's Figure 1: accepted guesses green, rejected ones red (struck through), the target's blue.
COLOURS = {"accepted": "\033[32m", "rejected": "\033[31;9m", "corrected": "\033[34m", "target": "\033[34m"}
RESET = "\033[0m"
# A token tree's rejected candidates shown at a step, as alternatives a|b|c: more would bury the output.
SHOWN_CANDIDATES = 3


# `python run.py` alone: the built-in model summarizes a text with the lookup drafter (the answer copies
# phrases from the prompt, which lookup proposes), coloured, and timed against plain decoding.
DEFAULT_PROMPT = (
    "Summarize this text in two sentences: The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars "
    "in Paris, France. It is named after the engineer Gustave Eiffel, whose company designed and built the tower "
    "from 1887 to 1889. Locally nicknamed La dame de fer (French for Iron Lady), it was constructed as the "
    "centerpiece of the 1889 World's Fair."
)
DEFAULT_ARGS = ["--target", "smollm2-135m-instruct", "--draft", "lookup", "--prompt", DEFAULT_PROMPT,
                "--max-new-tokens", "128", "--show", "--compare"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Speculative decoding (Leviathan et al. 2023) with minispec.",
        epilog="Without arguments: the demo, " + " ".join(DEFAULT_ARGS[:4] + ["--prompt", "'Summarize ...'"]
                                                          + DEFAULT_ARGS[6:]))
    add_model_flags(parser, draft_default="none", tensor_parallel=True)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", action="append",
                        help="prompt text (needs tokenizer files in the target checkpoint); repeat the flag to "
                             "decode several prompts together")
    prompt.add_argument("--prompt-ids", type=token_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    prompt.add_argument("--prompts-file", metavar="FILE",
                        help="one prompt a line, or JSON lines (a string, or a list of token ids), decoded together")
    parser.add_argument("--batch-size", type=int,
                        help="with several prompts: how many are decoded at once (default: all)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction,
                        help="wrap --prompt as the user's turn in the checkpoint's chat template (default: on when "
                             "the checkpoint has one, i.e. for instruct/chat models)")
    parser.add_argument("--compare", action="store_true",
                        help="also decode without the draft (same settings) and report the speedup")
    parser.add_argument("--repeats", type=int, default=3,
                        help="with --compare: decode each side this many times, taking turns, and report the median "
                             "and the spread (default 3)")
    add_setting_flags(parser)  # --max-new-tokens, --temperature, ...: one for each of minispec.Settings' fields
    parser.add_argument("--system", metavar="TEXT", help="a system prompt before --prompt in the chat template")
    parser.add_argument("--chat-template-kwargs", type=template_variables, default={}, metavar="JSON",
                        help="the chat template's own variables, as a JSON object: '{\"enable_thinking\": false}'")
    parser.add_argument("--special-tokens-in-prompt", action="store_true",
                        help="with --chat: read special tokens' text typed in --prompt and --system (<|im_end|>) as "
                             "those tokens, as the reference implementation does (default: plain text, so a "
                             "prompt cannot end its turn and write others')")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print one JSON object: tokens, text, stats, settings")
    output.add_argument("--show", action="store_true",
                        help="print the output coloured like Figure 1 of the paper: accepted draft tokens green, "
                             "rejected drafts red and struck through, the target's tokens blue; with --tree, the "
                             "candidates rejected where the accepted path ends, as a|b|c. When stdout is not a "
                             "terminal the text is plain and each rejected draft appears as [~text~] (a tree's as "
                             "[~a|b|c~]) before the token that replaced it.")
    return parser.parse_args(argv)


class TokenIds:
    """Stands in for an IncrementalDecoder when the checkpoint has no tokenizer: the ids themselves."""

    def __init__(self, separator):
        self.separator, self.started = separator, False

    def decode(self, ids):
        return self.separator.join(map(str, ids))

    def push(self, ids):
        text = (self.separator if self.started and ids else "") + self.decode(ids)
        self.started = self.started or bool(ids)
        return text

    def flush(self):
        return ""


def segment_pieces(segments, text):
    """Trace segments as (text, kind) pieces: `text` (an IncrementalDecoder, or TokenIds) decodes the output as it
    grows, so a character split between segments comes out whole; rejected guesses, not output, alone."""
    return [(rejected_text(ids, text) if kind == "rejected" else text.push(ids), kind) for ids, kind in segments]


def rejected_text(ids, text):
    """A step's rejected candidates (a chain's guess, a tree's several) as a|b|c, a|b|c|… past SHOWN_CANDIDATES."""
    shown = [text.decode([token]) for token in ids[:SHOWN_CANDIDATES]]
    return "|".join(shown + ["…"] * (len(ids) > SHOWN_CANDIDATES))


def render_pieces(pieces, colour):
    """Pieces coloured like Figure 1, or, without colour, each step's rejected guesses as [~text~]."""
    return "".join((COLOURS[kind] + piece + RESET if piece else piece) if colour else
                   f"[~{piece}~]" if kind == "rejected" else piece for piece, kind in pieces)


def until_stop(pieces, stops):
    """The pieces up to where the output's first stop string begins."""
    output = "".join(piece for piece, kind in pieces if kind != "rejected")
    end = min((i for i in (output.find(stop) for stop in stops) if i >= 0), default=None)
    if end is None:
        return pieces
    kept, length = [], 0
    for piece, kind in pieces:
        if length >= end:
            break
        if kind != "rejected":
            piece = piece[:end - length]
            length += len(piece)
        kept.append((piece, kind))
    return kept


def print_stream(chunks, tokenizer, show, stops=None):
    """Print minispec.stream's chunks as they come, with --show coloured (special tokens included: they end an
    answer), and with stop strings too whole at the end (a later step may complete one); returns the Generation."""
    from minispec.loading.tokenizer import IncrementalDecoder

    colour = show and sys.stdout.isatty()
    if tokenizer is None:
        text = TokenIds(" " if show else ",")
    else:
        text = IncrementalDecoder(tokenizer, skip_special_tokens=False) if show else None
    if show and stops:
        generation = next(chunk.generation for chunk in chunks if chunk.generation is not None)
        pieces = segment_pieces(generation.trace, text) + [(text.flush(), "target")]
        print(render_pieces(until_stop(pieces, stops), colour), flush=True)
        return generation
    for chunk in chunks:
        if show:
            piece = render_pieces(segment_pieces(chunk.segments, text), colour)
        elif tokenizer:
            piece = chunk.text  # exactly the output's text, never past a stop string
        else:
            piece = text.push(chunk.tokens)
        if chunk.generation is not None:
            print(piece + (text.flush() if show else ""), flush=True)
            return chunk.generation
        print(piece, end="", flush=True)


def prompts_for(args, target):
    """([prompts as generate() takes them], whether they are chat prompts)."""
    texts = ([args.prompt_ids] if args.prompt_ids is not None
             else args.prompt or read_prompts_file(args.prompts_file, "--prompts-file"))
    if any(not isinstance(text, str) for text in texts):
        if args.chat:
            raise ValueError("--chat needs the prompt as text (--prompt, or a prompts file of text lines)")
        return texts, False
    tokenizer = target.tokenizer
    chat = args.chat if args.chat is not None else bool(tokenizer and tokenizer.chat_template)
    if chat and tokenizer is None:
        raise ValueError(f"--chat: {target.name} has no tokenizer files")
    for flag, given in (("--system", args.system is not None), ("--chat-template-kwargs", args.chat_template_kwargs)):
        if given and not chat:
            raise ValueError(f"{flag} needs a chat prompt (a checkpoint with a chat template, and not --no-chat)")
    return [minispec.chat_prompt(target.tokenizer, text, args.system, args.special_tokens_in_prompt,
                                 **args.chat_template_kwargs) if chat else text for text in texts], chat


def template_variables(text):
    variables = flag_type(json.loads, "a JSON object")(text)
    if not isinstance(variables, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    from minispec.loading.chat import RESERVED  # with jinja2: read only when the flag is given

    taken = next((name for name in variables if name in RESERVED), None)
    if taken is not None:
        raise argparse.ArgumentTypeError(f"{taken!r} is set by run.py, not a template variable to give")
    return variables


def summary(stats):
    line = (f"{stats['new_tokens']} new tokens in {stats['seconds']:.2f} s "
            f"({stats['tokens_per_second']:.1f} tokens/s)")
    if "beam_steps" in stats:
        line += f", {stats['beam_steps']} beam steps in {stats['target_calls']} target calls"
    elif "acceptance_rate" in stats:
        line += (f", acceptance rate {stats['acceptance_rate']:.2f}, "
                 f"{stats['tokens_per_target_call']:.2f} tokens per target call")
        if stats.get("tree_nodes"):
            line += f", {stats['tree_nodes']} tree nodes verified"
    return line


def rates(runs):
    return [run.stats["tokens_per_second"] for run in runs]


def speedup(runs, baselines):
    return statistics.median(rates(runs)) / statistics.median(rates(baselines))


def speedup_summary(runs, baselines):
    """--compare's speedup, and each side's median tokens/s and range: 41.2 tokens/s (40.1-43.0)."""
    same = all(run.tokens == runs[0].tokens for run in runs + baselines)
    sides = [f"{statistics.median(rates(side)):.1f} tokens/s ({min(rates(side)):.1f}-{max(rates(side)):.1f})"
             for side in (runs, baselines)]
    return (f"{speedup(runs, baselines):.2f}x the speed of decoding without the draft, median of {len(runs)} runs "
            f"each: {sides[0]} against {sides[1]}, {'same' if same else 'different'} output")


def print_batch(args, target, prompts, draft, settings):
    start = time.perf_counter()
    outs = minispec.generate(target, prompts, draft=draft, batch_size=args.batch_size, **settings)
    if settings["n"] > 1:  # each prompt's n answers, in turn
        outs = [out for answers in outs for out in answers]
    seconds = time.perf_counter() - start
    if args.json:
        print(json.dumps([dict(tokens=out.tokens, text=out.text, stats=out.stats, **logprobs_json(out))
                          for out in outs]))
        return
    for i, out in enumerate(outs):
        print(f"[{i}] " + (out.text if out.text is not None else " ".join(map(str, out.tokens))))
    total = sum(len(out.tokens) for out in outs)
    print(f"{len(outs)} prompts, {total} new tokens in {seconds:.2f} s ({total / seconds:.1f} tokens/s in all)",
          file=sys.stderr)


def logprobs_json(out):
    """--logprobs N: each token's {token, logprob, top: [[token, logprob], ...]} (in place of N)."""
    return {} if out.logprobs is None else {"logprobs": [entry._asdict() for entry in out.logprobs]}


def check_flags(args):
    for flag, texts in (("--prompt", args.prompt), ("--stop", args.stop), ("--system", [args.system])):
        for text in filter(None, texts or ()):  # "" and None: nothing to check
            try:  # text from the command line that is not UTF-8 reaches Python as lone surrogates (PEP 383)
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                raise ValueError(f"{flag} is not UTF-8 text: byte {ord(text[error.start]) - 0xDC00:#04x} at "
                                 f"character {error.start}") from None
    minispec.Settings(draft=args.draft, **settings_of(args))
    check_threads(args)
    check_values(args, dict.fromkeys(("--repeats", "--batch-size"), AT_LEAST_ONE))
    several = len(args.prompt or []) > 1 or args.prompts_file is not None
    if several and (args.show or args.compare):
        raise ValueError("--show and --compare take one prompt (--prompt once)")


def load_models(args):
    from minispec.loaders import load_models  # torch's import: after the flags are checked

    return load_models(args)


def main(argv=None):
    args = parse_args((sys.argv[1:] if argv is None else argv) or DEFAULT_ARGS)
    settings = settings_of(args)
    baseline_settings = {**settings, "draft_beams": None, "tree": None}
    rank = tp_rank(args)
    if rank:  # --tp: every rank decodes the same tokens; rank 0 alone prints them
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        check_flags(args)  # bad flags fail before loading weights, and torch
        from minispec.loading import parallel
        target, draft = load_models(args)
        prompts, chat = prompts_for(args, target)
        if len(prompts) > 1 or settings["n"] > 1:
            print_batch(args, target, prompts, draft, settings)
            parallel.leave()
            return 0
        prompt = prompts[0]
        if args.compare or args.compile:  # first-call costs (allocation, compilation) out of the timings
            short = {"max_new_tokens": 2} if not args.compile else {}
            if args.compile and sys.stderr.isatty():  # minutes without a word would look like a hang
                print("compiling the decode steps (this run's first generation; later ones reuse them)...",
                      file=sys.stderr, flush=True)
            minispec.generate(target, prompt, draft=draft, **{**settings, **short})
            if args.compare:
                minispec.generate(target, prompt, **{**baseline_settings, **short})
        if args.json:
            out = minispec.generate(target, prompt, draft=draft, **settings)
        else:  # tokens printed as they come
            out = print_stream(minispec.stream(target, prompt, draft=draft, **settings), target.tokenizer, args.show,
                                   args.stop)
        runs, baselines = [out], []
        for i in range(args.repeats if args.compare else 0):  # taking turns: a machine's drift hits both sides
            runs += [minispec.generate(target, prompt, draft=draft, **settings)] if i else []
            baselines.append(minispec.generate(target, prompt, **baseline_settings))
    except ValueError as error:  # includes CheckpointError: a problem with the input, not a bug
        # With --tp every rank checks the same input and stops alike: rank 0 prints it.
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if not args.tp:
            raise
        # one line from the rank it went wrong on; a rank whose collective failed because another had gone says
        # nothing (that one has), and exits too (torchrun then stops the others)
        from minispec.loading import parallel
        if not parallel.lost_peer(error):
            line = str(error).strip().splitlines()[0] if str(error).strip() else ""
            print(f"error: rank {rank}: {type(error).__name__}: {line}", file=sys.__stderr__, flush=True)
        return 1
    parallel.leave()

    if args.json:
        hypotheses = dict(sequences=out.sequences, scores=out.scores) if out.sequences else {}
        comparison = dict(baseline=baselines[0].stats, speedup=speedup(runs, baselines),
                          tokens_per_second=rates(runs), baseline_tokens_per_second=rates(baselines)) \
            if baselines else {}
        print(json.dumps(dict(tokens=out.tokens, text=out.text, stats=out.stats, target=args.target,
                              draft=args.draft, chat=chat, **{**settings, **logprobs_json(out)}, **hypotheses,
                              **comparison)))
        return 0
    print(summary(out.stats) + (f"; {speedup_summary(runs, baselines)}" if baselines else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    exit_now(exit_status(main))
