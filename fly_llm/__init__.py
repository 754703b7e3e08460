"""fly-llm: fast local generation with FLy loosely speculative decoding.

The package root imports nothing heavy: `fly_llm.client`, `fly_llm.common.protocol`,
`fly_llm.common.config` and `fly_llm.common.errors` work without torch.
"""

__version__ = "0.1.0"
