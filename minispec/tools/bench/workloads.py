"""--workloads: traffic that repeats itself, served. One server process (served.py) per workload, drafter
and prefix-cache setting, all up at once, takes the workload's --requests one after another (request i
goes to each server in turn): request time end to end, time to first text, tokens per target call and
acceptance, against plain (--draft none, prefix cache on) and lookup, and over the traffic's two halves
(a drafter that learns from earlier requests gains in the second), and the ceiling: plain's time over a
drafter right about every answer (`ceiling`). With --learn-head, each draft head also serves as it learns
from the traffic (the server's --learn-head), in a pass of its own after the others:


agent    an agent loop: one tool-call format; each turn resends the conversation, the model's last
         answer (a tool call: at most AGENT_TOKENS tokens) and the tool's result appended
code     repeated edits of one file: the file as it now is, resent with a change to make and re-emit
summaries RAG: the documents retrieved for a question (reports, news, changelogs, each recurring across the
         traffic), summarized quoting their key sentences and figures verbatim
chat     ordinary chat: a new question each time
"""

import statistics
import tempfile
from argparse import Namespace
from contextlib import ExitStack
from pathlib import Path

import torch

from minispec.heads import is_head_dir
from minispec.loaders import load_models
from minispec.models.base import Feed

from .memory import timed
from .report import md_table, progress
from .served import health, sampling_fields, server_flags, serving, stream

GOALS = {"agent": {"vs_plain": 3.0, "ttft_cut": 3.0}, "code": {"vs_plain": 2.5}, "chat": {"vs_plain": 0.98}}
# An agent's answer is a tool call, one line: longer answers would only fill the context, turn after turn.
AGENT_TOKENS = 128
LEARNING = "learning:"  # a row's draft: the head after it, learning while it serves

# --- the workloads: messages(i, answers) -> request i's chat; answers: the texts of the requests before --
AGENT_SYSTEM = ("You are a coding agent in a Python repository. Each turn, call exactly one tool, answering with "
                'one line:\n<tool_call>{"name": TOOL, "arguments": {...}}</tool_call>\nTools: run_tests {"path"}, '
                'search {"pattern"}, read_file {"path"}, edit_file {"path", "old", "new"}.\nWhen the task is done, '
                "answer DONE and one sentence saying what you changed.")
AGENT_TASK = "tests/test_dates.py::test_parse_iso fails since the last commit. Find the cause and fix it."
MODULES = ["dates", "prices", "config", "records", "words", "names", "batches", "stats"]


def tool_result(j):
    """The tool's answer to the agent's j-th call: tests, a search, a file, an edit, in turn."""
    module = MODULES[j % len(MODULES)]
    if j % 4 == 0:
        return (f"============ FAILURES ============\n___ test_parse_iso ___\n    def test_parse_iso():\n"
                f">       assert parse_date('2024-0{j % 9 + 1}-15') == date(2024, {j % 9 + 1}, 15)\n"
                f"E       AssertionError\nsrc/app/{module}.py:{12 + j}: AssertionError\n"
                f"1 failed, {40 + j} passed in 0.{j + 3}s")
    if j % 4 == 1:
        return "\n".join(f"src/app/{m}.py:{7 + 3 * k}: from app.{module} import parse_{m}"
                         for k, m in enumerate(MODULES[:4 + j % 4]))
    if j % 4 == 2:
        return render(edited_functions(j % 6)[0])
    return f"Edited src/app/{module}.py: 1 replacement, line {12 + j}."


def agent(i, answers):
    messages = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": AGENT_TASK}]
    for j, answer in enumerate(answers):
        messages += [{"role": "assistant", "content": answer},
                     {"role": "user", "content": f"<tool_result>\n{tool_result(j)}\n</tool_result>"}]
    return messages


WHAT = [("parse", "item.strip().split('-')"), ("format", "f'{item:.2f}'"), ("load", "dict(item)"),
        ("merge", "item | {'seen': True}"), ("count", "len(item.split())"), ("clean", "item.strip().title()"),
        ("split", "item[:limit]"), ("measure", "abs(item) ** 0.5")]


def edited_functions(edits):
    """The file's functions after its first `edits` edits, and the change request of the next one."""
    functions = [{"name": f"{verb}_{noun}", "limit": 10, "hints": False, "var": "result", "expr": expr}
                 for (verb, expr), noun in zip(WHAT, MODULES)]
    change = None
    for k in range(edits + 1):
        f = functions[(3 * k + 5) % len(functions)]  # all over the file, its end first
        kind = (k + k // len(functions)) % 4
        change = [f"Rename the function {f['name']} to {f['name']}_all.",
                  f"In {f['name']}, change the default limit from {f['limit']} to {f['limit'] + 5}.",
                  f"Add type hints to the signature of {f['name']}.",
                  f"In {f['name']}, rename the variable {f['var']} to {f['var']}s."][kind]
        if k < edits:
            key, value = [("name", f["name"] + "_all"), ("limit", f["limit"] + 5), ("hints", True),
                          ("var", f["var"] + "s")][kind]
            f[key] = value
    return functions, change


def render(functions):
    lines = []
    for f in functions:
        signature = (f"(items: list, limit: int = {f['limit']}) -> list" if f["hints"] else
                     f"(items, limit={f['limit']})")
        lines += [f"def {f['name']}{signature}:", f'    """The first `limit` items, each as {f["expr"]}."""',
                  f"    {f['var']} = []", "    for index, item in enumerate(items):", "        if index >= limit:",
                  "            break", f"        {f['var']}.append({f['expr']})", f"    return {f['var']}", "", ""]
    return "\n".join(lines).strip() + "\n"


def code(i, answers):
    functions, change = edited_functions(i)  # the file first, as editors send it: its unchanged start is a prefix
    return [{"role": "user", "content": f"```python\n{render(functions)}```\n\n{change} Answer with the whole "
                                        "updated file and nothing else."}]


CITIES = ["Lyon", "Porto", "Leeds", "Graz", "Turku", "Gdansk", "Bilbao", "Utrecht", "Brno", "Cork", "Malmo", "Bari"]
PLANS = [("night bus", "run every thirty minutes after midnight"), ("bike lane", "connect the stations to the "
         "university"), ("library", "stay open until ten in the evening"), ("housing", "renovate two thousand flats"),
         ("harbour", "move freight traffic out of the centre"), ("school meal", "serve local produce every day")]
PRODUCTS = ["Ledger", "Harbor", "Quill", "Atlas", "Relay", "Juniper"]
SOURCES = 9  # the documents the retriever draws from: a report, a news article and a changelog in turn


def source(k):
    """Document k of the retrieval pool, three paragraphs: a quarterly report, a news article or a changelog."""
    city, (plan, goal), product = CITIES[k % len(CITIES)], PLANS[k % len(PLANS)], PRODUCTS[k % len(PRODUCTS)]
    if k % 3 == 0:
        return (f"[{k + 1}] {product} Inc., report for the quarter {k % 4 + 1}\n{product} Inc. reported revenue of "
                f"{120 + 7 * k} million euros, up {k + 4} percent on the year before, and an operating margin of "
                f"{11 + k % 5}.{k % 10} percent.\nSubscriptions grew to {31 + k} thousand, while hardware sales fell "
                f"{k % 6 + 2} percent as the {city} plant was retooled.\nThe board expects revenue between "
                f"{125 + 7 * k} and {135 + 7 * k} million euros next quarter and proposed a dividend of 0.{k + 12} "
                f"euros a share.")
    if k % 3 == 1:
        return (f"[{k + 1}] {city} approves the {plan} plan\nThe council of {city} approved the {plan} plan on "
                f"Tuesday by {20 + k} votes to {k + 3}. The plan costs {k + 2} million euros a year and will {goal} "
                f"from {2025 + k % 3}.\nCritics said the money would be better spent on "
                f"{PLANS[(k + 1) % len(PLANS)][0]} services, and asked for a review after {k % 4 + 2} years.\nThe "
                f"mayor said that \"{city} cannot wait another decade\" and promised a first report by March.")
    return (f"[{k + 1}] {product.lower()} {k % 4 + 2}.{k}.0 release notes\nFixed: `{product.lower()} sync` no longer "
            f"drops the last {k + 2} records of a batch when the connection resets (issue #{400 + 13 * k}).\nChanged: "
            f"the default timeout is now {k * 5 + 30} seconds instead of 30, and retries back off up to "
            f"{k + 3} times.\nRemoved: the `--legacy-{PLANS[k % len(PLANS)][0].replace(' ', '-')}` flag, deprecated "
            f"since {k % 4 + 1}.0; use `--mode strict` instead.")


SUMMARY_SYSTEM = ("You answer questions from the documents retrieved for them, and from nothing else. Summarize "
                  "each document in two sentences, quoting its key sentence and its figures verbatim in double "
                  "quotes, then answer the question in one sentence citing the documents as [n].")
QUESTIONS = ["What changed for users this quarter?", "Which decisions cost the most?", "What should we watch next?",
             "What went wrong, and what was fixed?", "What do the numbers say about growth?"]


def summaries(i, answers):
    """RAG: the documents the retriever ranks for each question; a follow-up question (every other request)
    gets the same top two again (the prompts share a prefix), and every document recurs over the traffic."""
    picks = dict.fromkeys([i // 2 % SOURCES, (i // 2 * 4 + 1) % SOURCES, (7 * i + 5) % SOURCES])
    documents = "\n\n".join(source(k) for k in picks)
    return [{"role": "system", "content": SUMMARY_SYSTEM},
            {"role": "user", "content": f"{documents}\n\nQuestion: {QUESTIONS[i % len(QUESTIONS)]}"}]


TOPICS = ["tides", "compound interest", "photosynthesis", "jet lag", "sourdough starters", "the Roman calendar",
          "noise-cancelling headphones", "glaciers", "vaccines", "chess openings", "solar eclipses", "coffee roasting",
          "bird migration", "credit scores", "volcanoes", "the printing press"]
ASKS = ["How would you explain {} to a ten-year-old?", "What are three common misconceptions about {}?",
        "Write a short poem about {}.", "What should a beginner read first to learn about {}?",
        "Give me a two-paragraph history of {}.", "What is the most surprising fact about {}?"]


def chat(i, answers):
    return [{"role": "user", "content": ASKS[(i + i // len(TOPICS)) % len(ASKS)].format(TOPICS[i % len(TOPICS)])}]


WORKLOADS = {"agent": agent, "code": code, "summaries": summaries, "chat": chat}


# --- the benchmark ------------------------------------------------------------------------------------
def workloads_benchmark(args):
    """The server on generated traffic (all workloads when none is named), per --draft value and prefix-cache
    setting, beside 'none' and 'lookup'."""
    drafts = list(dict.fromkeys(["none", "lookup", *args.draft]))  # the baselines first
    learning = [LEARNING + draft for draft in drafts if args.learn_head and is_head_dir(draft)]
    results = {}
    servers = len(drafts) + (len(drafts) if args.cache_off == "all" else 2) + len(learning)
    with progress(len(args.workloads or WORKLOADS) * servers, "workloads") as bar:
        for name in args.workloads or WORKLOADS:
            if args.cache_off == "all":
                runs = workload_runs(args, name, [(draft, cache) for cache in (True, False) for draft in drafts], bar)
            else:  # "best": cache off for plain and the fastest drafter alone, known once the others ran
                runs = workload_runs(args, name, [(draft, True) for draft in drafts] + [("none", False)], bar)
                best = min(runs[1:len(drafts)], key=lambda r: r["seconds"])["draft"]
                runs += workload_runs(args, name, [(best, False)], bar)
            if learning:  # alone: a learner trains while idle, which would take the other servers' cores
                runs += workload_runs(args, name, [(draft, True) for draft in learning], bar)
            results[name] = compared(name, runs, args.temperature)
    # the servers are gone; their busy minutes would have this load take one thread (cpus.py) where each had all
    threads = args.threads or torch.get_num_threads()
    target, _ = load_models(Namespace(**{**vars(args), "draft": "none", "draft_quantize": None, "threads": threads}))
    for w in results.values():
        w["ceiling"] = ceiling(target, next(r for r in w["runs"] if r["draft"] == "none" and r["prefix_cache"]))
    return {"settings": vars(args), "workloads": results}, workloads_table(args, results)


def workload_runs(args, name, rows, bar):
    """A server for each row (draft, prefix cache on), all up at once, each taking the workload's requests one
    after another: request i goes to every server in turn, the first one rotating, so that a slower minute of
    a shared machine falls on every row alike rather than on whichever ran then."""
    answers = [[] for _ in rows]
    with ExitStack() as servers:
        def flags(draft, cache):
            more = [] if cache else ["--prefix-cache-mb=0"]
            if draft.startswith(LEARNING):  # the learnt head is saved where it goes with the server
                more.append(f"--learn-head={servers.enter_context(tempfile.TemporaryDirectory())}")
            return server_flags(args, draft.removeprefix(LEARNING), *more)
        addresses = [servers.enter_context(serving(flags(draft, cache))) for draft, cache in rows]
        hello = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0}
        for address in addresses:
            stream(address, "/v1/chat/completions", hello)  # the first call's setup is not the workload's
        for i in range(args.requests):
            for j in [(i + k) % len(rows) for k in range(len(rows))]:
                body = {"messages": WORKLOADS[name](i, [a.text for a in answers[j]]), **sampling_fields(args)}
                if name == "agent":
                    body["max_tokens"] = min(body["max_tokens"], AGENT_TOKENS)
                answers[j].append(stream(addresses[j], "/v1/chat/completions", body))
        learnt = [(health(address) or {}).get("learning") for address in addresses]  # the learners' reports
    bar.update(len(rows))
    return [run_of(draft, cache, row, report) for (draft, cache), row, report in zip(rows, answers, learnt)]


def run_of(draft, cache, answers, learning=None):
    half = len(answers) // 2
    return {"draft": draft, "prefix_cache": cache, **totals(answers), **({"learning": learning} if learning else {}),
            "halves": [totals(answers[:half]), totals(answers[half:])],
            "requests": [{"seconds": a.seconds, "ttft": a.ttft, **a.usage, **a.speculative} for a in answers],
            "texts": [a.text for a in answers]}


def totals(answers):
    calls = sum(a.speculative.get("target_calls", 0) for a in answers)
    rates = [(a.speculative["acceptance_rate"], a.speculative["target_calls"]) for a in answers
             if "acceptance_rate" in a.speculative]
    prompt = sum(a.usage["prompt_tokens"] for a in answers)
    return {"seconds": sum(a.seconds for a in answers), "mean_ttft": statistics.fmean(a.ttft for a in answers),
            "tokens_per_call": sum(a.usage["completion_tokens"] for a in answers) / max(calls, 1),
            "acceptance_rate": sum(r * n for r, n in rates) / max(sum(n for _, n in rates), 1) if rates else None,
            "cached_share": sum(a.usage["prompt_tokens_details"]["cached_tokens"] for a in answers) / max(prompt, 1)}


def compared(name, runs, temperature):
    """Each run against plain (none, prefix cache on) and lookup (the same cache), and its own cache off
    (None where that run was left out: --cache-off best)."""
    def find(draft, cache):
        return next((r for r in runs if r["draft"] == draft and r["prefix_cache"] == cache), None)
    plain = find("none", True)
    for r in runs:
        lookup, other = find("lookup", r["prefix_cache"]), find(r["draft"], not r["prefix_cache"])
        r.update(vs_plain=plain["seconds"] / r["seconds"], vs_lookup=lookup and lookup["seconds"] / r["seconds"],
                 halves_vs_plain=[p["seconds"] / h["seconds"] for p, h in zip(plain["halves"], r["halves"])],
                 ttft_cut=other["mean_ttft"] / r["mean_ttft"] if r["prefix_cache"] and other else None,
                 identical_to_plain=r["texts"] == plain["texts"] if temperature == 0 else None)
    best = max((r for r in runs if r["prefix_cache"] and r["draft"] != "none"), key=lambda r: r["vs_plain"])
    return {"runs": runs, "best": {"draft": best["draft"], "vs_plain": best["vs_plain"]},
            "ttft_cut": plain["ttft_cut"], "goals": GOALS.get(name, {})}


def ceiling(target, plain):
    """Plain's time over what a drafter right about every answer would take: plain's time to first text, then the
    answer's tokens verified in one forward at the prompt's length. The forwards are timed here, at cache positions
    holding no real keys: what they compute does not change how long it takes."""
    def verify(request):
        n, length = request["completion_tokens"], request["prompt_tokens"]
        target.ensure_caches(1, length + n)
        tokens = torch.zeros(1, n, dtype=torch.long, device=target.device)
        with torch.no_grad():
            return timed(lambda: target.decode_rows(Feed(tokens, [length]), eager=True), target.device)[1]
    verify(plain["requests"][-1])  # the first forward's setup is not a verify's
    return plain["seconds"] / sum(q["ttft"] + verify(q) for q in plain["requests"])


def workloads_table(args, results):
    lines = [f"target `{args.target}`, {args.requests} requests a workload one after another, up to "
             f"{args.max_new_tokens} new tokens each, temperature {args.temperature}; one server process per row, "
             "the rows' servers taking each request in turn", ""]
    lines += md_table([
        ("workload", "{workload}"), ("draft", lambda r: f"`{label(r['draft'])}`"),
        ("prefix cache", lambda r: "on" if r["prefix_cache"] else "off"), ("s", "{seconds:.2f}"),
        ("x plain", "{vs_plain:.2f}x"), ("x lookup", "{vs_lookup:.2f}x"),
        ("x plain 1st / 2nd half", lambda r: " / ".join(f"{x:.2f}x" for x in r["halves_vs_plain"])),
        ("mean TTFT ms", lambda r: f"{r['mean_ttft'] * 1e3:.0f}"),
        ("TTFT cut", "{ttft_cut:.2f}x"),
        ("tok/call 1st / 2nd half", lambda r: " / ".join(f"{h['tokens_per_call']:.2f}" for h in r["halves"])),
        ("accept", "{acceptance_rate:.2f}"), ("cached", "{cached_share:.0%}"),
        ("same as plain", "{identical_to_plain}")],
        [{"workload": name, **r} for name, w in results.items() for r in w["runs"]])
    lines += ["", "x plain: against `none` with the prefix cache on (the server as shipped, without speculation); "
              "x lookup: against `lookup` with the same prefix cache; TTFT cut: mean TTFT without the prefix cache "
              "over with it; cached: the prompts' tokens the prefix cache held", ""]
    for name, w in results.items():
        best, cut = w["best"]["vs_plain"], w["ttft_cut"]
        lines.append(f"- {name}: best `{label(w['best']['draft'])}` {best:.2f}x plain{goal(w, 'vs_plain', best)}, "
                     f"a drafter right about every answer {w['ceiling']:.2f}x; the prefix cache cuts plain's mean "
                     f"TTFT {cut:.2f}x{goal(w, 'ttft_cut', cut)}")
    return "\n".join(lines)


def label(draft):
    """A draft as the table names it: a model's file or folder name, not its path."""
    named = ",".join(Path(part).name for part in draft.removeprefix(LEARNING).split(","))
    return f"{named}, learning" if draft.startswith(LEARNING) else named


def goal(workload, key, value):
    target = workload["goals"].get(key)
    return "" if target is None else f" (goal ≥ {target}x: {'meets' if value >= target else 'misses'})"
