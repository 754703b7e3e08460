"""Nested pydantic models for tool arguments: pydantic gives their schema `$defs` and `$ref`s (issue 33).

Strings are short and lists bounded: a tiny random-weight model's free-length string never ends.
"""

from pydantic import BaseModel, Field


class Address(BaseModel):
    """Where someone lives."""

    street: str = Field(max_length=8)
    city: str = Field(max_length=8)


class Person(BaseModel):
    """Someone to save, with where they live and at most one friend."""

    name: str = Field(max_length=8)
    address: Address
    friends: list["Person"] = Field(default=[], max_length=1)
