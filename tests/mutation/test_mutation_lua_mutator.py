"""Every Lua mutant that ``make mutants`` runs is valid Lua that changes code, never a comment.

A mutant that does not compile would be "killed" by any test and inflate
the kill rate; a mutant inside a comment or an error message would
survive every test and deflate it. So each one is compiled by a real
Redis (``SCRIPT LOAD`` compiles without running) and compared, token by
token, with its script.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import redis

import celery_zdelay
from celery_zdelay.testing import RedisServer
from mutation.lua_mutants import mutants, tokenize
from mutation.targets import LUA

#: Where the package under test is: the checkout, or the installed wheel
#: (tox runs the tests from a copy of the checkout without the package).
PACKAGE_ROOT = Path(celery_zdelay.__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


#: Lua's comments and strings, leftmost first: code never holds "--", a quote
#: or "[[" outside them, so scanning for these finds what Lua's lexer finds
#: (a pattern of its own, not the mutator's tokenizer: it checks that one,
#: and is 50 times faster on the 1,700 mutants compared).
_PROSE = re.compile(
    r"--\[(=*)\[.*?\]\1\]"  # long comment
    r"|--[^\n]*"  # line comment
    r'|"(?:\\.|[^"\\])*"'  # double-quoted string
    r"|'(?:\\.|[^'\\])*'"  # single-quoted string
    r"|\[(=*)\[.*?\]\2\]",  # long string
    re.DOTALL,
)


def _prose(source: str) -> Counter[str]:
    return Counter(match.group() for match in _PROSE.finditer(source))


def test_the_prose_pattern_finds_what_the_tokenizer_finds() -> None:
    for target in LUA:
        source = (PACKAGE_ROOT / target.path).read_text()
        tokens = Counter(t.text for t in tokenize(source) if t.kind in ("comment", "string"))
        assert _prose(source) == tokens, target.name


def test_comments_strings_and_long_brackets_are_single_tokens() -> None:
    source = (
        "-- a < b and c\n"
        "--[[ x == y\n  or z ]]\n"
        "local s = 'it''s' .. \"a \\\" - b\" .. [==[ 1 + 2 ]==]\n"
        "return -1 <= #s and not s ~= 0x1F\n"
    )
    kinds = [(t.kind, t.text) for t in tokenize(source)]
    assert kinds[:2] == [("comment", "-- a < b and c"), ("comment", "--[[ x == y\n  or z ]]")]
    assert ("string", '"a \\" - b"') in kinds
    assert ("string", "[==[ 1 + 2 ]==]") in kinds
    assert ("op", "<=") in kinds
    assert ("op", "~=") in kinds
    assert ("number", "0x1F") in kinds
    assert [t.line for t in tokenize(source) if t.text == "return"] == [5]


def test_each_kind_of_mutant_is_made_once_per_place() -> None:
    source = (
        "local n = tonumber(ARGV[1])\n"
        "if n >= 2 and not done then\n"
        "  redis.call('DEL', KEYS[1])\n"
        "end\n"
        "return -1\n"
    )
    found = {(m.line, m.kind, m.description) for m in mutants("x.lua", source)}
    assert found == {
        (1, "constant", "1 -> 2"),
        (2, "operator", ">= -> >"),
        (2, "constant", "2 -> 3"),
        (2, "operator", "and -> or"),
        (2, "operator", "not -> (removed)"),
        (3, "constant", "1 -> 2"),
        (3, "line", "deleted: redis.call('DEL', KEYS[1])"),
        (5, "operator", "- -> (removed)"),
        (5, "constant", "1 -> 2"),
        (5, "line", "deleted: return -1"),
    }


def test_every_mutant_of_every_script_compiles_and_leaves_comments_and_strings_alone(
    redis_server: RedisServer,
) -> None:
    client: redis.Redis = redis_server.client()
    total = 0
    for target in LUA:
        original = (PACKAGE_ROOT / target.path).read_text()
        client.script_load(original)
        prose = _prose(original)
        found = mutants(target.name, original)
        assert found, target.name
        for mutant in found:
            assert mutant.source != original, mutant.ident
            if mutant.kind != "line":
                assert _prose(mutant.source) == prose, mutant.ident
        # One round trip per script: SCRIPT LOAD of every mutant, pipelined.
        with client.pipeline(transaction=False) as pipe:
            for mutant in found:
                pipe.script_load(mutant.source)
            replies = pipe.execute(raise_on_error=False)
        for mutant, reply in zip(found, replies, strict=True):
            if isinstance(reply, redis.ResponseError):  # pragma: no cover - the failure message
                pytest.fail(f"{mutant.ident} does not compile: {reply}")
        total += len(found)
    client.script_flush()
    assert total > 500
