"""The torch-free side: settings, wire messages, errors, tools and constraints, shared by
the client, the adapters, the daemon and the engine (an import contract keeps torch out)."""
