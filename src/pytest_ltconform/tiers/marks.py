"""The ``-m`` (and ``-k``) expressions item generation reads, parsed here (pytest's parser is
private)."""

from __future__ import annotations

import re

# A -m token: parentheses, an identifier as pytest spells marker names (letters, digits,
# _ : + - . [ ] \ /) with its keyword arguments if any, or anything else (an error).
_MARK_TOKEN = re.compile(r"\s*(?:(\()|(\))|([\w:+\-.\[\]\\/]+)(\s*\([^)]*\))?|(\S))")


class MarkExpression:
    """A ``-m`` expression, parsed here (pytest's parser is private): ``and``, ``or``, ``not``,
    parentheses, marker names, and ``name(...)`` keyword matches (which no generated item carries).

    :meth:`matches` says whether an item with the given marker names is selected; :meth:`names`
    whether a marker is named without being negated. ``parse`` raises ``ValueError`` for text that
    is not an expression (pytest then reports it itself).
    """

    def __init__(self, tree):
        self._tree = tree  # ("name", str) | ("call", str) | ("not", t) | ("and" | "or", t, t) | ("all",)

    @classmethod
    def parse(cls, text: str | None) -> MarkExpression:
        tokens = cls._tokens(text or "")
        if not tokens:
            return cls(("all",))
        tree, end = cls._or(tokens, 0)
        if end != len(tokens):
            raise ValueError(f"unexpected {tokens[end][1]!r} in -m {text!r}")
        return cls(tree)

    @staticmethod
    def _tokens(text: str) -> list[tuple[str, str]]:
        out, pos = [], 0
        while True:
            m = _MARK_TOKEN.match(text, pos)
            if m is None:
                return out  # only white space is left
            if m.group(5) is not None:
                raise ValueError(f"unexpected {m.group(5)!r} in -m {text!r}")
            kind, pos = ("(" if m.group(1) else ")" if m.group(2) else m.group(3)), m.end()
            if kind in ("and", "or", "not"):
                out.append(("op", kind))
                pos = m.end(3)  # "not (a)" is an operator, not a keyword match on a marker named "not"
            elif kind in ("(", ")"):
                out.append(("op", kind))
            else:
                out.append(("call" if m.group(4) else "id", kind))

    @classmethod
    def _or(cls, toks, i):
        return cls._chain("or", cls._and, toks, i)

    @classmethod
    def _and(cls, toks, i):
        return cls._chain("and", cls._not, toks, i)

    @staticmethod
    def _chain(op, operand, toks, i):
        """``operand (op operand)*``, folded to the left."""
        left, i = operand(toks, i)
        while i < len(toks) and toks[i] == ("op", op):
            right, i = operand(toks, i + 1)
            left = (op, left, right)
        return left, i

    @classmethod
    def _not(cls, toks, i):
        if i >= len(toks):
            raise ValueError("-m expression ends too early")
        if toks[i] == ("op", "not"):
            inner, i = cls._not(toks, i + 1)
            return ("not", inner), i
        if toks[i] == ("op", "("):
            inner, i = cls._or(toks, i + 1)
            if i >= len(toks) or toks[i] != ("op", ")"):
                raise ValueError("-m expression: missing ')'")
            return inner, i + 1
        if toks[i][0] == "op":
            raise ValueError(f"-m expression: unexpected {toks[i][1]!r}")
        return ("name" if toks[i][0] == "id" else "call", toks[i][1]), i + 1

    def matches(self, markers) -> bool:
        """Whether an item carrying the marker names ``markers`` (a set) is selected."""
        return self.evaluate(lambda name: name in markers)

    def matches_keywords(self, names) -> bool:
        """Read as a ``-k`` expression: whether an item with the names ``names`` (its name, extra
        keywords and markers) is selected; a name matches case-insensitively as a substring."""
        lowered = [n.lower() for n in names]
        return self.evaluate(lambda sub: any(sub.lower() in n for n in lowered))

    def evaluate(self, name_matches) -> bool:
        """The expression's value, with ``name_matches(name)`` deciding each bare name."""
        def ev(t) -> bool:
            op = t[0]
            if op == "all":
                return True
            if op == "name":
                return name_matches(t[1])
            if op == "call":
                return False  # generated items carry no marker arguments
            if op == "not":
                return not ev(t[1])
            return (ev(t[1]) and ev(t[2])) if op == "and" else (ev(t[1]) or ev(t[2]))
        return ev(self._tree)

    def names(self, marker: str) -> bool:
        """Whether ``marker`` appears in the expression under an even number of ``not``."""
        def walk(t, negated: bool) -> bool:
            if t[0] == "name":
                return t[1] == marker and not negated
            if t[0] == "not":
                return walk(t[1], not negated)
            return t[0] in ("and", "or") and (walk(t[1], negated) or walk(t[2], negated))
        return walk(self._tree, False)
