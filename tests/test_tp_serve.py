"""The server on a tensor-parallel target (minispec/serve/group.py): `minispec.serve --tp 2`, two gloo
processes on the CPU started here as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR/PORT), on
test_serve.py's tiny llama. Requests overlapping in a continuous batch, speculative with a draft model,
streamed or not, get what one process gives them; SIGTERM to rank 0 stops both ranks; a rank killed
mid-service fails the next request with 503 naming it, and rank 0 exits within the stated bound.
Replicas: the README's nginx example, as written, in front of two servers sharing a profiles folder."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from test_serve import (PROMPTS, alone, checkpoints, expected, make_app, streamed, text_of, up,  # noqa: F401 (fixtures)
                        uvicorn_serving, wait_until)

from minispec.decoding import profiles
from minispec.serve import __main__ as serve_main

ROOT = Path(__file__).resolve().parents[1]
STARTUP = 90  # seconds for both ranks to load and rank 0 to listen


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def ranks(checkpoints, tmp_path, *flags):
    """Rank 0 and rank 1 of `python -m minispec.serve --tp 2` on the tiny target; yields the base URL,
    the two processes and a function reading their logs."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    command = [sys.executable, "-m", "minispec.serve", "--tp", "2", "--target", str(checkpoints[0]), "--device", "cpu",
               "--threads", "1", "--port", str(port), "--batch-size", "2", *map(str, flags)]
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    files = [open(log, "w") for log in logs]
    processes = [subprocess.Popen(command, cwd=ROOT, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                  stdout=subprocess.DEVNULL, stderr=file) for rank, file in enumerate(files)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: up(url) or any(p.poll() is not None for p in processes), timeout=STARTUP)
        assert up(url), [log.read_text()[-3000:] for log in logs]
        yield url, processes, lambda rank: logs[rank].read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        for file in files:
            file.close()


def complete(url, prompt, **fields):
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_two_ranks_serve_what_one_process_serves_and_stop_together_on_sigterm(checkpoints, alone, tmp_path):
    """A draft model (on rank 0), 4 requests over 2 rows (so some wait and join the batch later), one
    streamed, one a chat: each the single process's greedy text. Then SIGTERM to rank 0 ends both."""
    with ranks(checkpoints, tmp_path, "--draft", checkpoints[1]) as (url, processes, log):
        group = httpx.get(url + "/health").json()["tp"]
        assert (group["ranks"], group["state"]) == (2, "ok")
        chat = [{"role": "user", "content": "the cat sat on the mat?"}]

        body = {"prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=url, timeout=60) as client:
            texts = [pool.submit(lambda p=p: complete(url, p).json()["choices"][0]["text"]) for p in PROMPTS[:3]]
            stream = pool.submit(streamed(client, "/v1/completions", body))
            answer = httpx.post(url + "/v1/chat/completions", timeout=60, json={
                "messages": chat, "max_tokens": 16, "temperature": 0, "ignore_eos": True}).json()
            texts = [text.result() for text in texts]
            events = stream.result()
        for prompt, text in zip(PROMPTS, texts):
            assert text == expected(alone, prompt, draft="model", max_new_tokens=16, ignore_eos=True).text
        assert len(events) > 2  # chunks as the steps go
        assert text_of(events) == expected(alone, PROMPTS[3], draft="model", max_new_tokens=16, ignore_eos=True).text
        assert answer["choices"][0]["message"]["content"] == expected(alone, chat, draft="model", max_new_tokens=16,
                                                                      ignore_eos=True).text
        after = httpx.get(url + "/health").json()["tp"]["broadcasts"]  # rank 0's mirrored calls, counted
        assert after["forwards"] - group["broadcasts"]["forwards"] >= 5 and after["calls"] > after["forwards"]
        assert after["seconds"] > group["broadcasts"]["seconds"]
        processes[0].send_signal(signal.SIGTERM)
        statuses = [process.wait(timeout=30) for process in processes]
        assert statuses[0] in (0, -signal.SIGTERM) and statuses[1] == 0, (statuses, log(0)[-3000:], log(1)[-3000:])
        assert "Traceback" not in log(0) + log(1), log(0) + log(1)


def test_a_killed_rank_fails_requests_with_503_and_rank_0_exits_naming_it(checkpoints, alone, tmp_path):
    """With a self-draft (the target's int8 copy, sharded too: its calls are mirrored as the target's)
    the single process's text; then rank 1 killed: the next request fails (503) naming it, and rank 0
    exits with that line within the bound --tp-timeout states."""
    timeout = 3
    with ranks(checkpoints, tmp_path, "--draft", "int8", "--tp-timeout", timeout) as (url, processes, log):
        reply = complete(url, PROMPTS[0]).json()
        assert reply["speculative"]["draft"] == "int8" and reply["speculative"]["acceptance_rate"] > 0
        assert reply["choices"][0]["text"] == expected(alone, PROMPTS[0], max_new_tokens=16, ignore_eos=True).text
        processes[1].kill()
        killed = time.monotonic()
        reply = complete(url, PROMPTS[1])
        assert reply.status_code == 503, reply.text
        message = reply.json()["error"]["message"]
        assert "rank 1 of 2 stopped responding" in message, message
        status = processes[0].wait(timeout=4 * timeout + 10)
        elapsed = time.monotonic() - killed
        assert status == 1 and elapsed < 2.5 * timeout + 5, (status, elapsed)  # the bound --tp-timeout states
        errors = [line for line in log(0).splitlines() if line.startswith("error: ")]
        assert errors == [f"error: {message}"], log(0)[-3000:]


def test_a_bad_tp_timeout_is_refused_in_one_line(checkpoints, capsys):
    assert serve_main.main(["--target", str(checkpoints[0]), "--tp-timeout", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tp-timeout must be a number of seconds" in err, err


@pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")
def test_the_readme_replicas_behind_nginx(checkpoints, alone, tmp_path, monkeypatch):
    """The README's nginx configuration (its ports changed for free ones) in front of two servers that
    share a profiles folder: requests, streamed ones too, reach both and get what one server gives; the
    replica that serves second starts from the profile the first one wrote."""
    readme = (ROOT / "README.md").read_text()
    [config] = re.findall(r"```nginx\n(.*?)```", readme, re.S)
    monkeypatch.setenv("MINISPEC_PROFILES", str(tmp_path / "profiles"))
    loaded, load = [], profiles.load
    monkeypatch.setattr(profiles, "load", lambda key, profile: loaded.append(load(key, profile)) or loaded[-1])
    (a, a_scheduler), (b, b_scheduler) = (make_app(checkpoints, gamma="auto") for _ in range(2))
    with uvicorn_serving(a, a_scheduler) as (first, _), uvicorn_serving(b, b_scheduler) as (second, _):
        port = free_port()
        for old, new in (("8000", port), ("8001", first.rsplit(":", 1)[1]), ("8002", second.rsplit(":", 1)[1])):
            config = config.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        (tmp_path / "minispec-nginx.conf").write_text(config)
        nginx = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", "minispec-nginx.conf", "-g",
                                  f"daemon off; pid {tmp_path}/nginx.pid; error_log stderr;"], stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: up(url) or nginx.poll() is not None)
            assert complete(url, PROMPTS[0], temperature=0, max_tokens=8).status_code == 200
            body = {"prompt": PROMPTS[3], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
            with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=url, timeout=60) as client:
                texts = [pool.submit(lambda p=p: complete(url, p).json()["choices"][0]["text"]) for p in PROMPTS[:3]]
                events = pool.submit(streamed(client, "/v1/completions", body)).result()
                texts = [text.result() for text in texts]
        finally:
            nginx.terminate()
            stderr = nginx.communicate(timeout=30)[1].decode()
    assert texts == [expected(alone, prompt, max_new_tokens=16, ignore_eos=True).text for prompt in PROMPTS[:3]], stderr
    assert len(events) > 2 and text_of(events) == expected(alone, PROMPTS[3], max_new_tokens=16, ignore_eos=True).text
    assert loaded == [False, True]  # one replica started cold, the other from its profile
