"""An incremental scanner of one JSON tool-call object, fed character by character as text streams in.

It finds the call's name (the string under `name_key`) as soon as that string is complete, and the
span of the arguments value (under one of `args_keys`) as it grows, without ever re-reading text:
the parsers stream the arguments as raw JSON text, so the fragments they hand out, joined, are
exactly the arguments text the model wrote.
"""

from __future__ import annotations

import json

_WS = " \t\r\n"


class JsonCallScanner:
    """Scans `{"name": "...", "arguments": {...}}` (keys in any order, other keys skipped)."""

    def __init__(self, args_keys: tuple[str, ...] = ("arguments",), name_key: str = "name") -> None:
        self.args_keys = args_keys
        self.name_key = name_key
        self.text: list[str] = []  # every character fed, from the opening brace
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.expect_key = False  # at depth 1, a key string comes next
        self.expect_value = False  # at depth 1, after the colon: the value comes next
        self.key_start = -1  # offset of the key string being read (depth 1)
        self.key: str | None = None  # the key whose value is being read (depth 1)
        self.value_start = -1  # offset of its value's first character; -1 before it
        self.name: str | None = None
        self.args_start = -1
        self.args_end = -1  # one past the arguments value, once complete
        self.done = False  # the object is closed
        self.failed = False  # the text is no JSON object

    @property
    def args_open(self) -> bool:
        """Inside a container-valued arguments value: every character so far belongs to it."""
        return self.args_start >= 0 and self.args_end < 0 and self.text[self.args_start] in "{["

    def raw(self, start: int, end: int) -> str:
        return "".join(self.text[start:end])

    def feed(self, ch: str) -> None:
        if self.done or self.failed:
            return
        pos = len(self.text)
        self.text.append(ch)
        if self.text[0] != "{":
            self.failed = True
            return
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                self._string_closed(pos)
            return
        if ch in _WS:
            return
        if self.depth == 1 and self.expect_value:
            self.expect_value = False
            self.value_start = pos
            if self.key in self.args_keys and self.args_start < 0:
                self.args_start = pos
        if ch == '"':
            self.in_string = True
            if self.depth == 1 and self.expect_key:
                self.key_start = pos
        elif ch in "{[":
            self.depth += 1
            if self.depth == 1:
                self.expect_key = True
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._container_closed(pos)
            elif self.depth == 0:
                self._value_closed(pos)
                self.done = True
        elif ch == ":" and self.depth == 1 and self.key is not None:
            self.expect_key = False
            self.expect_value = True
        elif ch == "," and self.depth == 1:
            self._value_closed(pos)
            self.expect_key = True

    def _string_closed(self, pos: int) -> None:
        if self.depth != 1:
            return
        if self.expect_key and self.key_start >= 0:
            self.key = _loads(self.raw(self.key_start, pos + 1))
            self.key_start = -1
            self.value_start = -1
        elif self.key == self.name_key and self.value_start >= 0 and self.name is None:
            name = _loads(self.raw(self.value_start, pos + 1))
            self.name = name if isinstance(name, str) else None

    def _container_closed(self, pos: int) -> None:
        """A nested object or array closed back at depth 1: a container value of the call ended."""
        if self.key in self.args_keys and self.args_start >= 0 and self.args_end < 0:
            self.args_end = pos + 1

    def _value_closed(self, pos: int) -> None:
        """A depth-1 value ended at `pos` (a comma or the closing brace): scalars end here."""
        if self.key in self.args_keys and self.args_start >= 0 and self.args_end < 0:
            end = pos
            while end > self.args_start and self.text[end - 1] in _WS:
                end -= 1
            self.args_end = end
        self.key = None
        self.value_start = -1

    def arguments(self) -> str | None:
        """The complete arguments as JSON text (a JSON string value is unwrapped), or None before."""
        if self.args_end < 0:
            return None
        raw = self.raw(self.args_start, self.args_end)
        if raw.startswith('"'):
            value = _loads(raw)
            return value if isinstance(value, str) else raw
        return raw


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
