"""One exception hierarchy for the engine, daemon, client and adapters.

Every error has a stable `code` (docs/design.md §4.2) that travels on the wire.
"""

from __future__ import annotations


class FLyError(Exception):
    """Base of every fly-llm error; `code` is stable and machine-readable."""

    code = "INTERNAL"

    def __init__(self, message: str = "", param: str | None = None) -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code)
        self.param = param
        """The request's field at fault, where one is (the `param` of an HTTP error body)."""

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class BadRequest(FLyError, ValueError):
    """The request is malformed or has out-of-range values."""

    code = "BAD_REQUEST"


class TooLong(BadRequest):
    """The prompt (plus max_tokens) does not fit the context window or the limits."""

    code = "TOO_LONG"


class FimUnsupported(BadRequest):
    """The served model has no fill-in-the-middle tokens, so a suffix (or /infill) cannot be served."""

    code = "FIM_UNSUPPORTED"


class Busy(FLyError):
    """The daemon's admission queue is full; try again later."""

    code = "BUSY"


class Timeout(FLyError, TimeoutError):
    """The request's deadline passed before it finished."""

    code = "TIMEOUT"


class Cancelled(FLyError):
    """The request was cancelled (by the client, or because the daemon is stopping)."""

    code = "CANCELLED"


class NotReady(FLyError):
    """The daemon is draining or its models failed to load (while they load, requests wait; info refuses)."""

    code = "NOT_READY"


class Unauthorized(FLyError):
    """The request lacks a valid API key (the HTTP front with --api-key; never sent over ZeroMQ)."""

    code = "UNAUTHORIZED"


class Internal(FLyError):
    """An unexpected error inside the daemon."""

    code = "INTERNAL"


class FLyUnavailable(FLyError, ConnectionError):
    """No daemon answered at the endpoint within the timeout."""

    code = "UNAVAILABLE"


class ModelError(FLyError):
    """Models could not be loaded: missing, corrupted, checksum or vocabulary mismatch."""

    code = "MODEL_ERROR"


_BY_CODE: dict[str, type[FLyError]] = {
    cls.code: cls
    for cls in (BadRequest, TooLong, FimUnsupported, Busy, Timeout, Cancelled, NotReady, Unauthorized, Internal,
                FLyUnavailable, ModelError)
}


def error_from_code(code: str, message: str) -> FLyError:
    """Rebuild the exception for a wire error code (unknown codes become Internal)."""
    return _BY_CODE.get(code, Internal)(message)


def contained(exc: BaseException) -> bool:
    """Whether a handler that fails one request (or one row of a batch) may catch `exc` and go on: any
    Exception, and a Rust panic of a native extension (pyo3's PanicException, which llguidance raises,
    is a BaseException); never an interrupt or an exit."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"
