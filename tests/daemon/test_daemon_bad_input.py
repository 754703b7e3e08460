"""Malformed input over a raw socket: each frame answered with its code, other clients keep being served.

A frame over the cap is not answered: zmq ends that connection unread (test_daemon_server.py shows it).
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
import zmq

from fly_llm.client import FLyClient, build_options
from fly_llm.common.protocol import UNKNOWN_ID, ErrorReply, decode_reply

GOOD = {"v": 1, "id": "g1", "kind": "generate", "prompt": "def add(a, b):", "sampling": {"max_tokens": 4}}


def _frame(**changes) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def _deep_arguments_frame(rid: str, arguments) -> bytes:
    """A chat whose assistant turn made a call with `arguments` (issue 33: 1,200 levels of `[` stopped the loop)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    return json.dumps({"v": 1, "id": rid, "kind": "generate", "messages": messages}).encode()


_DEEP = "[" * 1200 + "]" * 1200


CASES = [
    ("random bytes", bytes(random.Random(0).randrange(256) for _ in range(200)), UNKNOWN_ID, "BAD_REQUEST"),
    ("invalid json", b'{"v": 1, "id": "j1", "kind": ', UNKNOWN_ID, "BAD_REQUEST"),
    ("not an object", b"[1, 2, 3]", UNKNOWN_ID, "BAD_REQUEST"),
    ("wrong type", _frame(id="t1", prompt=123), "t1", "BAD_REQUEST"),
    ("wrong sampling type", _frame(id="t2", sampling={"max_tokens": "many"}), "t2", "BAD_REQUEST"),
    ("unknown kind", _frame(id="k1", kind="explode"), "k1", "BAD_REQUEST"),
    ("wrong protocol version", _frame(id="v2", v=2), "v2", "BAD_REQUEST"),
    ("unknown field", _frame(id="f1", temperature=0.5), "f1", "BAD_REQUEST"),
    ("negative max_tokens", _frame(id="m1", sampling={"max_tokens": -5}), "m1", "BAD_REQUEST"),
    ("huge max_tokens", _frame(id="m2", sampling={"max_tokens": 10**12}), "m2", "BAD_REQUEST"),
    ("empty prompt", _frame(id="e1", prompt=""), "e1", "BAD_REQUEST"),
    ("prompt and messages", _frame(id="e2", messages=[{"role": "user", "content": "x"}]), "e2", "BAD_REQUEST"),
    ("prompt too long", _frame(id="l1", prompt="a b " * 1000), "l1", "TOO_LONG"),
    ("bad override", _frame(id="o1", fly={"k": 0}), "o1", "BAD_REQUEST"),
    ("unknown id to cancel", json.dumps({"v": 1, "id": "nope", "kind": "cancel"}).encode(), "nope", "BAD_REQUEST"),
    ("deep tool arguments", _deep_arguments_frame("d1", '{"x": ' + _DEEP + "}"), "d1", "BAD_REQUEST"),
    ("deep frame", _deep_arguments_frame("d2", {"x": json.loads("[" * 900 + "]" * 900)}), UNKNOWN_ID, "BAD_REQUEST"),
]


@pytest.fixture
def raw(tiny_daemon):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(tiny_daemon)
    yield sock
    sock.close()


def _reply(sock: zmq.Socket, timeout_s: float = 20.0):
    assert sock.poll(int(timeout_s * 1000)), "no reply from the daemon"
    return decode_reply(sock.recv())


@pytest.mark.parametrize("name,frame,rid,code", CASES, ids=[c[0] for c in CASES])
def test_bad_frame_gets_its_error_code(raw, name, frame, rid, code):
    raw.send(frame)
    reply = _reply(raw)
    assert isinstance(reply, ErrorReply), reply
    assert (reply.id, reply.code) == (rid, code), reply.message


def test_deep_nesting_leaves_the_daemon_serving(tiny_daemon, raw):
    """Issue 33 finding 2: the deep-arguments frame raised out of the frame handler and stopped the daemon."""
    for rid in ("deep1", "deep2"):
        raw.send(_deep_arguments_frame(rid, '{"x": ' + _DEEP + "}"))
        reply = _reply(raw)
        assert (reply.id, reply.code) == (rid, "BAD_REQUEST") and "arguments are not JSON" in reply.message
    with FLyClient(tiny_daemon, timeout=30) as client:
        assert client.health().state == "ready"
        assert client.generate("def add(a, b):", *build_options(max_tokens=4)).usage.completion_tokens > 0


def test_multipart_message_is_refused(raw):
    raw.send_multipart([b"{}", b"{}"])
    reply = _reply(raw)
    assert isinstance(reply, ErrorReply) and reply.code == "BAD_REQUEST"


def test_max_tokens_over_the_daemons_limit_is_capped_not_refused(tiny_daemon):
    """As llama-server and Ollama do (issue 64): the daemon's limit (4096) caps it; the context window ends it."""
    with FLyClient(tiny_daemon, timeout=120) as client:
        sampling, fly = build_options(max_tokens=100_000, loose=False)
        result = client.generate("The quick brown fox", sampling, fly)
        assert result.finish_reason in ("stop", "length") and result.usage.completion_tokens < 512


def test_others_are_served_while_bad_frames_arrive(tiny_daemon, raw):
    sampling, fly = build_options(max_tokens=40, loose=False)
    with FLyClient(tiny_daemon, timeout=60) as client:
        expected = client.generate("The quick brown fox", sampling, fly)
        results: list = []

        def stream() -> None:
            results.append(list(client.stream("The quick brown fox", sampling=sampling, fly=fly)))

        worker = threading.Thread(target=stream)
        worker.start()
        for _, frame, rid, code in CASES * 2:
            raw.send(frame)
            assert _reply(raw).code == code
        worker.join(60)
        assert results and results[0][-1].token_ids == expected.token_ids
        assert "".join(c.text for c in results[0][:-1]) == expected.text


def test_fuzzed_frames_leave_the_daemon_healthy(tiny_daemon, raw):
    """Random mutations of valid frames (bounded: 300 frames or 60 s); every one gets exactly one answer."""
    rng = random.Random(1234)
    seeds = [_frame(), json.dumps({"v": 1, "id": "h", "kind": "health"}).encode(),
             json.dumps({"v": 1, "id": "t", "kind": "tokenize", "text": "hello"}).encode(),
             json.dumps({"v": 1, "id": "c", "kind": "cancel"}).encode(),
             json.dumps({"v": 1, "id": "b", "kind": "heartbeat", "ids": ["x"]}).encode()]
    alphabet = b'{}[]":,0123456789-.eE truefalsnul\\\x00\xff'
    deadline = time.monotonic() + 60
    for i in range(300):
        if time.monotonic() > deadline:
            break
        frame = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            pos = rng.randrange(len(frame))
            op = rng.randrange(3)
            if op == 0:
                frame[pos] = rng.choice(alphabet)
            elif op == 1:
                del frame[pos]
            else:
                frame.insert(pos, rng.choice(alphabet))
        raw.send(bytes(frame))
        while (reply := _reply(raw)).kind == "chunk":
            pass
    with FLyClient(tiny_daemon, timeout=30) as client:
        assert client.health().state == "ready"
        assert client.generate("def add(a, b):", *build_options(max_tokens=4)).usage.completion_tokens > 0


EDGE_SAMPLING = [  # issue 45 finding 2: values at float32's edges (each passes SamplingParams' ranges)
    {"temperature": 5e-324},  # a float64 subnormal: 0 in float32
    {"temperature": 1e-40},  # a float32 subnormal: logits / T overflowed to inf, the text was token 0 repeated
    {"temperature": 1.0, "top_p": 5e-324},  # top_p 0 in float32: the nucleus index was -1 and the step raised
    {"temperature": 0.7, "top_p": 1e-46, "seed": 3},
]


def test_sampling_at_float_edges_fails_nobody(tiny_daemon, raw):
    """Extreme sampling values batched with a victim: every request is answered, none with an error; the
    near-zero temperatures and tiny top_p give the greedy text (their limit), the victim its own text."""
    prompt, limit = "def add(a, b):", {"max_tokens": 12}
    with FLyClient(tiny_daemon, timeout=60) as client:
        greedy = client.generate(prompt, *build_options(**limit, loose=False))
    frames = [_frame(id="victim", prompt=prompt, sampling=limit, fly={"loose": False})]
    frames += [_frame(id=f"edge{i}", prompt=prompt, sampling={**limit, **edge}, fly={"loose": False})
               for i, edge in enumerate(EDGE_SAMPLING)]
    for frame in frames:
        raw.send(frame)
    results = {}
    while len(results) < len(frames):
        reply = _reply(raw)
        assert not isinstance(reply, ErrorReply), reply
        results[reply.id] = reply
    assert {rid: r.token_ids for rid, r in results.items()} == {rid: greedy.token_ids for rid in results}
