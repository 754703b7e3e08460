"""Delivery, the scheduler's third room, on its own: engine outputs in, chunks and results out.

Random splits of one answer into steps give the same result as one step (text, calls, unparsed
calls, tokens), and the stream's chunks add up to it; the served model's facts (ModelInfo) come from
the engine once.
"""

from __future__ import annotations

import random

import pytest
from support.engine_double import CountingEngine, Replies, _Output

from fly_llm.common.protocol import GenerateRequest, GenerateResult, TokenChunk
from fly_llm.common.tool_formats.hermes import HERMES, TOOL_CLOSE, TOOL_OPEN

from fly_daemon.metrics import Metrics
from fly_daemon.model_info import ModelInfo
from fly_daemon.scheduling.delivery import Delivery

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
CALL = f'{TOOL_OPEN}\n{{"name": "lookup", "arguments": {{"q": 1}}}}\n{TOOL_CLOSE}'
ANSWERS = ["plain text, no calls ", f"Let me look. {CALL}\n{CALL}", f"{CALL} and then {TOOL_OPEN}\n{{\"name\": \"lo"]


class _Decoding(CountingEngine):
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


def _deliver(answer: str, cuts: list[int], stream: bool) -> tuple[Replies, GenerateResult]:
    """Deliver `answer` as steps cut at `cuts`, one token per step."""
    replies = Replies()
    delivery = Delivery(replies, Metrics())
    delivery.start(_Decoding(), HERMES)
    request = GenerateRequest(id="r", messages=[{"role": "user", "content": "hi"}], tools=TOOLS, stream=stream)
    state = delivery.open((b"c",), request, 0.0, [1, 2])
    pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
    result = None
    for i, piece in enumerate(pieces):
        done = i == len(pieces) - 1
        out = _Output("r0", [i + 1], piece, done, "length" if done else None, 2)
        result = delivery.update(state, out, float(i + 1))
        assert (result is not None) == done
    delivery.finish(state, result)
    return replies, result


@pytest.mark.parametrize("seed", range(20))
def test_any_split_of_an_answer_delivers_the_same_result(seed):
    rng = random.Random(seed)
    answer = rng.choice(ANSWERS)
    cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(0, min(8, len(answer) - 1))))
    _, whole = _deliver(answer, [], stream=False)
    replies, split = _deliver(answer, cuts, stream=True)
    assert (split.text, [c.name for c in split.tool_calls], split.invalid_tool_calls) == \
        (whole.text, [c.name for c in whole.tool_calls], whole.invalid_tool_calls)
    chunks = [m for _, m in replies.sent if isinstance(m, TokenChunk)]
    assert "".join(c.text for c in chunks) == split.text
    assert [c.name for m in chunks for c in m.tool_calls] == [c.name for c in split.tool_calls]
    sent = [t for c in chunks for t in c.token_ids]
    assert split.token_ids[:len(sent)] == sent and replies.sent[-1][1] is split


def test_a_cut_off_call_is_an_unparsed_call_and_stays_in_the_text():
    _, result = _deliver(ANSWERS[2], [], stream=False)
    assert [c.name for c in result.tool_calls] == ["lookup"]
    [cut] = result.invalid_tool_calls
    assert cut.name is None and cut.arguments == '{"name": "lo' and "cut off" in cut.error
    assert TOOL_OPEN in result.text


def test_model_info_is_read_from_the_engine():
    info = ModelInfo.of(CountingEngine())
    assert (info.name, info.context_window, info.chat_template, info.device, info.on_gpu) == \
        ("counting", 64, "", "cpu", False)


def test_choices_given_the_same_prompt_scores_share_one_named_list_with_each_tokens_text():
    """The engine gives the `n` choices of a prompt one list of its log-probabilities (FLyEngine's scored prompts):
    delivery names it once for all of them (issue 45's amplification: n=16 × echo × 20 alternatives)."""
    delivery = Delivery(Replies(), Metrics())
    delivery.start(_Decoding(), HERMES)
    prompt, scores = [7, 8, 9], [(-1.0, [(8, -1.0), (3, -2.0)]), (-0.5, [(9, -0.5), (8, -3.0)])]
    request = GenerateRequest(id="r", prompt="a b c", logprobs=2, prompt_logprobs=True, choices=3)
    named = []
    for raw in (scores, scores, list(scores)):  # the last: another prompt's list, equal by chance
        state = delivery.open((b"c",), request, 0.0, prompt)
        out = _Output("r0", [4], "4", True, "length", 3, logprobs=[(-0.1, [(4, -0.1), (7, -4.0)])],
                      prompt_logprobs=raw)
        named.append(delivery.update(state, out, 1.0).prompt_logprobs)
    def shared(a: list, b: list) -> bool:  # the same entries (a result holds a copy of the list)
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))

    assert shared(named[0], named[1]) and not shared(named[0], named[2]) and named[2] == named[0]
    assert [(e.token_id, e.token, e.logprob) for e in named[0]] == [(7, "<7>", None), (8, "<8>", -1.0),
                                                                     (9, "<9>", -0.5)]
    assert [[(t.token, t.logprob) for t in e.top] for e in named[0]] == [[], [("<8>", -1.0), ("<3>", -2.0)],
                                                                         [("<9>", -0.5), ("<8>", -3.0)]]
