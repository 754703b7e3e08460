"""Command-line flags made from the settings' declarations: one field, one flag (as vLLM makes its engine args).

A field `queue_size` of a settings model (fly_daemon.settings: `[daemon] queue_size` in the config file,
`FLY_QUEUE_SIZE` in the environment) is `--queue-size` on the command line, with the field's type (a `Literal`'s
values as choices), its description's first sentence and its declared default as help. A switch that is on by
default is `--no-NAME`, one that is off `--NAME`; a list or tuple is comma-separated text, except where
`SPELLINGS` says otherwise. No default is given to argparse: an absent flag is None, so the environment, the
config file and then the declared default decide (fly_daemon.settings.load_settings).
"""

from __future__ import annotations

import argparse
import re
import types
from collections.abc import Iterable
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from fly_daemon.settings import comma_separated

SPELLINGS: dict[str, dict[str, Any]] = {
    "allowed_hosts": {"flag": "--allowed-host", "action": "append", "metavar": "HOST",
                      "help": "also answer HTTP requests whose Host is HOST (repeatable; '*': any); else a loopback "
                              "--http answers only localhost, 127.0.0.1, [::1] and its own host"},
    "http": {"metavar": "HOST:PORT"},
    "trusted_proxies": {"metavar": "CIDR[,CIDR...]"},
    "embedding_model": {"metavar": "PATH_OR_ID"},
    "api_key": {"help": "Bearer key the HTTP front requires (needed for a non-loopback --http; prefer FLY_API_KEY: "
                        "flags show in the process list)"},
}
"""Flags spelled other than their field: another name, a repeatable flag, a metavar, help for the command line."""
_FIRST_SENTENCE = re.compile(r"\.\s+(?=[A-Z(])")
"""Where a description's first sentence ends ("e.g. 'auto'" does not end one)."""


def add_flags(group: argparse._ActionsContainer, model: type[BaseModel], names: Iterable[str] | None = None) -> None:
    """A flag on `group` for each field of `model` (or for the fields `names`, in that order)."""
    for name in model.model_fields if names is None else names:
        flag, options = flag_for(name, model.model_fields[name])
        group.add_argument(flag, dest=name, **options)


def flag_for(name: str, field: FieldInfo) -> tuple[str, dict[str, Any]]:
    """The flag of the field `name` and its argparse options."""
    spelling = dict(SPELLINGS.get(name, {}))
    dashed = name.replace("_", "-")
    kind = without_none(field.annotation)
    options: dict[str, Any] = {"help": spelling.pop("help", None) or _help(field)}
    if kind is bool:
        flag = f"--no-{dashed}" if field.default is True else f"--{dashed}"
        options.update(action="store_const", const=not field.default)
    else:
        flag = f"--{dashed}"
        if get_origin(kind) is Literal:
            values = get_args(kind)
            options.update(choices=list(values), type=type(values[0]))
        elif get_origin(kind) in (list, tuple):
            options.update(type=comma_separated)
        else:
            options.update(type=str if kind is SecretStr else kind)
    options.update(spelling)
    flag = options.pop("flag", flag)
    if options.get("action") == "append":
        options.pop("type", None)
    return flag, options


def without_none(annotation: Any) -> Any:
    """`X` of `X | None`; anything else as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [kind for kind in get_args(annotation) if kind is not type(None)]
        return kinds[0] if len(kinds) == 1 else annotation
    return annotation


def _help(field: FieldInfo) -> str | None:
    """The description's first sentence, with the declared default where there is one to show (a switch's says
    which way it is by default)."""
    text = _FIRST_SENTENCE.split(field.description or "")[0].rstrip(".")
    default = field.default
    if isinstance(default, bool):
        lowered = text[:1].lower() + text[1:] if text[1:2].islower() else text  # "FLy's" stays
        text = f"{'turns off' if default else 'turns on'}: {lowered}" if text else None
    elif default not in (None, PydanticUndefined):
        shown = ",".join(default) if isinstance(default, tuple) else default
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%") if text else None
