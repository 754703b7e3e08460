"""One model forward timed or checked: the W4A8 kernel, weight layouts and quantizations, activations, attention."""
