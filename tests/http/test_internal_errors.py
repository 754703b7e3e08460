"""An unexpected failure is answered INTERNAL with a request id, and logged with its traceback once per cause a
minute: a client repeating a failing request does not fill the log (issue 65: ~12 KB a request, 1.4 GB an hour)."""

from __future__ import annotations

import logging

from fly_daemon.http import common


def _raised(kind: type[Exception], line: int) -> Exception:
    """An exception of `kind` raised at one of two lines (two causes of the same kind)."""
    try:
        if line == 1:
            raise kind("secret prompt text")
        raise kind("secret prompt text")
    except Exception as exc:  # noqa: BLE001 - what the front catches
        return exc


def test_one_traceback_per_cause_a_minute(caplog, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(common.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(common, "_tracebacks", common.OrderedDict())
    with caplog.at_level(logging.ERROR, logger="fly_daemon"):
        errors = [common.internal(_raised(RuntimeError, 1)) for _ in range(3)]
        common.internal(_raised(RuntimeError, 2))  # another line: another cause
        common.internal(_raised(KeyError, 1))  # another kind: another cause
        clock[0] += common.TRACEBACK_EVERY
        common.internal(_raised(RuntimeError, 1))  # a minute on: its traceback again
    with_traceback = [r for r in caplog.records if r.exc_info]
    assert len(caplog.records) == 6 and len(with_traceback) == 4
    assert "again" in caplog.records[1].getMessage() and "RuntimeError" in caplog.records[1].getMessage()
    ids = [e.message.split("request id ")[1].split(")")[0] for e in errors]
    assert len(set(ids)) == 3 and all(e.code == "INTERNAL" and "secret" not in e.message for e in errors)
    assert all(i in r.getMessage() for i, r in zip(ids, caplog.records))  # each line names its request
    assert not any("secret" in r.getMessage() for r in caplog.records)


def test_the_causes_remembered_are_bounded(monkeypatch):
    monkeypatch.setattr(common, "_tracebacks", common.OrderedDict())
    for n in range(common._CAUSES_KEPT + 10):
        common.internal(type(f"Kind{n}", (Exception,), {})("x"))
    assert len(common._tracebacks) == common._CAUSES_KEPT
