"""What gamma="auto" learns about a (target, drafter) pair (`PairProfile`), kept between processes (each
run.py call is one): a JSON file a pair in MINISPEC_PROFILES (default: `profiles/` in the weights folder;
"off" keeps nothing), named by a hash of all the costs depend on, written whole; a bad file is ignored (noted).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch

from ..loading.weights import weights_dir, write_whole
from .rates import CONFIDENCE_BINS, DEFAULT_ALPHA

VERSION = 9  # of the files' contents: files of another version, whose costs were other kernels', are ignored
FIELDS = ("t_verify", "t_draft", "first", "later", "plain_steps", "probe_after", "confidence", "tree_confidence",
          "modes")
# Steps before a probe of what does not pay (guessing, the mode behind), doubled up to PROBE_MAX while it does not.
PROBE_AFTER, PROBE_MAX = 8, 128


class PairProfile:
    """What one (target, drafter) pair has learnt across requests: its timings and acceptance rates."""

    def __init__(self):
        self.t_verify = None  # seconds of a target forward over w tokens, index w (0 unused): a line
        self.t_draft = None  # seconds per guess
        # a and b (rates.py); b is None (a stands in) until measured: a prior of its own could lock it out
        self.first, self.later = DEFAULT_ALPHA, None
        self.plain_steps, self.probe_after = 0, PROBE_AFTER  # steps without guesses since the last probe
        # decayed [accepted, verified] per confidence bin: the chains', and previewed tree nodes' at depth 1 and deeper
        self.confidence = [[0.0, 0.0] for _ in range(CONFIDENCE_BINS)]
        self.tree_confidence = [[[0.0, 0.0] for _ in range(CONFIDENCE_BINS)] for _ in range(2)]
        # decayed [tokens, seconds, steps] of chain, tree and plain steps (a branching drafter's choice)
        self.modes = {"chain": [0.0, 0.0, 0.0], "tree": [0.0, 0.0, 0.0], "plain": [0.0, 0.0, 0.0]}
        self.mode_steps, self.mode_probe_after, self.preferred = 0, PROBE_AFTER, "chain"
        self.key = None  # of the pair's file (pair_key); None: kept in this process only


def folder():
    """Where profiles live, or None when they are not to be kept."""
    setting = os.environ.get("MINISPEC_PROFILES")
    if setting == "off":
        return None
    return Path(setting).expanduser() if setting else weights_dir() / "profiles"


def identity(model):
    """What a model's costs depend on besides its checkpoint (model.fingerprint, set by the loader)."""
    device = model.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"checkpoint": model.fingerprint, "dtype": str(model.dtype).removeprefix("torch."), "device": name,
            "compiled": model.compiled_forward is not None}


def pair_key(target, drafter, beams, k_max):
    """The key of a pair's file (a dict), or None for models not loaded from a checkpoint."""
    draft, weights = drafter.model, getattr(drafter, "weights", None)  # weights: Medusa heads'
    if target.fingerprint is None or any(m is not None and m.fingerprint is None for m in (draft, weights)):
        return None
    drafted_by = drafter.name if weights is None else f"{drafter.name} {weights.fingerprint}"
    return {"version": VERSION, "target": identity(target), "beams": beams, "k_max": k_max,
            "draft": identity(draft) if draft is not None else drafted_by, "threads": torch.get_num_threads(),
            "torch": torch.__version__, **({"with": drafter.mixed_with} if hasattr(drafter, "mixed_with") else {})}


def path_of(key):
    where = folder()
    if where is None or key is None:
        return None
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return where / f"{digest}.json"


def load(key, profile):
    """Fill a PairProfile from the pair's file; returns whether there was one."""
    path = path_of(key)
    if path is None or not path.is_file():
        return False
    try:
        stored = json.loads(path.read_text())
        if stored["key"] != json.loads(json.dumps(key)):  # JSON's lists for tuples
            raise ValueError("written for another pair")
        values = {name: stored["profile"][name] for name in FIELDS}
        check(values, key["k_max"] + 2)
    except (OSError, ValueError, KeyError, TypeError) as error:
        print(f"minispec: ignoring the stored costs {path}: {error}", file=sys.stderr)
        return False
    for name, value in values.items():
        setattr(profile, name, value)
    return True


def check(values, widths):
    """A file's values as the policy needs them: finite seconds, rates in [0, 1], counts >= 0."""
    def number(x, high):
        return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= high

    def numbers(xs, length, high, check=number):
        return isinstance(xs, list) and len(xs) == length and all(check(x, high) for x in xs)

    def counts(pair, high):  # [accepted, verified]
        return numbers(pair, 2, high) and pair[0] <= pair[1]

    def bins(counted, high):
        return numbers(counted, CONFIDENCE_BINS, high, counts)

    v, modes = values, values["modes"]
    fine = ((v["t_verify"] is None or numbers(v["t_verify"], widths, 1e6))  # None: no step timed yet
            and (v["t_draft"] is None or number(v["t_draft"], 1e6))
            and number(v["first"], 1.0) and (v["later"] is None or number(v["later"], 1.0))
            and isinstance(v["plain_steps"], int) and v["plain_steps"] >= 0
            and isinstance(v["probe_after"], int) and v["probe_after"] >= 1
            and bins(v["confidence"], 1e9) and numbers(v["tree_confidence"], 2, 1e9, bins)
            and isinstance(modes, dict) and sorted(modes) == ["chain", "plain", "tree"]
            and all(numbers(m, 3, 1e9) for m in modes.values()))
    if not fine:
        raise ValueError("values out of range or of another shape")


def save(key, profile):
    """Write the pair's file whole; a folder that cannot be written is noted once."""
    global unwritable
    path = path_of(key)
    if path is None:
        return
    text = json.dumps({"key": key, "profile": {name: getattr(profile, name) for name in FIELDS}})
    try:
        write_whole(path, lambda file: file.write_text(text), sync=True)
    except OSError as error:
        if not unwritable:
            print(f"minispec: cannot keep gamma='auto' costs in {path.parent}: {error.strerror or error}",
                  file=sys.stderr)
        unwritable = True


unwritable = False  # noted once a process
