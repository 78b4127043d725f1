"""Just enough YANG (RFC 7950) to check CONFIG_DB entries against a SONiC model read from its file.

``tests/netconfig/vendor_rules.py`` holds the SONiC rules transcribed by hand; this reads them
from the model itself, so a transcription error or a newer model cannot pass unnoticed. It
parses the statement grammar (RFC 7950 §6: keywords, quoted and ``+``-concatenated strings,
blocks), resolves typedefs, and checks a list entry's leaves: enumeration, string ``length`` and
``pattern`` (XSD regexes, anchored), ``uint8/16/32`` bounds and ``range``, ``union``, ``leafref``
(against given key sets), ``inet:ip-address`` (as ietf-inet-types means it, without zones),
``default``, and ``when``/``must`` in the small XPath subset SONiC's mirror model uses
(``current()``, ``../leaf``, ``=``, ``contains``, ``not``, ``and``, ``or``, parentheses).

A problem is ``(kind, message)``; the kinds are the ``eStrKey`` names of SONiC's own YANG model
tests (``InvalidValue``, ``Pattern``, ``Bounds``, ``When``, ``LeafRef``), plus ``Length``,
``Range``, ``Must`` and ``Unknown``; the message is the model's ``error-message`` where it has one.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field

_TOKEN = re.compile(r"""\s+|//[^\n]*|/\*.*?\*/|"((?:[^"\\]|\\.)*)"|'([^']*)'|([;{}+])|([^\s;{}"']+)""", re.S)
_UINT_BITS = {"uint8": 8, "uint16": 16, "uint32": 32}


@dataclass
class Stmt:
    keyword: str
    arg: str | None
    children: list[Stmt] = field(default_factory=list)

    def find(self, keyword: str, arg: str | None = None) -> Stmt | None:
        return next((c for c in self.children if c.keyword == keyword and arg in (None, c.arg)), None)

    def all(self, keyword: str) -> list[Stmt]:
        return [c for c in self.children if c.keyword == keyword]


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"YANG: cannot read at offset {pos}: {text[pos:pos + 20]!r}")
        pos = m.end()
        double, single, punct, word = m.groups()
        if double is not None:
            out.append(("str", re.sub(r"\\(.)", lambda e: {"n": "\n", "t": "\t"}.get(e.group(1), e.group(1)), double)))
        elif single is not None:
            out.append(("str", single))
        elif punct is not None:
            out.append(("punct", punct))
        elif word is not None:
            out.append(("str", word))
    return out


def parse(text: str) -> Stmt:
    """The module statement of a YANG file."""
    tokens = _tokens(text)
    pos = 0

    def argument() -> str | None:
        nonlocal pos
        if tokens[pos][0] == "punct":
            return None
        value = tokens[pos][1]
        pos += 1
        while tokens[pos] == ("punct", "+"):  # "a" + "b"
            value += tokens[pos + 1][1]
            pos += 2
        return value

    def statements() -> list[Stmt]:
        nonlocal pos
        out = []
        while pos < len(tokens) and tokens[pos] != ("punct", "}"):
            keyword = tokens[pos][1]
            pos += 1
            stmt = Stmt(keyword, argument())
            if tokens[pos] == ("punct", "{"):
                pos += 1
                stmt.children = statements()
                pos += 1  # "}"
            else:
                pos += 1  # ";"
            out.append(stmt)
        return out

    (module,) = statements()
    return module


# -- XPath, the subset of when/must the mirror model uses --------------------------------------

_XPATH = re.compile(r"\s*(current\(\)(?:/\.\./[\w-]+)?|\.\./[\w-]+|'[^']*'|\(|\)|,|=|and\b|or\b|not\b|contains\b)")


def xpath(expr: str, entry: dict[str, str], leaf: str, defaults: dict[str, str]) -> bool:
    tokens, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _XPATH.match(expr, pos)
        if m is None:
            raise ValueError(f"XPath outside the supported subset: {expr[pos:]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    at = 0

    def value(path: str) -> str | None:
        name = leaf if path == "current()" else path.rsplit("/", 1)[1]
        return entry.get(name, defaults.get(name))

    def primary():
        nonlocal at
        token = tokens[at]
        at += 1
        if token == "(":
            out = disjunction()
            at += 1
            return out
        if token in ("not", "contains"):
            at += 1  # "("
            args = [disjunction()]
            while tokens[at] == ",":
                at += 1
                args.append(disjunction())
            at += 1  # ")"
            if token == "not":
                return not args[0]
            return args[1] in (args[0] or "")
        if token.startswith("'"):
            return token[1:-1]
        return value(token)

    def comparison():
        nonlocal at
        left = primary()
        if at < len(tokens) and tokens[at] == "=":
            at += 1
            right = primary()
            return left is not None and left == right
        return left

    def conjunction():
        nonlocal at
        out = comparison()
        while at < len(tokens) and tokens[at] == "and":
            at += 1
            out = comparison() and out
        return out

    def disjunction():
        nonlocal at
        out = conjunction()
        while at < len(tokens) and tokens[at] == "or":
            at += 1
            out = conjunction() or out
        return out

    return bool(disjunction())


# -- types ------------------------------------------------------------------------------------

def _message(stmt: Stmt | None, fallback: str) -> str:
    found = stmt.find("error-message") if stmt is not None else None
    return found.arg if found is not None and found.arg else fallback


def _in_ranges(spec: str, number: int, low: int, high: int) -> bool:
    for part in spec.split("|"):
        bounds = [b.strip() for b in part.split("..")]
        lo = low if bounds[0] == "min" else int(bounds[0])
        hi = high if bounds[-1] == "max" else int(bounds[-1])
        if lo <= number <= hi:
            return True
    return False


class Model:
    """One module's typedefs and one list, checked entry by entry."""

    def __init__(self, module: Stmt, list_path: tuple[str, ...]):
        self.typedefs = {t.arg: t.find("type") for t in module.all("typedef")}
        node = module
        for name in list_path:
            found = node.find("container", name) or node.find("list", name)
            if found is None:
                raise ValueError(f"YANG: no container or list {name!r} under {node.keyword} {node.arg}")
            node = found
        self.list = node
        self.key = node.find("key").arg
        self.leaves = {leaf.arg: leaf for leaf in node.all("leaf")}
        self.defaults = {name: leaf.find("default").arg for name, leaf in self.leaves.items() if leaf.find("default")}

    def check_type(self, type_stmt: Stmt, value: str, leafrefs: dict[str, set[str]]) -> tuple[str, str] | None:
        name = type_stmt.arg
        if name in self.typedefs:
            return self.check_type(self.typedefs[name], value, leafrefs)
        if name == "enumeration":
            enums = [e.arg for e in type_stmt.all("enum")]
            return None if value in enums else ("InvalidValue", f"{value!r} is not one of {enums}")
        if name == "union":
            problems = [self.check_type(t, value, leafrefs) for t in type_stmt.all("type")]
            return None if None in problems else ("InvalidValue", f"{value!r} matches no member of the union")
        if name == "leafref":
            path = type_stmt.find("path").arg
            known = leafrefs.get(path, set())
            return None if value in known else ("LeafRef", f"{value!r} is not in {path}")
        if name == "inet:ip-address":
            try:
                ipaddress.ip_address(value)
                return None
            except ValueError:
                return ("InvalidValue", f"{value!r} is not an ip-address")
        if name in _UINT_BITS:
            if not isinstance(value, str) or not re.fullmatch(r"\+?[0-9]+", value):
                return ("InvalidValue", f"{value!r} is not a {name}")
            number, high = int(value), 2 ** _UINT_BITS[name] - 1
            if number > high:
                return ("Bounds", f"{value} is out of {name}'s bounds 0..{high}")
            restriction = type_stmt.find("range")
            if restriction is not None and not _in_ranges(restriction.arg, number, 0, high):
                return ("Range", _message(restriction, f"{value} is not in {restriction.arg}"))
            return None
        if name == "string":
            if not isinstance(value, str):
                return ("InvalidValue", f"{value!r} is not a string")
            length = type_stmt.find("length")
            if length is not None and not _in_ranges(length.arg, len(value), 0, 2 ** 64):
                return ("Length", _message(length, f"length {len(value)} is not in {length.arg}"))
            for pattern in type_stmt.all("pattern"):
                # XSD regexes are anchored at both ends; these use no XSD-only syntax.
                if not re.fullmatch(pattern.arg, value):
                    return ("Pattern", _message(pattern, f"{value!r} does not match {pattern.arg}"))
            return None
        return ("Unknown", f"type {name} is not supported by this checker")

    def check(self, entry: dict[str, str], leafrefs: dict[str, set[str]]) -> list[tuple[str, str]]:
        """Every problem of one list entry (a dict including its key leaf)."""
        problems = []
        for name, value in entry.items():
            leaf = self.leaves.get(name)
            if leaf is None:
                problems.append(("Unknown", f"{name!r} is not a leaf of {self.list.arg}"))
                continue
            when = leaf.find("when")
            if when is not None and not xpath(when.arg, entry, name, self.defaults):
                problems.append(("When", f"{name} exists only when {when.arg}"))
                continue
            found = self.check_type(leaf.find("type"), value, leafrefs)
            if found is not None:
                problems.append(found)
                continue
            for must in leaf.all("must"):
                if not xpath(must.arg, entry, name, self.defaults):
                    problems.append(("Must", _message(must, f"{name}: must {must.arg}")))
        if self.key not in entry:
            problems.append(("Unknown", f"key {self.key} is missing"))
        return problems
