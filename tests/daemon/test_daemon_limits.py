"""Size caps checked on the socket side (fly_llm.common.protocol): each oversized input gets TOO_LONG at once.

Unit tests on decode_request show each cap at its boundary; over a raw socket to a real daemon
(the shared tiny_daemon) each oversized frame is answered TOO_LONG without reaching the scheduler,
and a normal request is served right after.
"""

from __future__ import annotations

import json

import pytest

from fly_llm.client import FLyClient, build_options
from fly_llm.common.config import MAX_STOP_CHARS, MAX_STOP_STRINGS
from fly_llm.common.errors import BadRequest, TooLong
from fly_llm.common.protocol import MAX_MESSAGES, MAX_PROMPT_CHARS, decode_request
from test_daemon_bad_input import _frame, _reply, raw  # noqa: F401 - `raw` is a fixture

USER = {"role": "user", "content": "hi"}


def _tokenize(rid: str, **fields) -> bytes:
    return json.dumps({"v": 1, "id": rid, "kind": "tokenize", **fields}).encode()


def _messages(n: int, chars: int = 2) -> list[dict]:
    return [{"role": "user", "content": "x" * chars}] * n


OVERSIZED = [
    ("prompt", _frame(id="p", prompt="x" * (MAX_PROMPT_CHARS + 1)), "prompt"),
    ("chat messages", _frame(id="m", prompt=None, messages=_messages(MAX_MESSAGES + 1)), "messages"),
    ("chat contents", _frame(id="c", prompt=None, messages=_messages(2, MAX_PROMPT_CHARS // 2 + 1)), "characters"),
    ("stop strings", _frame(id="s", sampling={"stop": ["x"] * (MAX_STOP_STRINGS + 1)}), "stop"),
    ("stop string", _frame(id="l", sampling={"stop": ["x" * (MAX_STOP_CHARS + 1)]}), "stop"),
    ("tokenize text", _tokenize("t", text="x" * (MAX_PROMPT_CHARS + 1)), "text"),
    ("tokenize messages", _tokenize("tm", messages=_messages(MAX_MESSAGES + 1)), "messages"),
]


@pytest.mark.parametrize("name,frame,where", OVERSIZED, ids=[c[0] for c in OVERSIZED])
def test_each_cap_is_too_long_and_named(name, frame, where):
    with pytest.raises(TooLong, match=where):
        decode_request(frame)


def test_inputs_at_the_caps_pass_and_malformed_ones_stay_bad_request():
    at_caps = [
        _frame(prompt="x" * MAX_PROMPT_CHARS, sampling={"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}),
        _frame(prompt=None, messages=_messages(MAX_MESSAGES, MAX_PROMPT_CHARS // MAX_MESSAGES)),
        _tokenize("t", text="x" * MAX_PROMPT_CHARS),
    ]
    for frame in at_caps:
        decode_request(frame)
    for frame in (_frame(sampling={"stop": [""]}), _frame(prompt="x" * (MAX_PROMPT_CHARS + 1), fly={"k": 0})):
        with pytest.raises(BadRequest) as err:
            decode_request(frame)
        assert err.type is BadRequest  # a malformed field wins over a size cap


def test_client_refuses_oversized_input_before_sending():
    with FLyClient("ipc:///nonexistent/fly.sock", timeout=1, max_retries=0) as client:
        with pytest.raises(TooLong):
            client.generate("x" * (MAX_PROMPT_CHARS + 1))
        with pytest.raises(TooLong):
            client.tokenize(messages=_messages(MAX_MESSAGES + 1))
        with pytest.raises(TooLong):
            build_options(stop=["x"] * (MAX_STOP_STRINGS + 1))


def test_daemon_answers_each_oversized_frame_then_serves(tiny_daemon, raw):  # noqa: F811 - the fixture
    with FLyClient(tiny_daemon, timeout=60) as client:
        before = client.status().requests_total
        for name, frame, _ in OVERSIZED:
            raw.send(frame)
            reply = _reply(raw)
            assert (reply.kind, reply.code) == ("error", TooLong.code), name
            assert reply.id == json.loads(frame)["id"]
        assert client.status().requests_total == before  # refused on the socket side, never queued
        result = client.generate("def add(a, b):", *build_options(max_tokens=4, stop=["\n\n"]))
        assert result.usage.completion_tokens >= 1
        assert client.tokenize(text="hello").count >= 1
