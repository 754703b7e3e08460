"""Decoding in one process: the engine's methods side by side, its rounds and steps, grammars."""
