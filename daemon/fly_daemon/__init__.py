"""fly-daemon: FLy generation served over ZeroMQ with continuous batching (DESIGN.md §2–4)."""
