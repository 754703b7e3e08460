"""The HTTP front (docs/daemon.md): every API's door over one request pipeline.

`app` mounts the routes; `door` serves every generation route (`door.serve`); `common` holds what the
APIs share and the `Answer` contract; each API is one module of wire shapes (`openai_api`, `ollama_api`,
`llamacpp_api`, `messages_api`, `responses_api`) that imports no other's; `connections` caps connections.
The front reaches the scheduler only through `fly_daemon.inproc`.
"""
