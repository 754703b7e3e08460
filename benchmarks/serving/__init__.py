"""The daemon and its doors as clients see them: throughput, latency, soak, fuzzing, other servers and tools."""
