"""The FLy decoding algorithm: verify (the rule), drafters, cache, policy, engine, text.

Import the submodules directly; this package imports nothing itself, so `fly_llm.decoding.text`
stays importable without torch.
"""
