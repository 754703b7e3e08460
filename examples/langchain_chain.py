"""An LCEL chain on the fly daemon: ChatPromptTemplate | ChatFLy | StrOutputParser, streamed to the terminal.

Start the daemon once (no arguments: the embedded Qwen2.5-Coder pair), then run the chain:

    fly-daemon start
    python examples/langchain_chain.py "Write a function that checks whether a string is a palindrome."

The answer streams as it is generated; the FLy counters of the request follow on stderr.
Set $FLY_ENDPOINT (or pass --endpoint) to use a daemon on another socket.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.output_parsers import StrOutputParser
from langchain_core.outputs import LLMResult
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import Runnable

from langchain_fly import ChatFLy

PROMPT = ChatPromptTemplate.from_messages([
    ("system", "You are a concise Python expert. Answer with one short code block and one sentence."),
    ("human", "{task}"),
])


class FLyReport(BaseCallbackHandler):
    """Prints usage and the FLy counters of each finished chat call to stderr."""

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        message = response.generations[0][0].message
        usage, meta = message.usage_metadata or {}, message.response_metadata
        stats = meta.get("fly_stats", {})
        elapsed = meta.get("elapsed_s") or 0.0
        speed = f", {usage.get('output_tokens', 0) / elapsed:.1f} tokens/s" if elapsed else ""
        print(f"\n[{meta.get('model_name')}: {usage.get('input_tokens')} prompt + {usage.get('output_tokens')} "
              f"generated tokens{speed}; {stats.get('rounds')} target passes, "
              f"{stats.get('mat', 0):.2f} tokens per pass, {stats.get('accepted_loose')} loosely accepted]",
              file=sys.stderr)


def build_chain(chat: ChatFLy) -> Runnable:
    """prompt | chat model | plain-text parser."""
    return PROMPT | chat | StrOutputParser()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", nargs="?", default="Write a function that checks whether a string is a palindrome.")
    parser.add_argument("--endpoint", help="daemon endpoint (default: $FLY_ENDPOINT or the local socket)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds the whole answer may take (CPU generation of long answers is slow)")
    parser.add_argument("--exact", action="store_true", help="exact speculative decoding (FLy's loose rule off)")
    args = parser.parse_args(argv)

    options: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": 0.0, "loose": not args.exact,
                               "timeout": args.timeout}
    if args.endpoint:
        options["endpoint"] = args.endpoint
    chain = build_chain(ChatFLy(**options))
    for piece in chain.stream({"task": args.task}, config={"callbacks": [FLyReport()]}):
        print(piece, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
