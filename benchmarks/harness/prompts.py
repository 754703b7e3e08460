"""Short built-in prompts (code, prose, a question) that the speed scripts send when no dataset is named."""

from __future__ import annotations

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n",
    "The quick brown fox jumps over the lazy dog. The dog",
    "Question: what is 2 + 3? Answer: 5. Question: what is 7 * 6? Answer:",
    "Retrieval augmented generation answers questions from",
    "for i in range(10):\n    print(i * i)\nfor j in range(",
]
