"""Clients of the fly-daemon: `FLyClient` (threads) and `AsyncFLyClient` (asyncio). No torch here.

Both speak the wire protocol of fly_llm.common.protocol over a ZeroMQ DEALER socket:
- lazy connect, one socket per thread (sync) or per event loop (async); one socket carries many
  concurrent requests, replies are routed to their request by id (`core.Inbox`);
- while requests are open, a background thread sends heartbeats so the daemon keeps them and the
  client notices a daemon that hangs (`heartbeat`); a daemon that went away (stopped, killed, crashed)
  drops the connection, which a monitor of the socket reports (`sockets.watch`): the requests open on
  it end with FLyUnavailable at once, whatever their timeout (Timeout is for a daemon that is there);
- retries only where they are safe (`core`): info/health/status/tokenize are re-sent on a fresh
  socket, and a generate request is re-sent only when the daemon answered BUSY before admitting it.

Modules: `core` (transport-free: requests, reply routing, retry decisions), `sockets` (ZeroMQ),
`heartbeat`, `base` (what both clients share), `sync` (FLyClient), `aio` (AsyncFLyClient).
Fill-in-the-middle: `generate`/`stream`/`batch` take OpenAI's `suffix`, or an `Infill` as the prompt, and
`infill` takes llama.cpp's /infill fields (other files of the repository too); the daemon builds the FIM
prompt from the target's FIM tokens and refuses a target without them (FimUnsupported, FIM_UNSUPPORTED).
Replies carry parsed tool calls (`GenerateResult.tool_calls`, and `invalid_tool_calls` for those that
did not parse): the daemon reads the model's tool-call format, so no client knows its tags.
This package is the client API: adapters import from here only.
"""

from fly_llm.client.aio import AsyncFLyClient
from fly_llm.client.core import Messages, Tools, build_options, call_options
from fly_llm.client.sync import FLyClient
from fly_llm.common.config import FLyOverrides, SamplingParams
from fly_llm.common.endpoints import default_endpoint, runtime_dir
from fly_llm.common.fim import Infill, InfillFile
from fly_llm.common.protocol import ChatMessage, GenerateResult, InfoReply, TokenChunk
from fly_llm.common.tools import ResponseFormat, ToolCall, ToolChoice, ToolSpec, UnparsedCall

__all__ = ["AsyncFLyClient", "ChatMessage", "FLyClient", "FLyOverrides", "GenerateResult", "InfoReply", "Infill",
           "InfillFile", "Messages", "ResponseFormat", "SamplingParams", "TokenChunk", "ToolCall", "ToolChoice",
           "ToolSpec", "Tools", "UnparsedCall", "build_options", "call_options", "default_endpoint", "runtime_dir"]
