"""The row type of mc-ddp's bad-input tables: what a bad call must raise, and how
``docs/bad_inputs.md`` shows it (``scripts/gen_bad_inputs.py`` reads these tables, so the
document cannot drift from what the tests assert)."""

from __future__ import annotations

from typing import NamedTuple


class Expect(NamedTuple):
    """One bad call's expected failure.

    ``prefix`` is ``"<ExceptionType>: <start of the message>"``; ``also`` holds fragments the
    rest of the message must contain (the fix, where the start does not name it).
    ``doc_call`` and ``doc_input`` are the catalogue's "call" and "bad input" cells
    (markdown).
    """

    prefix: str
    doc_call: str
    doc_input: str
    also: tuple[str, ...] = ()

    @property
    def error(self) -> str:
        """The exception's type name."""
        return self.prefix.split(": ", 1)[0]

    @property
    def words(self) -> tuple[str, ...]:
        """Every asserted fragment of the message, in order."""
        return (self.prefix.split(": ", 1)[1], *self.also)


def assert_fails_as(name: str, found: str, expect: Expect) -> None:
    """``found`` (``"<ExceptionType>: <message>"``) starts with ``expect.prefix`` and holds
    every fragment of ``expect.also``."""
    assert found.startswith(expect.prefix), (name, found)
    for word in expect.also:
        assert word in found, (name, word, found)
