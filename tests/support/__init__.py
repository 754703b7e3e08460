"""Shared test helpers: tiny random-weight model pairs (`tiny_models`) and daemon subprocesses (`daemon_process`)."""
