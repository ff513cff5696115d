"""The suffix drafter's store kept between processes (decoding/suffix.py): beside the profiles, one file per
vocabulary, read when a target's store is made and written at exit and while requests finish. A store
comes back as it was (the same guesses); a second server drafts from the first one's traffic on its first
request, its output unchanged; a corrupt, foreign, oversized file or one with ids outside the vocabulary
is ignored with one line on stderr; two processes writing the same file never leave one that cannot be read."""

import os
import signal
import socket
import struct
import subprocess
import sys

import httpx
import pytest
import torch
from test_serve import PROMPTS, ROOT, alone, checkpoints, expected, up, wait_until  # noqa: F401 (fixtures)

from minispec.decoding import suffix

TEXTS = [[5, 17, 33, 8, 90, 41, 2], [5, 17, 33, 9, 1], [7, 17, 33, 8, 90, 44]]


class Target:
    """What a store is kept for: a vocabulary (a checkpoint's fingerprint here, no tokenizer) and its size."""

    def __init__(self, fingerprint="tiny", vocab_size=100):
        self.tokenizer, self.fingerprint, self.vocab_size, self.device = None, fingerprint, vocab_size, "cpu"


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_PROFILES", str(tmp_path))
    return tmp_path


def guesses(target, prompt):
    drafter = suffix.SuffixDrafter(target)
    drafter.start(torch.tensor(prompt))
    return drafter.preview(4), drafter.preview_tree(3, 8)


def kept(texts, target=None):
    """A store for `target` that remembered `texts`, saved; returns the target."""
    target = target or Target()
    store = suffix.store_for(target)
    for text in texts:
        store.remember(text)
    store.save()
    return target


def test_a_store_comes_back_with_the_same_guesses(folder):
    first = kept(TEXTS)
    [file] = folder.iterdir()
    assert file.name.startswith("suffix-") and file.stat().st_size == suffix.HEADER + 4 * (3 + 18)
    second = Target()  # another process's target: its store made from the file
    assert list(suffix.store_for(second).texts) == TEXTS
    assert guesses(second, [1, 17, 33]) == guesses(first, [1, 17, 33]) and guesses(second, [1, 17, 33])[0][0]
    assert suffix.store_for(Target("other")).texts == suffix.deque()  # another vocabulary: its own file, none yet


def test_nothing_is_kept_when_profiles_are_off(tmp_path, monkeypatch):
    monkeypatch.setenv("MINISPEC_PROFILES", "off")
    kept(TEXTS)
    monkeypatch.setenv("MINISPEC_PROFILES", str(tmp_path))
    assert suffix.store_for(Target()).texts == suffix.deque() and list(tmp_path.iterdir()) == []


def test_a_store_is_saved_while_requests_finish(folder, monkeypatch):
    """Not only at exit: a process killed hard leaves what it had SAVE_EVERY seconds before."""
    monkeypatch.setattr(suffix, "SAVE_EVERY", 0.0)
    store = suffix.store_for(Target())
    store.remember(TEXTS[0])
    wait_until(lambda: list(folder.glob("suffix-*")) and store.saved == 1)
    assert list(suffix.store_for(Target()).texts) == TEXTS[:1]


def stored(path, lengths, tokens, tail=b""):
    """A store file written by hand in the place of `path` (keeping its key): its texts' lengths and tokens."""
    numbers = [len(lengths), len(tokens), *lengths, *tokens]
    key = path.read_bytes()[len(suffix.MAGIC):suffix.HEADER - 8]
    path.write_bytes(suffix.MAGIC + key + struct.pack(f"<{len(numbers)}I", *numbers) + tail)


def foreign(folder, path):
    """Another vocabulary's file, in this one's place."""
    kept(TEXTS, Target("other"))
    [other] = [p for p in folder.glob("suffix-*") if p != path]
    os.replace(other, path)


@pytest.mark.parametrize("spoil, note", [
    (lambda folder, path: path.write_bytes(os.urandom(200)), "not a suffix store"),
    (lambda folder, path: path.write_bytes(path.read_bytes()[:-3]), "truncated"),
    (lambda folder, path: path.write_bytes(path.read_bytes() + b"\0\0\0\0"), "longer than it says"),
    (foreign, "another vocabulary's"),
    (lambda folder, path: stored(path, [2], [3, 100]), "token id 100 is outside the vocabulary (100 tokens)"),
    (lambda folder, path: stored(path, [2], [3, 4], bytes(8 * suffix.STORE_TOKENS)), "larger than a store of"),
    (lambda folder, path: stored(path, [2, 3], [3, 4]), "lengths are not its token count"),
    (lambda folder, path: stored(path, [1, 1, 1], [1, 2, 1]), None),  # a sound file, made otherwise: read
])
def test_a_file_that_cannot_be_used_is_ignored_with_one_line(folder, capfd, spoil, note):
    kept(TEXTS)
    [path] = folder.glob("suffix-*")
    spoil(folder, path)
    capfd.readouterr()
    store = suffix.store_for(Target())
    err = capfd.readouterr().err
    if note is None:
        assert err == "" and list(store.texts) == [[1], [2], [1]]
        return
    assert err.count("\n") == 1 and err.startswith(f"minispec: ignoring the suffix store {path}: ") and note in err, err
    assert store.texts == suffix.deque() and store.size == 0  # cold
    store.remember([1, 2, 3])  # and from now on its own file, as a new one
    store.save()
    assert list(suffix.store_for(Target()).texts) == [[1, 2, 3]] and capfd.readouterr().err == ""


def test_a_wrong_count_in_a_file_is_refused(folder, capfd):
    """More tokens than a store keeps, however the file was made."""
    kept(TEXTS)
    [path] = folder.glob("suffix-*")
    stored(path, [], [])
    path.write_bytes(path.read_bytes()[:-8] + struct.pack("<II", 1, suffix.STORE_TOKENS + 1))
    capfd.readouterr()
    assert suffix.store_for(Target()).texts == suffix.deque()
    assert "more than a store keeps" in capfd.readouterr().err


WRITER = """
import sys
from pathlib import Path
from minispec.decoding import suffix
path, key, mark = Path(sys.argv[1]), sys.argv[2].encode(), int(sys.argv[3])
store = suffix.Store()
store.file = suffix.StoreFile(path, key, 100)
for _ in range(15):
    store.remember([mark] * 30000)
    store.save()
"""


def test_two_processes_writing_one_file_never_leave_it_unreadable(folder, capfd):
    """Two replicas saving their stores into one file at once, a third reading it meanwhile: every read
    finds one writer's store, whole."""
    target = kept([[1]])
    [path] = folder.glob("suffix-*")
    key = path.read_bytes()[len(suffix.MAGIC):suffix.HEADER - 8].decode()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), key, str(mark)], env=env) for mark in (7, 8)]
    file, reads = suffix.file_of(target), []
    while any(writer.poll() is None for writer in writers):
        texts = suffix.stored_texts(file, suffix.STORE_TOKENS)
        assert texts and all(set(text) == {texts[0][0]} and len(text) in (1, 30000) for text in texts)
        reads.append(texts[0][0])
    assert [writer.returncode for writer in writers] == [0, 0]
    assert capfd.readouterr().err == "" and {7, 8} <= set(reads), set(reads)
    assert [name for name in os.listdir(folder) if name.endswith((".tmp", ".partial"))] == []


def serve(checkpoints, folder, *flags):
    """A server process over the tiny target with draft="suffix" keeping its store in `folder`."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "minispec.serve", "--target", str(checkpoints[0]), "--device",
                                "cpu", "--threads", "1", "--port", str(port), "--draft", "suffix", *flags],
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "MINISPEC_PROFILES": str(folder)},
                               stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: up(url) or process.poll() is not None, timeout=90)
    return process, url


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process):
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    finally:
        process.kill()
        stderr = process.communicate()[1]
    assert "Traceback" not in stderr, stderr
    return stderr


def test_a_second_server_drafts_from_the_first_ones_traffic_on_its_first_request(checkpoints, alone, tmp_path):
    """Replica A serves a request and stops (SIGTERM); replica B, started on the same folder, gets the
    request again as its first: its guesses, A's output from the store, are nearly all accepted (A's,
    from the request alone, far fewer), and its output is still plain greedy's."""
    body = {"prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    replies = []
    for _ in range(2):
        process, url = serve(checkpoints, tmp_path / "profiles", "--gamma", "4", "--tree", "off")
        try:
            assert up(url), process.stderr.read() if process.poll() is not None else "not up"
            reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            replies.append(reply.json())
        finally:
            stop(process)
    plain = expected(alone, PROMPTS[1], draft=None, max_new_tokens=40, ignore_eos=True).text
    assert [reply["choices"][0]["text"] for reply in replies] == [plain, plain]
    cold, warm = (reply["speculative"] for reply in replies)
    assert warm["accepted_lengths"][4] >= warm["target_calls"] - 2 and warm["tokens_per_target_call"] >= 4
    assert cold["target_calls"] >= 2 * warm["target_calls"], (cold, warm)
    assert len(list((tmp_path / "profiles").glob("suffix-*.bin"))) == 1
