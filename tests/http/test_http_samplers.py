"""top_k, min_p and the penalties through both HTTP doors, the ZeroMQ client and the adapters (issue 47).

A tiny daemon serves the tiny pair in float32 on its ipc socket and over HTTP. Each door's spelling of a
sampler must reach the engine as the same SamplingParams as the ZeroMQ client's: the same tokens, greedy
(penalties) and seeded sampling (filters); a value out of range is a 400 with BAD_REQUEST; the samplers FLy
still lacks (mirostat, tfs_z, typical_p off their off value; OpenAI's logit_bias) keep their clear 400.
"""

from __future__ import annotations

import httpx
import ollama
import openai
import pytest

from fly_llm.client import FLyClient, build_options
from support.daemon_process import serving_http

MESSAGES = [{"role": "user", "content": "The quick brown fox"}]
PROMPT = "The quick brown fox"
PENALTIES = {"repetition_penalty": 1.4, "presence_penalty": 1.5, "frequency_penalty": 0.7, "repeat_last_n": 16}
FILTERS = {"top_k": 3, "min_p": 0.1, "temperature": 1.5, "seed": 7}


@pytest.fixture(scope="module")
def daemon(tiny_pair_dirs, tmp_path_factory):
    """(ipc endpoint, base URL) of a daemon serving the tiny pair in float32 with its HTTP front."""
    with serving_http(*tiny_pair_dirs, tmp_path_factory.mktemp("samplers"), "s") as (daemon, url):
        yield daemon.endpoint, url


@pytest.fixture(scope="module")
def zmq(daemon):
    with FLyClient(daemon[0], timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(daemon):
    with openai.OpenAI(base_url=f"{daemon[1]}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oll(daemon):
    return ollama.Client(host=daemon[1], timeout=60)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def zmq_text(zmq: FLyClient, chat: bool, **options) -> str:
    sampling, fly = build_options(max_tokens=24, loose=False, **options)
    return (zmq.chat(MESSAGES, sampling, fly) if chat else zmq.generate(PROMPT, sampling, fly)).text


def test_penalties_change_greedy_output_the_same_way_through_every_door(zmq, oai, oll, model):
    penalized = zmq_text(zmq, chat=True, **PENALTIES)
    assert penalized != zmq_text(zmq, chat=True)  # the penalties matter here, so a dropped one shows
    ollama_options = {"num_predict": 24, "loose": False, "temperature": 0, "repeat_penalty": 1.4,
                      "presence_penalty": 1.5, "frequency_penalty": 0.7, "repeat_last_n": 16}
    assert oll.chat(model=model, messages=MESSAGES, options=ollama_options).message.content == penalized
    chat = oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=24, temperature=0,
                                       presence_penalty=1.5, frequency_penalty=0.7,
                                       extra_body={"loose": False, "repetition_penalty": 1.4, "repeat_last_n": 16})
    assert chat.choices[0].message.content == penalized
    completion = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, presence_penalty=1.5,
                                        frequency_penalty=0.7,
                                        extra_body={"loose": False, "repetition_penalty": 1.4, "repeat_last_n": 16})
    assert completion.choices[0].text == zmq_text(zmq, chat=False, **PENALTIES)


def test_filters_reach_seeded_sampling_through_every_door(zmq, oai, oll, model):
    sampled = zmq_text(zmq, chat=False, **FILTERS)
    assert sampled != zmq_text(zmq, chat=False, temperature=1.5, seed=7)  # top_k / min_p moved this seed's draw
    ollama_options = {"num_predict": 24, "loose": False, **FILTERS}
    assert oll.generate(model=model, prompt=PROMPT, raw=True, options=ollama_options).response == sampled
    completion = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=1.5, seed=7,
                                        extra_body={"loose": False, "top_k": 3, "min_p": 0.1})
    assert completion.choices[0].text == sampled


def test_langchain_chat_models_send_their_sampler_fields(daemon, zmq, model):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    langchain_openai = pytest.importorskip("langchain_openai")
    penalized = zmq_text(zmq, chat=True, repetition_penalty=1.4, repeat_last_n=16)
    chat_ollama = langchain_ollama.ChatOllama(base_url=daemon[1], model=model, num_predict=24, temperature=0,
                                              repeat_penalty=1.4, repeat_last_n=16, top_k=3)
    assert chat_ollama.invoke(MESSAGES).content == penalized  # greedy: top_k changes nothing
    chat_openai = langchain_openai.ChatOpenAI(base_url=f"{daemon[1]}/v1", api_key="unused", model=model,
                                              max_tokens=24, temperature=0, presence_penalty=1.5,
                                              frequency_penalty=0.7, extra_body={"loose": False, "min_p": 0.1,
                                                                                 "repetition_penalty": 1.4,
                                                                                 "repeat_last_n": 16})
    assert chat_openai.invoke(MESSAGES).content == zmq_text(zmq, chat=True, **PENALTIES)


def test_the_adapters_take_the_samplers_as_fields(daemon, zmq):
    from langchain_fly import ChatFLy
    from llama_index.llms.fly import FLyLLM

    fields = dict(max_tokens=24, loose=False, temperature=0, **PENALTIES)
    assert ChatFLy(endpoint=daemon[0], **fields).invoke(MESSAGES).content == zmq_text(zmq, chat=True, **PENALTIES)
    assert FLyLLM(endpoint=daemon[0], **fields).complete(PROMPT).text == zmq_text(zmq, chat=False, **PENALTIES)
    assert ChatFLy(endpoint=daemon[0], **fields).invoke(MESSAGES, presence_penalty=0.0).content == zmq_text(
        zmq, chat=True, **{**PENALTIES, "presence_penalty": 0.0})


@pytest.mark.parametrize("options, says", [
    ({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p"), ({"repeat_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"), ({"top_k": "many"}, "top_k"),
    ({"mirostat": 1}, "mirostat"), ({"tfs_z": 0.5}, "tfs_z"), ({"typical_p": 0.9}, "typical_p"),
])
def test_bad_or_unsupported_ollama_samplers_are_400_naming_them(daemon, model, options, says):
    answer = httpx.post(f"{daemon[1]}/api/chat", json={"model": model, "messages": MESSAGES, "stream": False,
                                                       "options": options}, timeout=60)
    assert answer.status_code == 400 and answer.json()["code"] == "BAD_REQUEST" and says in answer.json()["error"]


@pytest.mark.parametrize("fields, says", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"top_k": -1}, "top_k"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"presence_penalty": "NaN"}, "presence_penalty"), ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"typical_p": 0.5}, "typical_p"),
])
def test_bad_or_unsupported_openai_samplers_are_400_naming_them(oai, model, fields, says):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, extra_body=fields)
    assert refused.value.code == "BAD_REQUEST" and says in str(refused.value)
