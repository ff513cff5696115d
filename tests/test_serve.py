"""The OpenAI-compatible server (minispec.serve): every request gets what minispec.generate gives it
alone, however requests overlap; requests join a running batch at the next step; a full queue, bad
requests, unknown models, failures and disconnects are answered in the OpenAI error shape and touch
no other request; the official openai client talks to it over HTTP (uvicorn); SIGTERM stops it cleanly.

The server runs in-process (Starlette's TestClient, or uvicorn on a thread where a real socket is
needed) on a tiny random llama with a ChatML tokenizer. Its scheduler holds its models for its whole
life, so every server loads its own copies, and the expected outputs come from other copies."""

import ast
import json
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers
from conftest import noisy_copy, save_reference, spread_init
from starlette.testclient import TestClient
from test_chat import REAL, SMOLLM2

import minispec
from minispec.decoding import engine
from minispec.serve import __main__ as serve_main
from minispec.serve import app as app_module
from minispec.serve import scheduler as scheduler_module
from minispec.serve.app import build_app
from minispec.serve.scheduler import Scheduler

ROOT = Path(__file__).resolve().parents[1]
CONTEXT = 256
PROMPTS = ["the cat sat", "a dog ran in the park", "Grüße aus Köln", "then it slept.", "the mat"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the cat sat on the mat?"}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny llama with a byte-level BPE tokenizer that has ChatML's special tokens and SmolLM2's chat
    template (<|im_end|> is its EOS), and a draft: a noisy copy of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    target_dir, draft_dir = tmp_path_factory.mktemp("serve_target"), tmp_path_factory.mktemp("serve_draft")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat.", "a dog ran in the park\n\nthen it slept.",
                                   "Grüße aus Köln, 東京, 😀!", "Be brief. You are a helpful AI assistant"] * 4,
                                  trainer)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    hf_tokenizer.chat_template = SMOLLM2
    hf_tokenizer.save_pretrained(target_dir)
    config = transformers.LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=CONTEXT, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(0)
    model = spread_init(transformers.LlamaForCausalLM(config).eval(), seed=0, gain=2.0)
    save_reference(model, target_dir)
    save_reference(noisy_copy(model, seed=1, scale=0.05), draft_dir)
    return target_dir, draft_dir


@pytest.fixture(scope="module")
def alone(checkpoints):
    """Copies of the target and draft for minispec.generate: what each request gives alone."""
    return minispec.load(checkpoints[0]), minispec.load(checkpoints[1])


def expected(alone, prompt, draft="lookup", gamma=3, **settings):
    """minispec.generate's text for a request as the server gets it (text encoded as the server encodes it)."""
    target, draft_model = alone
    ids = (minispec.chat_prompt(target.tokenizer, prompt) if isinstance(prompt, list)
           else target.tokenizer.encode(prompt, split_special_tokens=True))
    return minispec.generate(target, ids, draft=draft_model if draft == "model" else draft, gamma=gamma, **settings)


def make_app(checkpoints, draft="lookup", gamma=3, rows=2, max_waiting=8, api_key=None, max_model_len=None, tree=None):
    target = minispec.load(checkpoints[0])
    draft_arg = minispec.load(checkpoints[1]) if draft == "model" else draft
    scheduler = Scheduler(target, draft_arg, gamma, rows, max_model_len, max_waiting, tree)
    return build_app(scheduler, "tiny", draft, api_key, shutdown_timeout=30), scheduler


@contextmanager
def serving(checkpoints, **options):
    """A TestClient on a fresh server (its scheduler started and, at the end, stopped)."""
    app, scheduler = make_app(checkpoints, **options)
    with TestClient(app) as client:
        client.scheduler = scheduler
        yield client
    assert not scheduler.thread.is_alive()


@contextmanager
def uvicorn_serving(app, scheduler, shutdown_timeout=10):
    """The app behind uvicorn (the server's own Server) on a free port of 127.0.0.1, on a thread;
    yields its base URL and the Server."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = serve_main.Server(app, scheduler, shutdown_timeout, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until(condition, timeout=30):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


class Steps:
    """engine.step, watched: each step's batch (the requests in it), a gate that holds the scheduler
    before its next step while closed, and an optional delay per step."""

    def __init__(self, monkeypatch, delay=0.0):
        self.batches, self.delay = [], delay
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()
        real = engine.step

        def step(target, rows):
            if not self.gate.is_set():
                self.held.set()
                assert self.gate.wait(30)
            self.batches.append([row.request for row in rows])
            time.sleep(self.delay)
            return real(target, rows)

        monkeypatch.setattr(engine, "step", step)

    def hold(self):
        """Close the gate: the scheduler stops before its next step (`held` tells when it is there)."""
        self.held.clear()
        self.gate.clear()

    def open_when(self, condition):
        """Open the gate once the condition holds (on a thread of its own)."""
        Call(lambda: (wait_until(condition), self.gate.set()))

    def steps_of(self, request):
        """The steps whose batch held the request (api.Request: compared by identity, not by its fields)."""
        return [i for i, batch in enumerate(self.batches) if any(r is request for r in batch)]


class Call(threading.Thread):
    """A call, started on a thread of its own; join() returns its result."""

    def __init__(self, call):
        super().__init__(daemon=True)
        self.call = call
        self.start()

    def run(self):
        try:
            self.result = self.call()
        except Exception as error:  # join() raises it, named
            self.error = error

    def join(self, timeout=30):
        super().join(timeout)
        assert not self.is_alive(), "a call got no reply in time"
        assert not hasattr(self, "error"), f"the call raised {self.error!r}"
        return self.result


def in_threads(calls):
    """Run the calls at once, each on a thread; their results in order, within 30 seconds in all."""
    started, deadline = [Call(call) for call in calls], time.monotonic() + 30
    return [call.join(max(deadline - time.monotonic(), 0)) for call in started]


def post(client, path, body):
    return lambda: client.post(path, json=body)


def streamed(client, path, body):
    """A call that streams the reply and returns its events (the chunks, parsed), checking the framing."""
    def read():
        with client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
        return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    return read


def text_of(events):
    choices = [choice for event in events for choice in event.get("choices", [])]
    return "".join(choice.get("text") or choice.get("delta", {}).get("content") or "" for choice in choices)


def ending_of(events):
    """The chunk with the finish reason."""
    [ending] = [event for event in events if event.get("choices") and event["choices"][0]["finish_reason"]]
    return ending


def queued(client, count):
    """Whether `count` requests are in the scheduler (running or waiting)."""
    return lambda: sum(client.scheduler.load.values()) == count


def test_overlapping_requests_each_get_what_generate_gives_alone(checkpoints, alone, monkeypatch):
    """Greedy: seven requests (completions from text, chats, streamed and not, one with a stop string)
    on two rows, all queued before the first step, so that they join and leave a running batch."""
    steps = Steps(monkeypatch)
    greedy = {"temperature": 0, "max_tokens": 24}
    with serving(checkpoints, rows=2) as client:
        steps.hold()
        calls = [post(client, "/v1/completions", {"prompt": prompt, **greedy}) for prompt in PROMPTS[:3]]
        calls += [streamed(client, "/v1/completions", {"prompt": PROMPTS[3], **greedy}),
                  post(client, "/v1/chat/completions", {"messages": CHAT, **greedy}),
                  streamed(client, "/v1/chat/completions", {"messages": CHAT[1:], **greedy}),
                  post(client, "/v1/completions", {"prompt": PROMPTS[4], "stop": ["e"], **greedy})]
        steps.open_when(queued(client, 7))
        replies = in_threads(calls)
    served = steps.batches[:]  # generate's steps below are not the server's
    settings = {"max_new_tokens": 24}
    alone_outs = [expected(alone, prompt, **settings) for prompt in PROMPTS[:4]]
    alone_outs += [expected(alone, CHAT, **settings), expected(alone, CHAT[1:], **settings),
                   expected(alone, PROMPTS[4], stop=["e"], **settings)]
    for i in (0, 1, 2, 4, 6):
        body = replies[i].json()
        assert replies[i].status_code == 200, body
        choice = body["choices"][0]
        assert (choice["message"]["content"] if i == 4 else choice["text"]) == alone_outs[i].text, i
        assert body["usage"]["completion_tokens"] == len(alone_outs[i].tokens)
        assert body["usage"]["prompt_tokens"] + len(alone_outs[i].tokens) == body["usage"]["total_tokens"]
        assert choice["finish_reason"] == ("stop" if i == 6 or len(alone_outs[i].tokens) < 24 else "length")
        assert body["speculative"]["target_calls"] == alone_outs[i].stats["target_calls"]
    for i in (3, 5):
        assert text_of(replies[i]) == alone_outs[i].text
        assert ending_of(replies[i])["speculative"]["draft"] == "lookup"
    assert replies[5][0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert alone_outs[6].text != expected(alone, PROMPTS[4], **settings).text  # the stop string did stop it
    assert len({out.text for out in alone_outs}) == 7
    assert max(len(batch) for batch in served) == 2
    assert len(served) < sum(out.stats["target_calls"] for out in alone_outs)  # they did share steps


def test_seeded_sampling_at_a_fixed_gamma_equals_generate_alone(checkpoints, alone, monkeypatch):
    """With a draft model, γ = 3: each request's random draws are its own, so the tokens are too; and
    so are its statistics."""
    steps = Steps(monkeypatch)
    sampled = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 20, "ignore_eos": True}
    with serving(checkpoints, draft="model", rows=3) as client:
        steps.hold()
        calls = [post(client, "/v1/completions", {"prompt": prompt, "seed": 10 + i, **sampled})
                 for i, prompt in enumerate(PROMPTS)]
        steps.open_when(queued(client, 5))
        replies = [reply.json() for reply in in_threads(calls)]
    settings = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 20, "ignore_eos": True, "draft": "model"}
    for i, (prompt, reply) in enumerate(zip(PROMPTS, replies)):
        out = expected(alone, prompt, seed=10 + i, **settings)
        assert reply["choices"][0]["text"] == out.text
        stats = reply["speculative"]
        assert stats["draft"] == "model" and stats["gamma"] == 3 and stats["seed"] == 10 + i
        for key in ("acceptance_rate", "tokens_per_target_call", "target_calls", "accepted_lengths"):
            assert stats[key] == out.stats[key], key
    assert sum(reply["speculative"]["accepted_lengths"][0] for reply in replies) < 5 * 20  # guesses were accepted


def test_a_server_verifying_token_trees_gives_what_generate_gives_alone(checkpoints, alone):
    """--tree 8: greedy and seeded sampled requests, concurrent, each as decoded alone with tree=8 (prompts
    that repeat "one two" with other words after it: lookup's trees branch)."""
    prompts = ["one two three one two four one two five one two", "red blue green red blue black red blue"] * 2
    settings = [{"temperature": 0.0 if i % 2 else 1.0, "seed": i, "ignore_eos": True} for i in range(len(prompts))]
    with serving(checkpoints, rows=3, tree=8) as client:
        calls = [post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 16, **extra})
                 for prompt, extra in zip(prompts, settings)]
        replies = [reply.json() for reply in in_threads(calls)]
    for prompt, extra, reply in zip(prompts, settings, replies):
        out = expected(alone, prompt, tree=8, max_new_tokens=16, **extra)
        assert reply["choices"][0]["text"] == out.text
        assert out.stats.get("tree_nodes", 0) > 0 or extra["temperature"] == 0.0


def test_a_request_arriving_mid_run_joins_the_batch_at_the_next_step(checkpoints, monkeypatch):
    steps = Steps(monkeypatch)
    with serving(checkpoints, rows=2) as client:
        steps.hold()
        first = Call(post(client, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 30, "ignore_eos": True}))
        assert steps.held.wait(30)  # the first request's first step is about to run
        second = Call(post(client, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 5}))
        wait_until(lambda: client.scheduler.load == {"running": 1, "waiting": 1})
        steps.gate.set()
        assert first.join().status_code == second.join().status_code == 200
    a, b = steps.batches[0][0], next(request for request in steps.batches[1] if request is not steps.batches[0][0])
    assert steps.steps_of(a)[:3] == [0, 1, 2] and steps.steps_of(b)[0] == 1


RELEASE = """
import os, sys, threading, time, torch
import minispec.api
from minispec.api import release_openmp_workers
threads = lambda: len(os.listdir("/proc/self/task"))

def settled(count):  # the workers' exits are the kernel's to finish
    deadline = time.monotonic() + 10
    while threads() > count and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

def region():  # a parallel region: the calling thread's OpenMP workers start (a tiny model makes none)
    torch.ones(1 << 23).add_(1)

def decode(*args, **options):
    region()
    yield from real_decode(*args, **options)

torch.set_num_threads(2)
real_load, real_decode = minispec.api.load_model, minispec.api.engine.decode
minispec.api.load_model = lambda *args, **options: (region(), real_load(*args, **options))[1]
minispec.api.engine.decode = decode
alone = threads()
region()
with_workers = threads()
release_openmp_workers()
released = settled(alone)
target = minispec.api.load(sys.argv[1])  # its parallel regions' workers end with it
loaded = settled(alone)
generated, counted = threading.Event(), threading.Event()

def generate():  # then stays: a thread's pool would end with the thread anyway
    minispec.api.generate(target, [1, 2, 3], max_new_tokens=4)
    generated.set()
    counted.wait()

worker = threading.Thread(target=generate)
worker.start()
generated.wait()
print(alone, with_workers, released, loaded, settled(alone + 1))  # + the worker itself
counted.set()
worker.join()
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
def test_no_idle_openmp_workers_stay_beside_the_thread_that_decodes(checkpoints, monkeypatch):
    """Idle OpenMP workers of another thread make libgomp cut its spin-waits short (each step slower): a load
    and a generate end theirs, and so does the thread that loaded a server's models when its scheduler starts."""
    out = subprocess.run([sys.executable, "-c", RELEASE, str(checkpoints[0])], capture_output=True, text=True,
                         timeout=300, check=True)
    alone, with_workers, released, loaded, generated = map(int, out.stdout.split())
    assert with_workers > alone and released == loaded == alone and generated == alone + 1
    calls = []
    monkeypatch.setattr(minispec.api, "release_openmp_workers", lambda: calls.append(threading.get_ident()))
    app, scheduler = make_app(checkpoints)
    calls.clear()
    with TestClient(app):
        assert len(calls) == 1
    assert not scheduler.thread.is_alive()


def test_releasing_openmp_workers_passes_over_a_library_file_that_is_gone(tmp_path, monkeypatch):
    maps = tmp_path / "maps"  # a libgomp replaced on disk since it was loaded, and a short line naming one
    maps.write_text("7f00-7f01 r-xp 00000000 08:01 12 /gone/libgomp.so.1 (deleted)\n7f02-7f03 rw-p 0 0 libgomp\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *args, **options: real_open(
        maps if path == "/proc/self/maps" else path, *args, **options))
    minispec.api.release_openmp_workers()  # no error: nothing to release there


def test_a_full_queue_is_refused_with_429_and_retry_after(checkpoints, monkeypatch):
    steps = Steps(monkeypatch)
    body = {"prompt": PROMPTS[0], "max_tokens": 4}
    with serving(checkpoints, rows=1, max_waiting=1) as client:
        steps.hold()
        running = Call(post(client, "/v1/completions", body))
        assert steps.held.wait(30)
        waiting = Call(post(client, "/v1/completions", body))
        wait_until(lambda: client.scheduler.load == {"running": 1, "waiting": 1})
        try:
            refused = Call(post(client, "/v1/completions", body)).join(10)
        finally:
            steps.gate.set()
        assert running.join().status_code == waiting.join().status_code == 200
        after = client.post("/v1/completions", json=body)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert "retry" in error["message"]
    assert after.status_code == 200


def test_clients_that_disconnect_free_their_rows(checkpoints, alone, monkeypatch):
    """Over a real socket (uvicorn): a stream's client reads two chunks and hangs up, another client
    gives up waiting for its whole reply; their rows leave at the next step while the third request
    decodes on, with the same output as alone."""
    steps = Steps(monkeypatch, delay=0.005)
    app, scheduler = make_app(checkpoints, rows=3)
    long = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    other = {"prompt": PROMPTS[1], "max_tokens": 150, "ignore_eos": True, "temperature": 0}
    with uvicorn_serving(app, scheduler) as (url, _), httpx.Client(base_url=url, timeout=60) as http:
        with httpx.Client(base_url=url, timeout=60) as streaming:
            with streaming.stream("POST", "/v1/completions", json={**long, "stream": True}) as response:
                chunks = response.iter_lines()
                assert next(chunks).startswith("data: ")
                other_reply = Call(lambda: http.post("/v1/completions", json=other))
                impatient = Call(lambda: httpx.post(url + "/v1/completions", json={**long, "prompt": PROMPTS[2]},
                                                    timeout=0.3))
                wait_until(lambda: scheduler.load["running"] == 3)  # all three in the batch
                next(chunk for chunk in chunks if chunk.startswith("data: "))
                read_at = len(steps.batches)
        with pytest.raises(AssertionError, match="ReadTimeout"):
            impatient.join()
        other_text = other_reply.join().json()["choices"][0]["text"]
        wait_until(lambda: scheduler.load["running"] == 0)
    stream_request = steps.batches[0][0]
    joined = next(batch for batch in steps.batches if len(batch) == 3)[1:]
    [other_request] = [request for request in joined if request.max_new_tokens == 150]
    [impatient_request] = [request for request in joined if request.max_new_tokens == 200]
    ran, waited = steps.steps_of(stream_request), steps.steps_of(impatient_request)
    assert ran == list(range(len(ran))) and len(ran) < read_at + 20 < 200  # it left soon after the hang-up
    assert len(waited) < 0.3 / 0.005 + 40  # it left soon after its client gave up
    assert steps.steps_of(other_request)[-1] > max(ran[-1], waited[-1])  # while the other went on
    assert other_text == expected(alone, PROMPTS[1], max_new_tokens=150, ignore_eos=True).text


BAD_REQUESTS = [  # (path, body, status, param, part of the message)
    ("/v1/completions", "{", 400, None, "not valid JSON"),
    ("/v1/completions", "[1, 2]", 400, None, "JSON object"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', 400, None, "NaN"),
    ("/v1/completions", "[" * 100_000, 400, None, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n (answers of each prompt) must be an integer in"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be a number >= 0"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p must be"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, 400, "seed", "seed must be"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens", "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens", "leave room for"),
    ("/v1/completions", {"prompt": "the cat " * 200}, 400, "prompt", "has no room"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt", "token ids must be in"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "the prompt is empty"),
    ("/v1/completions", {}, 400, "prompt", "prompt must be"),
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop", "stop must be a string or a list of strings"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "true or false"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"usage": True}}, 400, "stream_options.usage",
     "unrecognized"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs",
     "logprobs must be None or an integer in [0, 20]"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, 400, "logprobs", "logprobs must be"),
    ("/v1/completions", {"prompt": "x", "tools": []}, 400, "tools", "unrecognized request argument: tools"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "does not exist"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "at least one message"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role", "one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_calls": [1]}]}, 400,
     "messages[0].tool_calls", "not supported"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_completion_tokens",
     "leave room for"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": 1}, 400, "logprobs", "true or false"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs must be None or an integer in [0, 20]"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs: true"),
    # features not built yet refuse their non-default values in one line naming the field (issue 64)
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, 400, "response_format",
     "response_format must be {'type': 'text' | 'json_object'"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", "no tool calls"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, "tool_choice", "no tool calls"),
    ("/v1/chat/completions", {"messages": CHAT, "presence_penalty": 2.5}, 400, "presence_penalty", "in [-2, 2]"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"5": 1}}, 400, "logit_bias", "no logit bias"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 33}, 400, "n", "n (answers of each prompt) must be an integer in"),
    ("/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of", "best_of (2) must be at least n (3)"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "stream": True}, 400, "best_of", "cannot be streamed"),
    ("/v1/chat/completions", {"messages": CHAT, "audio": {"voice": "x"}}, 400, "audio", "text output only"),
    ("/v1/chat/completions", {"messages": CHAT, "store": True}, 400, "store", "not stored"),
    ("/v1/chat/completions", {"prompt": "x"}, 400, "prompt", "unrecognized"),
    # numbers at their edges and text that is not text (issue 66): refused with a 400, never a 500
    ("/v1/completions", '{"prompt": "x", "temperature": 1e999}', 400, "temperature", "must be a number"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e-300}, 400, "temperature", "temperature must be a number"),
    ("/v1/completions", {"prompt": "x", "temperature": 5e-324}, 400, "temperature", "temperature must be a number"),
    ("/v1/completions", '{"prompt": "x", "top_p": 1e999}', 400, "top_p", "top_p must be"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1e999}', 400, "max_tokens", "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens", "max_tokens must be an integer"),
    ("/v1/completions", {"prompt": "x", "seed": True}, 400, "seed", "seed must be an integer"),
    ("/v1/completions", {"prompt": "x", "top_k": True}, 400, "top_k", "top_k must be an integer"),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": -1e999}', 400, "presence_penalty", "must be a number"),
    ("/v1/completions", {"prompt": [True, 2]}, 400, "prompt", "token ids"),
    ("/v1/completions", '{"prompt": "caf\\udce9"}', 400, "prompt", "lone surrogate"),
    ("/v1/completions", '{"prompt": "x", "stop": "\\ud800"}', 400, "stop", "stop must be"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages[0].content",
     "lone surrogates"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "max_completion_tokens must be an integer >= 1"),
]


@pytest.fixture(scope="module")
def client(checkpoints):
    with serving(checkpoints) as client:
        yield client


@pytest.mark.parametrize("path, body, status, param, message", BAD_REQUESTS)
def test_a_bad_request_is_refused_in_the_openai_shape_naming_the_field(client, path, body, status, param, message):
    reply = client.post(path, content=body) if isinstance(body, str) else client.post(path, json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert client.get("/health").json() == {"status": "ok", "running": 0, "waiting": 0}


def test_the_field_of_a_refused_setting_is_the_errors_not_its_messages(client, monkeypatch):
    """param is the SettingError's field, as the request names it, whatever the message says."""
    def refuse(target, ids, settings):
        raise minispec.SettingError("top_k", "prompt: a message whose first word names another field")

    monkeypatch.setattr(minispec.api.Request, "from_settings", refuse)
    error = client.post("/v1/completions", json={"prompt": "x"}).json()["error"]
    assert error["param"] == "top_k" and error["message"].startswith("prompt: a message"), error


def test_a_body_beyond_the_bound_is_refused_unread(client, monkeypatch):
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 100)
    reply = client.post("/v1/completions", json={"prompt": "x" * 200})
    assert reply.status_code == 413 and "larger than 100 bytes" in reply.json()["error"]["message"]


def test_neutral_values_of_unsupported_fields_and_text_content_parts_are_accepted(client, alone):
    neutral = {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0, "logit_bias": {}, "logprobs": False,
               "user": "u", "model": "tiny", "temperature": 0, "max_completion_tokens": 6, "stream_options": None}
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat"}, {"type": "text", "text": "sat"}]}]
    reply = client.post("/v1/chat/completions", json={"messages": parts, **neutral})
    assert reply.status_code == 200, reply.json()
    text = expected(alone, [{"role": "user", "content": "the cat\nsat"}], max_new_tokens=6).text
    assert reply.json()["choices"][0]["message"]["content"] == text


# Each field an OpenAI client may send, at its default value (issue 64): taken, and changing nothing.
OPENAI_DEFAULTS = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "user": "u",
                   "temperature": 1, "top_p": 1, "stream": False, "seed": 7, "max_tokens": 6}
CHAT_DEFAULTS = {**OPENAI_DEFAULTS, "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"},
                 "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": [],
                 "function_call": "auto", "store": False, "metadata": {"k": "v"}, "service_tier": "auto",
                 "modalities": ["text"], "verbosity": "medium", "prompt_cache_key": "k", "safety_identifier": "s",
                 "prediction": {"type": "content", "content": "the"}}
COMPLETION_DEFAULTS = {**OPENAI_DEFAULTS, "best_of": 1, "echo": False, "suffix": "", "logprobs": None}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_every_openai_field_is_taken_at_its_default_and_at_null(client, chat):
    from minispec.serve.protocol import FIELDS

    path, base = ("/v1/chat/completions", {"messages": CHAT}) if chat else ("/v1/completions", {"prompt": PROMPTS[0]})
    seeded = {**base, "seed": 7, "max_tokens": 6}
    plain = client.post(path, json=seeded).json()["choices"][0]
    defaults = client.post(path, json={**base, **(CHAT_DEFAULTS if chat else COMPLETION_DEFAULTS)})
    nulls = client.post(path, json={**seeded, **{name: None for name in FIELDS[chat] if name not in seeded}})
    for reply in (defaults, nulls):
        assert reply.status_code == 200, reply.json()
        assert reply.json()["choices"][0] == plain


@pytest.mark.parametrize("name", sorted(REAL))
def test_chats_in_other_templates(checkpoints, tmp_path, name):
    """Any template: the checkpoint's, rendered; one that refuses the messages (Gemma 2: no system role) is
    a bad request naming the template's error."""
    target = tmp_path / "target"
    shutil.copytree(checkpoints[0], target)
    (target / "chat_template.jinja").write_text(REAL[name], encoding="utf-8")
    greedy = {"temperature": 0, "max_tokens": 6}
    chat = CHAT if name == "smollm3" else CHAT[1:]  # SmolLM3's default system prompt outgrows the tiny context
    with serving((target, checkpoints[1])) as client:
        reply = client.post("/v1/chat/completions", json={"messages": chat, **greedy})
        refused = client.post("/v1/chat/completions", json={"messages": CHAT, **greedy})
    text = expected((minispec.load(target), None), chat, max_new_tokens=6).text
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == text
    if name == "gemma-2":
        assert refused.status_code == 400 and "System role not supported" in refused.json()["error"]["message"]
    else:
        assert refused.status_code == 200


def test_chat_template_kwargs_reach_the_template(checkpoints, tmp_path):
    """vLLM's chat_template_kwargs: the template's own variables (Qwen3's enable_thinking), as chat_prompt takes
    them; what the server renders with is not a request's to set."""
    target = tmp_path / "target"
    shutil.copytree(checkpoints[0], target)
    (target / "chat_template.jinja").write_text(REAL["qwen3"], encoding="utf-8")
    greedy = {"temperature": 0, "max_tokens": 6}
    with serving((target, checkpoints[1])) as client:
        thinking = client.post("/v1/chat/completions", json={"messages": CHAT[1:], **greedy})
        plain = client.post("/v1/chat/completions", json={"messages": CHAT[1:], **greedy,
                                                          "chat_template_kwargs": {"enable_thinking": False}})
        taken = client.post("/v1/chat/completions", json={"messages": CHAT[1:], **greedy,
                                                          "chat_template_kwargs": {"messages": []}})
    model = minispec.load(target)
    ids = minispec.chat_prompt(model.tokenizer, CHAT[1:], enable_thinking=False)
    assert ids != minispec.chat_prompt(model.tokenizer, CHAT[1:])  # the variable changes the prompt
    text = minispec.generate(model, ids, draft="lookup", gamma=3, max_new_tokens=6).text
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == text
    assert thinking.json()["choices"][0]["message"]["content"] == expected((model, None), CHAT[1:], max_new_tokens=6).text
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "chat_template_kwargs.messages"


def test_unknown_paths_and_methods_and_the_models_list(client):
    missing, wrong = client.get("/v1/nothing"), client.get("/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "Not Found"
    assert wrong.status_code == 405 and "error" in wrong.json()
    assert [model["id"] for model in client.get("/v1/models").json()["data"]] == ["tiny"]


def test_an_exception_in_one_request_fails_it_alone(checkpoints, alone, monkeypatch, caplog):
    """A request whose processing raises gets a 500 (streamed: an error event); the others in its batch
    get their outputs unchanged, and the server serves on."""
    real = scheduler_module.Job.advance

    def advance(job, tokens, logprobs, result):
        if job.request.max_new_tokens == 13:
            raise RuntimeError("planted")
        return real(job, tokens, logprobs, result)

    monkeypatch.setattr(scheduler_module.Job, "advance", advance)
    steps = Steps(monkeypatch)
    greedy = {"temperature": 0, "max_tokens": 20}
    with serving(checkpoints, rows=3) as client:
        steps.hold()
        calls = [post(client, "/v1/completions", {"prompt": PROMPTS[0], **greedy}),
                 post(client, "/v1/completions", {"prompt": PROMPTS[1], **greedy, "max_tokens": 13}),
                 streamed(client, "/v1/completions", {"prompt": PROMPTS[2], **greedy, "max_tokens": 13}),
                 post(client, "/v1/completions", {"prompt": PROMPTS[3], **greedy})]
        steps.open_when(queued(client, 4))
        good, failed, failed_stream, other = in_threads(calls)
        later = client.post("/v1/completions", json={"prompt": PROMPTS[4], **greedy})
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert "logged" in failed.json()["error"]["message"]
    assert failed_stream[-1]["error"]["type"] == "server_error"
    for reply, prompt in ((good, PROMPTS[0]), (other, PROMPTS[3]), (later, PROMPTS[4])):
        assert reply.json()["choices"][0]["text"] == expected(alone, prompt, max_new_tokens=20).text
    assert caplog.text.count("RuntimeError: planted") == 2


def test_a_failure_inside_the_engine_fails_its_batch_and_the_server_serves_on(checkpoints, alone, monkeypatch,
                                                                               caplog):
    real, calls = engine.step, []

    def step(target, rows):
        calls.append(len(rows))
        if len(calls) == 3:
            raise RuntimeError("planted in the engine")
        return real(target, rows)

    monkeypatch.setattr(engine, "step", step)
    with serving(checkpoints, rows=2) as client:
        failed = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 10, "temperature": 0})
        later = client.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0})
        health = client.get("/health").json()
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert later.json()["choices"][0]["text"] == expected(alone, PROMPTS[1], max_new_tokens=10).text
    assert health == {"status": "ok", "running": 0, "waiting": 0}
    assert "planted in the engine" in caplog.text


def test_an_api_key_is_checked_on_every_request(checkpoints):
    with serving(checkpoints, api_key="sekrit") as client:
        for path in ("/health", "/v1/models"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert client.get(path, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["www-authenticate"] == "Bearer"


def test_the_openai_client_over_http(checkpoints, alone):
    """The official client, against uvicorn: chat and completions, streamed and not; its errors."""
    app, scheduler = make_app(checkpoints, rows=2, api_key="k")
    greedy = {"temperature": 0, "max_tokens": 16}
    with uvicorn_serving(app, scheduler) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        assert [model.id for model in client.models.list()] == ["tiny"]
        chat = client.chat.completions.create(model="tiny", messages=CHAT, **greedy)
        stream = client.chat.completions.create(model="tiny", messages=CHAT, stream=True,
                                                stream_options={"include_usage": True}, **greedy)
        chunks = list(stream)
        completion = client.completions.create(model="tiny", prompt=PROMPTS[0], **greedy)
        streamed = "".join(chunk.choices[0].text for chunk in
                           client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True, **greedy))
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="must be an integer in"):
            client.completions.create(model="tiny", prompt="x", n=33)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    chat_out, completion_out = expected(alone, CHAT, max_new_tokens=16), expected(alone, PROMPTS[0], max_new_tokens=16)
    assert chat.choices[0].message.content == chat_out.text and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == len(chat_out.tokens)
    assert chat.model_extra["speculative"]["tokens_per_target_call"] == chat_out.stats["tokens_per_target_call"]
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == chat_out.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(chat_out.tokens)
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert completion.choices[0].text == streamed == completion_out.text


def test_a_shutdown_gives_requests_their_grace_then_ends_them_cleanly(checkpoints, monkeypatch):
    """What SIGTERM starts (Server.handle_exit): a stream under way has --shutdown-timeout seconds to
    finish, then ends with an error event and [DONE], not a cut connection; the server then exits."""
    Steps(monkeypatch, delay=0.01)  # 200 steps: two seconds
    app, scheduler = make_app(checkpoints)
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with uvicorn_serving(app, scheduler, shutdown_timeout=0.3) as (url, server):
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            server.handle_exit(signal.SIGTERM, None)
            rest = [line for line in lines if line]
        wait_until(lambda: not scheduler.thread.is_alive())
    assert rest[-1] == "data: [DONE]" and len(rest) < 100
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error == {"message": "the server is shutting down", "type": "server_error", "param": None, "code": None}


def test_a_draining_server_refuses_new_requests(checkpoints):
    with serving(checkpoints) as client:
        client.scheduler.drain(30)
        refused = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        assert client.get("/health").json()["status"] == "stopping"


def test_sigterm_stops_a_serving_process_cleanly(checkpoints, tmp_path):
    """A request under way when SIGTERM comes is finished; then the process exits, within a bound."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    process = subprocess.Popen([sys.executable, "-m", "minispec.serve", "--target", str(checkpoints[0]),
                                "--port", str(port), "--device", "cpu", "--threads", "1", "--shutdown-timeout", "20"],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: up(url), timeout=60)
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
        started = time.monotonic()
        status = process.wait(timeout=30)
        assert time.monotonic() - started < 10
    finally:
        process.kill()
        stderr = process.communicate()[1]
    assert status in (0, -signal.SIGTERM), stderr
    assert "Application shutdown complete" in stderr and "Traceback" not in stderr, stderr


def up(url):
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--max-queue", "0"], "--max-queue must be >= 1"),
    (["--max-model-len", str(CONTEXT + 1)], "exceeds"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1"),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout must be"),
    (["--gamma", "0"], "gamma"),
    (["--tree", "0"], "tree"),
    (["--tree", "4", "--draft", "none"], "lookup"),
    (["--threads", "100000"], "--threads must be between"),
    (["--draft", "./nope"], "nope does not exist"),
    (["--port", "70000"], "--port must be between"),
])
def test_bad_flags_exit_2_with_one_line(checkpoints, capsys, monkeypatch, tmp_path, flags, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(serve_main.Server, "run", lambda server: pytest.fail("bad flags started the server"))
    assert serve_main.main(["--target", str(checkpoints[0]), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_a_target_without_a_tokenizer_is_refused(reference_dirs, capsys, monkeypatch):
    monkeypatch.setattr(serve_main.Server, "run", lambda server: pytest.fail("the server started"))
    assert serve_main.main(["--target", str(reference_dirs["gpt2"][1]), "--device", "cpu"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err


def test_only_the_server_imports_the_asgi_stack():
    package = ROOT / "minispec"
    for file in package.rglob("*.py"):
        if file.parent.name == "serve":
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(name.split(".")[0] in ("starlette", "uvicorn") for name in names), file


def test_a_body_longer_than_the_context_can_hold_is_refused_untokenized(client, monkeypatch):
    """A body beyond what a prompt of the server's context can spell is refused (413) before its prompt
    is tokenized (which costs far more time and memory than the body)."""
    bound = app_module.body_bound(client.scheduler)
    assert bound < app_module.MAX_BODY_BYTES
    monkeypatch.setattr(client.scheduler.target.tokenizer, "encode", lambda *a, **k: pytest.fail("tokenized"))
    reply = client.post("/v1/completions", json={"prompt": "x" * bound})
    assert reply.status_code == 413 and f"larger than {bound} bytes" in reply.json()["error"]["message"]
