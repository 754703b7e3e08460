"""LlamaIndex integration for fly-llm: `from llama_index.llms.fly import FLyLLM`."""

from llama_index.llms.fly.base import FLyLLM

__all__ = ["FLyLLM"]
