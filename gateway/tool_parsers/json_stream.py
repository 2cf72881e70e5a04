"""An incremental strict-JSON scanner for streamed tool calls.

`JsonTokens` tokenizes one JSON object or array as its text arrives (any split), and
raises `InvalidCall` at the first character that cannot continue valid JSON. A
`CallBuilder` follows the tokens of one call object (`{"name": ..., "arguments": {...}}`)
and re-serializes its arguments as they arrive in the canonical form below.

Canonical arguments text: what `json.dumps(value, ensure_ascii=False)` writes for the
arguments object -- `", "` and `": "` separators, no other whitespace, strings escaped
as json.dumps escapes them, numbers as `json.dumps(json.loads(number))`. A streamed
call's argument fragments concatenate to exactly the `arguments` string that the
non-streamed response gives for the same output (both come from this scanner), and that
string equals `json.dumps(json.loads(raw_arguments), ensure_ascii=False)` (a call with a
duplicate "name" or arguments key is not a call). Arguments given as a JSON *string*
(`"arguments": "{...}"`) are passed on as that string, whole, once it ends.
"""

from __future__ import annotations

import json
import re

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")
_LITERALS = ("true", "false", "null")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WS = " \t\n\r"
ARG_KEYS = ("arguments", "parameters")

# (kind, text, depth): kind is one of { } [ ] , : key s< s s> num lit; depth is the
# number of containers open around the token (a container's own brackets are outside).
Token = tuple[str, str, int]


class InvalidCall(ValueError):
    """The text cannot be (or continue) a valid tool call."""


class JsonTokens:
    """Tokenizes one JSON object or array incrementally (`feed`); `done` once it closes."""

    def __init__(self) -> None:
        self.done = False
        self._stack: list[str] = []
        self._expect = "value"  # value | value_or_end | key | key_or_end | colon | comma_or_end
        self._mode = ""  # "" | str | key | num | lit
        self._buf = ""
        self._chars: list[str] = []
        self._escape: str | None = None
        self._high: int | None = None

    def feed(self, text: str) -> tuple[int, list[Token]]:
        """(characters consumed, tokens): stops right after the value's last character."""
        tokens: list[Token] = []
        for i, ch in enumerate(text):
            if self.done:
                return i, tokens
            self._char(ch, tokens)
        if self._mode == "str" and self._chars:
            tokens.append(("s", "".join(self._chars), len(self._stack)))
            self._chars.clear()
        return len(text), tokens

    def _add(self, ch: str) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            code = ord(ch)
            if 0xDC00 <= code < 0xE000:
                self._chars.append(chr(0x10000 + ((high - 0xD800) << 10) + (code - 0xDC00)))
                return
            self._chars.append(chr(high))
        self._chars.append(ch)

    def _string_char(self, ch: str, tokens: list[Token]) -> None:
        if self._escape is not None:
            if self._escape == "":
                if ch == "u":
                    self._escape = "u"
                    return
                if ch not in _ESCAPES:
                    raise InvalidCall(f"bad escape \\{ch}")
                self._escape = None
                self._add(_ESCAPES[ch])
                return
            if ch not in "0123456789abcdefABCDEF":
                raise InvalidCall("bad \\u escape")
            self._escape += ch
            if len(self._escape) == 5:
                code, self._escape = int(self._escape[1:], 16), None
                if 0xD800 <= code < 0xDC00 and self._high is None:
                    self._high = code
                else:
                    self._add(chr(code))
            return
        if ch == "\\":
            self._escape = ""
            return
        if ch == '"':
            if self._high is not None:
                self._chars.append(chr(self._high))
                self._high = None
            depth = len(self._stack)
            if self._mode == "key":
                tokens.append(("key", "".join(self._chars), depth))
                self._expect = "colon"
            else:
                if self._chars:
                    tokens.append(("s", "".join(self._chars), depth))
                tokens.append(("s>", "", depth))
                self._expect = "comma_or_end"
            self._chars.clear()
            self._mode = ""
            return
        if ord(ch) < 0x20:
            raise InvalidCall("control character in a string")
        self._add(ch)

    def _char(self, ch: str, tokens: list[Token]) -> None:
        mode = self._mode
        if mode in ("str", "key"):
            self._string_char(ch, tokens)
            return
        if mode == "lit":
            self._buf += ch
            if self._buf in _LITERALS:
                tokens.append(("lit", self._buf, len(self._stack)))
                self._mode, self._expect = "", "comma_or_end"
            elif not any(lit.startswith(self._buf) for lit in _LITERALS):
                raise InvalidCall(f"bad literal {self._buf!r}")
            return
        if mode == "num":
            if ch in "0123456789+-.eE":
                self._buf += ch
                return
            if not _NUMBER.match(self._buf):
                raise InvalidCall(f"bad number {self._buf!r}")
            tokens.append(("num", self._buf, len(self._stack)))
            self._mode, self._expect = "", "comma_or_end"
        if ch in _WS:
            return
        expect, depth = self._expect, len(self._stack)
        if expect in ("value", "value_or_end"):
            if ch == "]" and expect == "value_or_end":
                self._close(ch, tokens)
            elif ch in "{[":
                tokens.append((ch, "", depth))
                self._stack.append(ch)
                self._expect = "key_or_end" if ch == "{" else "value_or_end"
            elif depth == 0:
                raise InvalidCall("not a JSON object or array")
            elif ch == '"':
                tokens.append(("s<", "", depth))
                self._mode = "str"
            elif ch in "-0123456789":
                self._mode, self._buf = "num", ch
            elif ch in "tfn":
                self._mode, self._buf = "lit", ch
            else:
                raise InvalidCall(f"unexpected {ch!r}")
        elif expect in ("key", "key_or_end"):
            if ch == "}" and expect == "key_or_end":
                self._close(ch, tokens)
            elif ch == '"':
                self._mode = "key"
            else:
                raise InvalidCall(f"unexpected {ch!r} where a key belongs")
        elif expect == "colon":
            if ch != ":":
                raise InvalidCall(f"unexpected {ch!r} where ':' belongs")
            tokens.append((":", "", depth))
            self._expect = "value"
        elif ch == ",":
            tokens.append((",", "", depth))
            self._expect = "key" if self._stack[-1] == "{" else "value"
        elif (ch == "}" and self._stack[-1] == "{") or (ch == "]" and self._stack[-1] == "["):
            self._close(ch, tokens)
        else:
            raise InvalidCall(f"unexpected {ch!r}")

    def _close(self, ch: str, tokens: list[Token]) -> None:
        self._stack.pop()
        tokens.append((ch, "", len(self._stack)))
        self._expect = "comma_or_end"
        self.done = not self._stack


def canonical(kind: str, text: str) -> str:
    """The canonical (json.dumps) text of one token."""
    if kind in ("s", "key"):
        quoted = json.dumps(text, ensure_ascii=False)
        return quoted if kind == "key" else quoted[1:-1]
    if kind == "num":
        return json.dumps(json.loads(text))
    if kind in ("s<", "s>"):
        return '"'
    if kind == ",":
        return ", "
    if kind == ":":
        return ": "
    return text or kind


class CallBuilder:
    """One call object whose `{` comes at `depth`: its name once known and its canonical
    arguments text so far (`args`, a list of fragments); `closed` once it ends. With
    `name` given, the object itself is the arguments (Mistral's `name[ARGS]{...}`, a
    named tool_choice)."""

    def __init__(self, depth: int = 0, name: str | None = None) -> None:
        self.name = name
        self.args: list[str] = []
        self.closed = False
        self._args_only = name is not None
        self._depth = depth
        self._started = False
        self._key: str | None = None
        self._field: str | None = None  # name | args | args_str | skip, inside that value
        self._parts: list[str] = []
        self._has_args = False

    def token(self, kind: str, text: str, depth: int) -> None:
        """Consumes one token of the object (InvalidCall when it cannot be a call)."""
        inner = self._depth + 1
        if not self._started:
            if kind != "{":
                raise InvalidCall("a call is a JSON object")
            self._started = True
            if self._args_only:
                self.args.append("{")
            return
        if self._args_only:
            self.args.append(canonical(kind, text))
            self.closed = kind == "}" and depth == self._depth
            return
        field = self._field
        if field is None:
            if kind == "}" and depth == self._depth:
                if self.name is None:
                    raise InvalidCall("the call has no name")
                if not self._has_args:
                    self.args.append("{}")
                self.closed = True
            elif kind == "key":
                self._key = text
            elif kind not in (":", ","):
                self._start_value(kind)
            return
        if field in ("name", "args_str"):
            if kind == "s":
                self._parts.append(text)
                return
            value, self._parts, self._field = "".join(self._parts), [], None
            if field == "name":
                if not value:
                    raise InvalidCall("empty name")
                self.name = value
                return
            try:
                json.loads(value)
            except json.JSONDecodeError:
                raise InvalidCall("arguments string is not JSON") from None
            self.args.append(value)
            return
        if field == "args":
            self.args.append(canonical(kind, text))
        if depth == inner and kind in ("}", "]", "s>"):
            self._field = None

    def _start_value(self, kind: str) -> None:
        key = self._key
        if key == "name":
            if kind != "s<" or self.name is not None:
                raise InvalidCall("name must be a string, given once")
            self._field = "name"
        elif key in ARG_KEYS:
            if self._has_args:
                raise InvalidCall("arguments given twice")
            self._has_args = True
            if kind == "s<":
                self._field = "args_str"
            elif kind == "{":
                self._field = "args"
                self.args.append("{")
            else:
                raise InvalidCall("arguments must be an object")
        elif kind in ("{", "[", "s<"):
            self._field = "skip"
