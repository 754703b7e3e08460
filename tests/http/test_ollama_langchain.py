"""LangChain's ChatOllama, unchanged, against a tiny daemon's /api routes: langchain-tests' standard
integration suite (1.1.x), and tool calls forced through FLy's `options.tool_choice`.

The capabilities follow langchain-ollama's own standard-suite class: tool calling and structured output
on, json_mode on; tool choice off, because ChatOllama's `bind_tools` drops `tool_choice` (Ollama has no
such field), so the suite's forced-choice tests would test the model's own choice. A tiny random model
never chooses to call a tool by itself: the tests that need it to are expected failures below (each
says why), and `test_forced_tool_call_*` shows the same paths working once FLy's option forces the call.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_ollama import ChatOllama
from langchain_tests.integration_tests import ChatModelIntegrationTests
from pydantic import BaseModel, Field

from support.daemon_process import serving_http


@pytest.fixture(scope="module")
def ollama_url(tiny_pair_dirs, tmp_path_factory):
    """Base URL of a daemon serving the tiny pair in float32 (its HTTP front on a free loopback port)."""
    with serving_http(*tiny_pair_dirs, tmp_path_factory.mktemp("ollama_lc"), "l") as (_, url):
        yield url


def model_bound(reason: str) -> pytest.MarkDecorator:
    """An expected failure that only a trained model would pass (not strict: random weights may one day pass)."""
    return pytest.mark.xfail(reason=f"random weights: {reason}", strict=False)


NO_CALL = model_bound("with the call left to the model (ChatOllama sends no tool_choice) it answers in text")
ENDLESS_STRING = model_bound("a free-length JSON string never closes within the tiny model's 512-token context")
BOTH_MODELS = [{}, {"output_version": "v1"}]


class TestChatOllamaOnFLy(ChatModelIntegrationTests):
    """The standard integration suite, ChatOllama pointed at the daemon (found through the `ollama_url` fixture)."""

    @pytest.fixture(autouse=True)
    def _served(self, ollama_url: str, tiny_pair_dirs) -> None:
        self.base_url, self.model_name = ollama_url, str(tiny_pair_dirs[0])

    @property
    def chat_model_class(self) -> type[ChatOllama]:
        return ChatOllama

    @property
    def chat_model_params(self) -> dict:
        return {"model": self.model_name, "base_url": self.base_url, "temperature": 0, "num_predict": 256}

    @property
    def has_tool_choice(self) -> bool:
        """Off: ChatOllama.bind_tools drops tool_choice (as langchain-ollama's own standard tests say)."""
        return False

    @property
    def supports_json_mode(self) -> bool:
        """On: format='json' decodes any JSON object under the grammar."""
        return True

    @property
    def supports_image_inputs(self) -> bool:
        """Off: the served models read text only (images are refused)."""
        return False

    @property
    def supports_model_override(self) -> bool:
        """Off: a daemon serves one model, so a per-call `model=` names a model it does not have (404)."""
        return False

    @NO_CALL
    @pytest.mark.parametrize("model", BOTH_MODELS, indirect=True)
    def test_tool_calling(self, model: ChatOllama) -> None:
        super().test_tool_calling(model)

    @NO_CALL
    async def test_tool_calling_async(self, model: ChatOllama) -> None:
        await super().test_tool_calling_async(model)

    @NO_CALL
    def test_tool_calling_with_no_arguments(self, model: ChatOllama) -> None:
        super().test_tool_calling_with_no_arguments(model)

    @NO_CALL
    def test_bind_runnables_as_tools(self, model: ChatOllama) -> None:
        super().test_bind_runnables_as_tools(model)

    @NO_CALL
    @pytest.mark.parametrize("model", BOTH_MODELS, indirect=True)
    def test_agent_loop(self, model: ChatOllama) -> None:
        super().test_agent_loop(model)

    @NO_CALL
    def test_unicode_tool_call_integration(self, model: ChatOllama) -> None:
        super().test_unicode_tool_call_integration(model)

    @model_bound("(the pydantic case) a free-length JSON string never closes within 256 tokens, so the pydantic "
                 "parser misses the second field; the dict cases pass (XPASS): LangChain's parser takes the "
                 "cut-off object's finished keys")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    def test_structured_output(self, model: ChatOllama, schema_type: str) -> None:
        super().test_structured_output(model, schema_type)

    @model_bound("(the pydantic case) as test_structured_output")
    @pytest.mark.parametrize("schema_type", ["pydantic", "typeddict", "json_schema"])
    async def test_structured_output_async(self, model: ChatOllama, schema_type: str) -> None:
        await super().test_structured_output_async(model, schema_type)

    @ENDLESS_STRING
    def test_structured_output_pydantic_2_v1(self, model: ChatOllama) -> None:
        super().test_structured_output_pydantic_2_v1(model)

    @model_bound("json_mode leaves the keys to the prompt's instruction; the model's object is not the one asked for")
    def test_json_mode(self, model: ChatOllama) -> None:
        super().test_json_mode(model)


class Pick(BaseModel):
    """A pick a random model can finish."""

    animal: str = Field(json_schema_extra={"enum": ["fox", "dog"]})
    n: int = Field(ge=0, le=9)


def lookup(key: str) -> str:
    """Look up what an animal is like."""
    return {"fox": "quick", "dog": "lazy"}.get(key, "unknown")


LOOKUP = {"type": "function", "function": {"name": "lookup", "description": "Look up what an animal is like.",
                                           "parameters": {"type": "object", "required": ["key"],
                                                          "properties": {"key": {"enum": ["fox", "dog"]}}}}}
FORCED = {"num_predict": 128, "temperature": 0, "tool_choice": "required"}


@pytest.fixture
def chat(ollama_url, tiny_pair_dirs) -> ChatOllama:
    return ChatOllama(model=str(tiny_pair_dirs[0]), base_url=ollama_url, temperature=0, num_predict=128)


def test_forced_tool_call_invoke_stream_and_result_back_in(chat):
    bound = chat.bind_tools([LOOKUP], options=FORCED)
    answer = bound.invoke("What is the fox like?")
    assert [c["name"] for c in answer.tool_calls] == ["lookup"] and answer.tool_calls[0]["args"]["key"] in ("fox", "dog")
    streamed = None
    for chunk in bound.stream("What is the fox like?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["name"] for c in streamed.tool_calls] == ["lookup"]
    call = answer.tool_calls[0]
    history = [HumanMessage("What is the fox like?"), AIMessage("", tool_calls=[call]),
               ToolMessage(lookup(call["args"]["key"]), tool_call_id=call["id"])]
    final = chat.bind_tools([LOOKUP]).invoke(history)
    assert isinstance(final, AIMessage) and final.usage_metadata["output_tokens"] > 0


async def test_forced_tool_call_async(chat):
    answer = await chat.bind_tools([LOOKUP], options=FORCED).ainvoke("What is the dog like?")
    assert [c["name"] for c in answer.tool_calls] == ["lookup"]


def test_structured_output_json_schema(chat):
    pick = chat.with_structured_output(Pick).invoke("Pick an animal and a number.")
    assert isinstance(pick, Pick) and pick.animal in ("fox", "dog") and 0 <= pick.n <= 9
