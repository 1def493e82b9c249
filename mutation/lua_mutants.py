"""A small mutator for the store's and the periodic tasks' Lua scripts.

Three kinds of mutant, each one change of one script:

- operator: a comparison, arithmetic, concatenation-free logical operator
  swapped for its neighbour (``<`` and ``<=``, ``==`` and ``~=``, ``+`` and
  ``-``, ``and`` and ``or``), or a ``not`` dropped;
- constant: a number literal moved by one (``0`` becomes ``1``), ``true`` and
  ``false`` swapped;
- line: a whole statement on one line deleted (``redis.call(...)``,
  an assignment, a ``return``), never a line that opens or closes a block.

The scripts are tokenized, so comments and string literals (error
messages, command names) are never mutated, and every mutant is still
valid Lua: a mutant is a behaviour change, not a syntax error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LuaMutant", "Token", "mutants", "tokenize"]


@dataclass(frozen=True)
class Token:
    """One Lua token: *kind* is ``name``, ``number``, ``string``, ``op`` or ``comment``."""

    kind: str
    text: str
    start: int
    line: int


@dataclass(frozen=True)
class LuaMutant:
    """A mutant of one script: *source* is the whole mutated script."""

    script: str
    kind: str
    line: int
    description: str
    source: str

    @property
    def ident(self) -> str:
        return f"{self.script}:{self.line}:{self.kind}:{self.description}"


_LONG_BRACKET = re.compile(r"\[(=*)\[")
_NUMBER = re.compile(r"0[xX][0-9a-fA-F]+|\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPS = ("...", "..", "==", "~=", "<=", ">=", "//", "::", "<<", ">>")


def tokenize(source: str) -> list[Token]:
    """Split Lua *source* into tokens (whitespace dropped)."""
    tokens: list[Token] = []
    i, line, n = 0, 1, len(source)
    while i < n:
        char = source[i]
        if char == "\n":
            line += 1
            i += 1
        elif char.isspace():
            i += 1
        elif source.startswith("--", i):
            long = _LONG_BRACKET.match(source, i + 2)
            if long:
                close = "]" + long.group(1) + "]"
                end = source.find(close, long.end())
                end = n if end < 0 else end + len(close)
            else:
                end = source.find("\n", i)
                end = n if end < 0 else end
            tokens.append(Token("comment", source[i:end], i, line))
            line += source.count("\n", i, end)
            i = end
        elif char in "'\"":
            j = i + 1
            while j < n and source[j] != char:
                j += 2 if source[j] == "\\" else 1
            tokens.append(Token("string", source[i : j + 1], i, line))
            line += source.count("\n", i, j + 1)
            i = j + 1
        elif char == "[" and _LONG_BRACKET.match(source, i):
            long = _LONG_BRACKET.match(source, i)
            assert long is not None
            close = "]" + long.group(1) + "]"
            end = source.find(close, long.end())
            end = n if end < 0 else end + len(close)
            tokens.append(Token("string", source[i:end], i, line))
            line += source.count("\n", i, end)
            i = end
        elif char.isdigit() or (char == "." and i + 1 < n and source[i + 1].isdigit()):
            match = _NUMBER.match(source, i)
            assert match is not None
            tokens.append(Token("number", match.group(), i, line))
            i = match.end()
        elif char.isalpha() or char == "_":
            match = _NAME.match(source, i)
            assert match is not None
            tokens.append(Token("name", match.group(), i, line))
            i = match.end()
        else:
            op = next((o for o in _OPS if source.startswith(o, i)), char)
            tokens.append(Token("op", op, i, line))
            i += len(op)
    return tokens


#: Each operator and the one it becomes (the boundary or the opposite).
_SWAPS = {
    "<": "<=",
    "<=": "<",
    ">": ">=",
    ">=": ">",
    "==": "~=",
    "~=": "==",
    "+": "-",
    "-": "+",
    "*": "/",
    "/": "*",
    "%": "*",
    "and": "or",
    "or": "and",
    "true": "false",
    "false": "true",
}
_BLOCK_WORDS = {
    "do",
    "then",
    "else",
    "elseif",
    "end",
    "function",
    "repeat",
    "until",
    "for",
    "if",
    "while",
}
_OPENERS, _CLOSERS = "({[", ")}]"


def mutants(script: str, source: str) -> list[LuaMutant]:
    """Every operator, constant and line-deletion mutant of *source*."""
    tokens = tokenize(source)
    found: list[LuaMutant] = []
    code = [t for t in tokens if t.kind != "comment"]
    for index, token in enumerate(code):
        before = code[index - 1] if index else None
        if token.kind == "number":
            value = _number(token.text)
            if value is None:
                continue
            new = "1" if value == 0 else str(value + 1)
            found.append(_replace(script, source, token, new, "constant"))
        elif token.text in _SWAPS and token.kind in ("op", "name"):
            if token.text == "-" and _unary(before):
                # A negative literal or negation: dropping the sign is the mutant.
                found.append(_replace(script, source, token, "", "operator"))
                continue
            kind = "constant" if token.text in ("true", "false") else "operator"
            found.append(_replace(script, source, token, _SWAPS[token.text], kind))
        elif token.kind == "name" and token.text == "not":
            found.append(_replace(script, source, token, "", "operator", spaced=True))
    found.extend(_line_deletions(script, source, code))
    return found


def _number(text: str) -> int | None:
    try:
        return int(text, 0)
    except ValueError:
        return None


def _unary(before: Token | None) -> bool:
    if before is None:
        return True
    if before.kind in ("number", "string"):
        return False
    if before.kind == "name":
        return before.text in {"return", "and", "or", "not", "in", *_BLOCK_WORDS} - {"end"}
    return before.text not in (")", "]", "}")


def _replace(
    script: str, source: str, token: Token, new: str, kind: str, *, spaced: bool = False
) -> LuaMutant:
    end = token.start + len(token.text)
    if spaced and source[end : end + 1] == " ":
        end += 1
    mutated = source[: token.start] + new + source[end:]
    shown = f"{token.text!s} -> {new or '(removed)'}"
    return LuaMutant(script, kind, token.line, shown, mutated)


def _binary(token: Token) -> bool:
    """Whether *token* is a binary operator: a statement does not end before or after it."""
    if token.kind == "name":
        return token.text in ("and", "or")
    return token.kind == "op" and token.text not in (")", "]", "}", ";", "#", "-")


def _line_deletions(script: str, source: str, code: list[Token]) -> list[LuaMutant]:
    lines = source.split("\n")
    by_line: dict[int, list[Token]] = {}
    for token in code:
        by_line.setdefault(token.line, []).append(token)
    found = []
    depth = 0
    continued = False  # the statement before goes on onto this line
    for number in range(1, len(lines) + 1):
        line_tokens = by_line.get(number, [])
        if not line_tokens:
            continue
        starts_inside = depth > 0 or continued or _binary(line_tokens[0])
        continued = _binary(line_tokens[-1]) or line_tokens[-1].text in ("(", "{", "[", ",", "=")
        for token in line_tokens:
            if token.kind == "op" and token.text in _OPENERS:
                depth += 1
            elif token.kind == "op" and token.text in _CLOSERS:
                depth -= 1
        following = next(
            (by_line[n] for n in range(number + 1, len(lines) + 1) if n in by_line), []
        )
        if (
            starts_inside
            or continued
            or (following and _binary(following[0]))
            or depth != 0
            or any(t.kind == "name" and t.text in _BLOCK_WORDS for t in line_tokens)
            or line_tokens[0].text == "local"
            or any(t.kind in ("string", "comment") and "\n" in t.text for t in line_tokens)
        ):
            continue
        mutated = "\n".join([*lines[: number - 1], "", *lines[number:]])
        found.append(
            LuaMutant(script, "line", number, f"deleted: {lines[number - 1].strip()}", mutated)
        )
    return found
