"""fly-daemon: FLy generation served over ZeroMQ with continuous batching (docs/design.md §2–4)."""
