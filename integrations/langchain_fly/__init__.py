"""LangChain models served by the fly daemon: `FLyLLM` (text in, text out) and `ChatFLy` (messages)."""

from langchain_fly.chat_models import ChatFLy
from langchain_fly.llms import FLyLLM

__all__ = ["ChatFLy", "FLyLLM"]
