"""LangChain's standard suites (langchain-tests 1.1.x) for ChatFLy.

The unit suite needs no daemon. The integration suite talks to a real daemon on the tiny
random-weight pair (`tiny_daemon`), so it checks behaviour — invoke, stream, batch, usage, stop,
async, tool calls, structured output — never wording. Every capability switched off below says
why; the tests it skips are skipped by langchain-tests itself because of that flag.

A few standard tests ask for what only a trained model gives: an argument's value (3), a string
that ends, a prompt's instruction followed. On random weights the grammar still makes every
answer valid, but not that answer; those tests are expected failures below (`MODEL_BOUND`, each
with its reason), and tests/adapters/test_langchain_tools.py checks the same paths on schemas a
random model can finish.
"""

from __future__ import annotations

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from langchain_fly import ChatFLy

UNIT_ENDPOINT = "tcp://127.0.0.1:5599"
"""Unit tests never connect; a fixed endpoint keeps the serialisation snapshot machine-independent."""


class ChatFLyCapabilities:
    """What ChatFLy can and cannot do, shared by both suites."""

    @property
    def chat_model_class(self) -> type[ChatFLy]:
        return ChatFLy

    @property
    def has_tool_calling(self) -> bool:
        """On: `bind_tools`; the daemon decodes calls under a grammar of the offered tools."""
        return True

    @property
    def has_tool_choice(self) -> bool:
        """On: "auto", "none", "any"/"required" and a tool's name."""
        return True

    @property
    def has_structured_output(self) -> bool:
        """On: `with_structured_output` (json_schema, function_calling, json_mode)."""
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        """The default method: the answer decoded under the schema's grammar."""
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        """On: `method="json_mode"` decodes any JSON object."""
        return True

    @property
    def supports_image_inputs(self) -> bool:
        """Off: the served models are text-only."""
        return False

    @property
    def supports_image_urls(self) -> bool:
        """Off: the served models are text-only."""
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        """Off: the served models are text-only."""
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        """Off: the served models are text-only."""
        return False

    @property
    def supports_video_inputs(self) -> bool:
        """Off: the served models are text-only."""
        return False

    @property
    def supports_image_tool_message(self) -> bool:
        """Off: the served models are text-only (tool results are text)."""
        return False

    @property
    def supports_pdf_tool_message(self) -> bool:
        """Off: the served models are text-only (tool results are text)."""
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        """On: an Anthropic-format tool, `tool_use` and `thinking` blocks in earlier answers (the calls
        travel as `tool_calls`, reasoning is not sent back); its image part follows `supports_image_inputs`."""
        return True

    @property
    def supports_model_override(self) -> bool:
        """Off: a daemon serves one model pair, so a per-call `model=` cannot switch models
        (ChatFLy raises a ValueError that says so)."""
        return False

    @property
    def enable_vcr_tests(self) -> bool:
        """Off: VCR records HTTP; ChatFLy talks ZeroMQ to a local daemon."""
        return False


class TestChatFLyUnit(ChatFLyCapabilities, ChatModelUnitTests):
    """The unit suite: construction, standard params, tracing params, serialisation, env init."""

    @property
    def chat_model_params(self) -> dict:
        return {"endpoint": UNIT_ENDPOINT}

    @property
    def init_from_env_params(self) -> tuple[dict, dict, dict]:
        return {"FLY_ENDPOINT": "tcp://127.0.0.1:5601"}, {}, {"endpoint": "tcp://127.0.0.1:5601"}

    @pytest.mark.xfail(strict=True, reason=(
        "dumpd works (snapshot matches), but the standard test loads with allowed_objects='all', "
        "which is langchain-core's own allowlist of partner packages; a third-party class cannot be on "
        "it. ChatFLy loads with allowed_objects=[ChatFLy] (tests/adapters/test_langchain_chat.py)."))
    def test_serdes(self, model: ChatFLy, snapshot) -> None:
        super().test_serdes(model, snapshot)


def model_bound(reason: str) -> pytest.MarkDecorator:
    """An expected failure that only a trained model would pass (not strict: greedy output of random
    weights may one day happen to pass)."""
    return pytest.mark.xfail(reason=f"random weights: {reason}", strict=False)


VALUE = model_bound("the call is valid (an integer, as the schema says) but its value is the model's pick, not 3")
ENDLESS_STRING = model_bound("a free-length JSON string never closes within the tiny model's 512-token context, "
                             "so the answer stops at max_tokens (finish_reason 'length'), valid but unfinished")
BOTH_MODELS = [{}, {"output_version": "v1"}]


class TestChatFLyIntegration(ChatFLyCapabilities, ChatModelIntegrationTests):
    """The integration suite against a real daemon on the tiny pair (found through $FLY_ENDPOINT)."""

    @pytest.fixture(autouse=True)
    def _daemon_endpoint(self, tiny_daemon: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("FLY_ENDPOINT", tiny_daemon)

    @VALUE
    @pytest.mark.parametrize("model", BOTH_MODELS, indirect=True)
    def test_tool_calling(self, model: ChatFLy) -> None:
        super().test_tool_calling(model)

    @VALUE
    async def test_tool_calling_async(self, model: ChatFLy) -> None:
        await super().test_tool_calling_async(model)

    @ENDLESS_STRING
    def test_bind_runnables_as_tools(self, model: ChatFLy) -> None:
        super().test_bind_runnables_as_tools(model)

    @ENDLESS_STRING
    def test_tool_choice(self, model: ChatFLy) -> None:
        """With "any" the model picks get_weather(location: str)."""
        super().test_tool_choice(model)

    @model_bound("(the pydantic case) a free-length JSON string never closes within 512 tokens, so the "
                 "pydantic parser misses the second field; the dict cases pass (XPASS): LangChain's JSON "
                 "parser takes the cut-off object's finished keys")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: ChatFLy, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @model_bound("(the pydantic case) as test_structured_output")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: ChatFLy, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    @ENDLESS_STRING
    def test_structured_output_pydantic_2_v1(self, model: ChatFLy) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @model_bound("json_mode leaves the keys to the prompt's instruction; the model answers {} (valid JSON, "
                 "not the keys asked for)")
    def test_json_mode(self, model: ChatFLy) -> None:
        super().test_json_mode(model)

    @model_bound("with tool_choice left to the model (auto) it answers in text instead of calling get_weather")
    @pytest.mark.parametrize("model", BOTH_MODELS, indirect=True)
    def test_agent_loop(self, model: ChatFLy) -> None:
        super().test_agent_loop(model)

    @model_bound("the test needs the model to copy '你好' into the argument (and its free-length string to end)")
    def test_unicode_tool_call_integration(self, model: ChatFLy) -> None:
        super().test_unicode_tool_call_integration(model)
