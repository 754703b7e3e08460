"""Hostile content through the Ollama routes (/api/chat, /api/generate) of a tiny daemon subprocess (issue 36).

The same door-neutral cases as test_hostile_fuzz.py (tests/hostile/strategies.py), posted in Ollama's shape:
sampling options and FLy's own as `options` (max_tokens as num_predict), the structure options Ollama has
no field for (response_format, tool_choice, parallel_tool_calls) as `options` too, a prompt to
/api/generate with `raw`, raw frames as /api/chat bodies. Each case must be served or refused in Ollama's
error shape with a stable code; after each the daemon is alive, after each family exact mode over
/api/generate equals the ZeroMQ answer and the target's own greedy output.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

from fly_llm.client import FLyClient, build_options
from hostile.doors import (EXACT_PROMPT, EXACT_TOKENS, HTTP_FLY_KEYS, REQUEST_TIMEOUT_S, Finding, FuzzTarget,
                           Outcome, judge, ollama_error_code, plain_outcome, run_case)
from hostile.strategies import CI_EXAMPLES, FAMILIES, Case

OPTION_NAMES = {"max_tokens": "num_predict"}
"""Wire sampling fields whose Ollama option has another name."""
IN_OPTIONS = ("response_format", "tool_choice", "parallel_tool_calls")
"""Structure options that travel in `options` on the Ollama routes."""


class OllamaDoor:
    """Cases as POSTs to /api/chat (messages) or /api/generate (a prompt, raw), raw frames as /api/chat bodies."""

    name = "ollama"

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target

    def send(self, case: Case) -> Outcome:
        """Post one case and read its answer (a stream to its end); raise Finding on a bad one."""
        path, content = self._body(case)
        try:
            with httpx.stream("POST", f"{self.target.http_url}{path}", content=content,
                              timeout=REQUEST_TIMEOUT_S) as response:
                if response.status_code == 200 and "ndjson" in response.headers.get("content-type", ""):
                    return judge(case, _stream_outcome(response))
                response.read()
        except httpx.TimeoutException:
            raise Finding(f"no answer within {REQUEST_TIMEOUT_S} s (a hang)", "hang") from None
        except httpx.TransportError as exc:
            raise Finding(f"the connection failed ({exc!r})", "crash" if self.target.died(2.0) else "bad_answer") \
                from None
        return judge(case, _plain_outcome(response))

    def _body(self, case: Case) -> tuple[str, bytes]:
        if case.frame is not None:
            return "/api/chat", case.frame
        request = dict(case.request)
        options = {OPTION_NAMES.get(k, k): v for k, v in request.pop("sampling", {}).items()}
        options |= {k: v for k, v in request.pop("fly", {}).items() if k in HTTP_FLY_KEYS}
        options |= {k: request.pop(k) for k in IN_OPTIONS if k in request}
        request.pop("timeout_s", None)
        body: dict[str, Any] = {"model": self.target.model, "options": options}
        if "messages" in request:
            body["messages"] = [_ollama_message(m) for m in request.pop("messages") or ()]
            path = "/api/chat"
        else:
            body |= {"prompt": request.pop("prompt", None), "raw": True}
            path = "/api/generate"
        return path, json.dumps(body | request).encode()


def _ollama_message(message: Any) -> Any:
    """A wire chat turn in Ollama's shape (its tool's `name` as `tool_name`); anything else as it is."""
    if isinstance(message, dict) and "name" in message:
        message = {**{k: v for k, v in message.items() if k != "name"}, "tool_name": message["name"]}
    return message


def _plain_outcome(response: httpx.Response) -> Outcome:
    return plain_outcome(response, ollama_error_code,
                         lambda body: isinstance(body, dict) and body.get("done") is True, "done", "Ollama")


def _stream_outcome(response: httpx.Response) -> Outcome:
    last = None
    for line in response.iter_lines():
        if not line.strip():
            continue
        last = json.loads(line)
        code = ollama_error_code(last)
        if code is not None:
            return Outcome("refused", code)
        if last.get("done") is True:
            return Outcome("served")
    raise Finding(f"the stream ended without a done line or an error line; last line: {str(last)[:300]}")


def check_exact_over_ollama(target: FuzzTarget) -> None:
    """Raise Finding unless exact mode over /api/generate (raw) equals ZeroMQ's answer and the greedy tokens."""
    with FLyClient(target.endpoint, timeout=REQUEST_TIMEOUT_S, max_retries=0) as client:
        same = client.generate(EXACT_PROMPT, *build_options(max_tokens=EXACT_TOKENS, loose=False))
    if same.token_ids != target.greedy(EXACT_PROMPT, EXACT_TOKENS):
        raise Finding("exact mode over ZeroMQ is not the target's greedy output", "exact")
    body = {"model": target.model, "prompt": EXACT_PROMPT, "raw": True, "stream": False,
            "options": {"num_predict": EXACT_TOKENS, "temperature": 0, "loose": False}}
    answer = httpx.post(f"{target.http_url}/api/generate", json=body, timeout=REQUEST_TIMEOUT_S)
    text = answer.json().get("response") if answer.status_code == 200 else answer.text
    if text != same.text:
        raise Finding(f"exact mode over /api/generate gave {text!r}, over ZeroMQ {same.text!r}", "exact")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hostile_content_over_ollama_routes_is_refused_or_served(fuzz_target, family):
    door, ran = OllamaDoor(fuzz_target), []

    @settings(max_examples=CI_EXAMPLES[family], deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], print_blob=False, suppress_health_check=list(HealthCheck))
    @given(case=FAMILIES[family])
    def one(case: Case) -> None:
        run_case(fuzz_target, door, case, fuzz_target.workdir / f"failing-ollama-{family}.json")
        ran.append(case)

    one()
    fuzz_target.ensure_running()
    check_exact_over_ollama(fuzz_target)
    assert len(ran) >= min(CI_EXAMPLES[family], 2)
