"""Hypothesis strategies of hostile bodies for the Responses API (/v1/responses) and Anthropic's Messages API
(/v1/messages, /v1/messages/count_tokens): the fields the door-neutral cases (tests/hostile/strategies.py) cannot
reach. Input items and content blocks of every kind (unknown, unserved and malformed ones, odd text, calls with
odd or deep arguments, results for unknown calls), the stateful fields (`store`, `previous_response_id`, ...),
`max_tokens` / `max_output_tokens` at their edges, tool_choice shapes, `top_k`, thinking, a last assistant turn.
Each `Case` carries its route; `must_refuse` where the API says no on its face (store: true, a stored response
named, max_tokens missing or below 1, a prefill).
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from hostile.strategies import PROMPTS, Case, _arguments, json_schemas, text

JUNK = [None, 7, "x", [], {}, True, [1], {"type": 7}]
"""Values of the wrong type anywhere a list, object or string belongs."""


def _part() -> st.SearchStrategy[Any]:
    kinds = st.sampled_from(["input_text", "output_text", "text", "input_image", "x", None])
    return st.one_of(st.builds(lambda kind, t: {"type": kind, "text": t}, kinds, text()),
                     st.builds(lambda r: {"type": "refusal", "refusal": r}, text()),
                     st.sampled_from([*JUNK, {"type": "input_image", "image_url": "data:,"}, {"type": "input_text"}]))


def _input_item() -> st.SearchStrategy[Any]:
    role = st.sampled_from(["user", "system", "developer", "assistant", "tool", "", None])
    content = st.one_of(text(), st.lists(_part(), max_size=3), st.sampled_from(JUNK))
    message = st.builds(lambda r, c, typed: {"role": r, "content": c, **({"type": "message"} if typed else {})},
                        role, content, st.booleans())
    call = st.builds(lambda cid, name, args: {"type": "function_call", "call_id": cid, "name": name, "arguments": args},
                     st.sampled_from(["c1", "c2", "", "x" * 200, None]), st.sampled_from(["lookup", "", "x" * 65, 7]),
                     _arguments())
    output = st.builds(lambda cid, out: {"type": "function_call_output", "call_id": cid, "output": out},
                       st.sampled_from(["c1", "unknown", ""]), st.one_of(text(), st.lists(_part(), max_size=2)))
    other = st.sampled_from([{"type": "reasoning", "summary": []}, {"type": "item_reference", "id": "msg_1"},
                             {"type": "web_search_call"}, {"type": 7}, *JUNK])
    return st.one_of(message, message, call, output, other)


@st.composite
def _responses_case(draw: st.DrawFn) -> Case:
    items = st.lists(_input_item(), max_size=6)
    body: dict[str, Any] = {"input": draw(st.one_of(text(), items, st.sampled_from(JUNK)))}
    body |= draw(st.fixed_dictionaries({}, optional={
        "instructions": st.one_of(text(), st.sampled_from(JUNK)),
        "max_output_tokens": st.sampled_from([1, 4, 0, -1, 10**12, "8", None]),
        "temperature": st.sampled_from([0, 0.7, -1, 11, "nan"]),
        "store": st.sampled_from([True, False, None, "yes"]),
        "previous_response_id": st.sampled_from(["resp_1", "", None, 7]),
        "conversation": st.sampled_from(["conv_1", {"id": "conv_1"}, None]),
        "background": st.sampled_from([True, False]),
        "include": st.sampled_from([["reasoning.encrypted_content"], ["message.output_text.logprobs"], "x"]),
        "truncation": st.sampled_from(["auto", "disabled", 7]),
        "reasoning": st.sampled_from([{"effort": "high"}, None, {}]),
        "text": st.one_of(st.builds(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}},
                                    json_schemas()),
                          st.sampled_from([{"format": {"type": "json_object"}}, {"verbosity": "low"},
                                           {"format": {"type": "json_schema"}}, {"format": 7}, "x"])),
        "tools": st.sampled_from([[{"type": "function", "name": "lookup"}], [{"type": "web_search"}], [7],
                                  [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}] * 2]),
        "tool_choice": st.sampled_from(["auto", "required", "none", "any", {"type": "function", "name": "lookup"},
                                        {"type": "function", "name": "nope"}, {"type": "allowed_tools"}, 7]),
        "stream": st.booleans(),
    }))
    stored = body.get("store") is True or body.get("previous_response_id") not in (None, "")
    return Case("responses_body", body, route="/v1/responses", must_refuse=stored)


def _block() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, text()),
        st.builds(lambda i, n, a: {"type": "tool_use", "id": i, "name": n, "input": a},
                  st.sampled_from(["t1", "", "x" * 200]), st.sampled_from(["lookup", "", 7]),
                  st.one_of(st.just({"key": "fox"}), _arguments(), st.sampled_from(JUNK))),
        st.builds(lambda i, c, e: {"type": "tool_result", "tool_use_id": i, "content": c, "is_error": e},
                  st.sampled_from(["t1", "unknown", ""]),
                  st.one_of(text(), st.lists(st.builds(lambda t: {"type": "text", "text": t}, text()), max_size=2),
                            st.sampled_from(JUNK)),
                  st.sampled_from([None, True, "x"])),
        st.sampled_from([{"type": "image", "source": {"type": "base64", "data": ""}}, {"type": "thinking"},
                         {"type": "document"}, {"type": "text"}, *JUNK]),
    )


def _anthropic_messages() -> st.SearchStrategy[list[Any]]:
    turn = st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "assistant", "system", None]),
                     st.one_of(text(), st.lists(_block(), max_size=4), st.sampled_from(JUNK)))
    return st.lists(turn, min_size=0, max_size=5)


@st.composite
def _messages_case(draw: st.DrawFn) -> Case:
    messages = draw(st.one_of(_anthropic_messages(),
                              st.builds(lambda ms, q: [*ms, {"role": "user", "content": q}], _anthropic_messages(),
                                        st.sampled_from(PROMPTS))))
    body: dict[str, Any] = {"messages": messages}
    body |= draw(st.fixed_dictionaries({}, optional={
        "max_tokens": st.sampled_from([1, 4, 8, 0, -1, 10**12, "8", None]),
        "system": st.one_of(text(), st.lists(st.builds(lambda t: {"type": "text", "text": t}, text()), max_size=2),
                            st.sampled_from(JUNK)),
        "stop_sequences": st.sampled_from([["a"], [""], ["x" * 5000], "a", [7]]),
        "temperature": st.sampled_from([0, 1, -1, "nan"]),
        "top_k": st.sampled_from([1, 40, 0, -1, None]),
        "tools": st.one_of(st.builds(lambda s: [{"name": "lookup", "input_schema": s}], json_schemas()),
                           st.sampled_from([[{"name": "lookup"}], [{"type": "bash_20250124", "name": "bash"}], [7]])),
        "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "lookup"},
                                        {"type": "tool"}, {"type": "none"}, "auto", 7]),
        "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}]),
        "output_config": st.sampled_from([{"format": {"type": "json_schema", "schema": {"type": "object"}}},
                                          {"effort": "high"}, {"format": {"type": "regex"}}]),
        "stream": st.booleans(),
    }))
    route = draw(st.sampled_from(["/v1/messages", "/v1/messages", "/v1/messages/count_tokens"]))
    if route.endswith("count_tokens"):
        body = {k: v for k, v in body.items() if k in ("messages", "system", "tools", "tool_choice", "thinking")}
    max_tokens = body.get("max_tokens", "missing")
    prefill = bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"
    faulty = max_tokens == "missing" or type(max_tokens) is int and max_tokens < 1 or prefill
    return Case("messages_body", body, route=route, must_refuse=faulty and route == "/v1/messages")


API_FAMILIES: dict[str, st.SearchStrategy[Case]] = {"responses_body": _responses_case(),
                                                     "messages_body": _messages_case()}
"""The Responses and Messages APIs' own families (each case routed to its API)."""
API_CI_EXAMPLES = {"responses_body": 40, "messages_body": 40}
"""Cases per own family in CI."""
