"""What the served workloads decided (python -m minispec.tools.bench --workloads; the figures in
docs/results.md): the server drafts with `suffix` when no draft is given, which matched or beat `lookup`
on the agent loop, the code edits and novel chat."""

from minispec.serve.__main__ import parse_args


def test_the_server_drafts_with_suffix_by_default():
    assert parse_args(["--target", "any"]).draft == "suffix"
    assert parse_args(["--target", "any", "--draft", "lookup"]).draft == "lookup"
