"""The FLy decoding algorithm: verify (the rule), drafters, cache, engine, stats.

Import the submodules directly; this package imports nothing itself, so `fly_llm.decoding.stats`
and `fly_llm.decoding.text` stay importable without torch.
"""
