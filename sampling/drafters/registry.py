"""The registry of drafter kinds: which kind builds the drafter of a speculative call, and which
of a call's keywords are that kind's options.

A kind claims the drafters it takes (`DrafterKind.takes`, `sampling/loop/options.py`); claims are
disjoint, so the order of registration never matters: a drafter no kind claims, or that two kinds
claim, is a `TypeError` naming them. Every kind registers here the same way, the library's own
(`sampling/drafters/drafter_kinds.py` imports their files) and those of packages above `sampling/`
(NASD's pools: `ngram_assisted/nasd.py`). A public function's keywords that are not shared options
(`DecodingOptions`) go to the kind as its `Options` dataclass, whole: one a kind does not take is
refused by name where it asks for something, before any model runs.
"""

from __future__ import annotations

from dataclasses import fields

from sampling.loop.options import DrafterKind

KINDS: list[DrafterKind] = []


def register_kind(kind: DrafterKind) -> DrafterKind:
    """Add `kind` to the registry (once: a kind of the same class is replaced)."""
    KINDS[:] = [k for k in KINDS if type(k) is not type(kind)] + [kind]
    return kind


def option_names(kind: DrafterKind) -> set[str]:
    return {f.name for f in fields(kind.Options)}


def drafter_kind(drafter: object, given: dict[str, object] | None = None, name: str = "drafter") -> DrafterKind:
    """The one kind that claims `drafter` (with the kind keywords `given`), or a TypeError."""
    claimants = [kind for kind in KINDS if kind.takes(drafter, given or {})]
    if len(claimants) > 1:
        raise TypeError(f"{name}: the drafter kinds {', '.join(type(k).__name__ for k in claimants)} all claim a "
                        f"{type(drafter).__name__}; each kind must claim drafters no other kind takes")
    if not claimants:
        what = " or ".join(sorted({kind.what for kind in KINDS}))
        raise TypeError(f"{name} must be {what}; got a {type(drafter).__name__}, which no drafter kind takes")
    return claimants[0]


def asks(name: str, value: object) -> bool:
    """Whether a keyword some kind takes asks for something: its value is not that option's default
    (a public signature passes every option it lists, asked for or not)."""
    defaults = [f.default for kind in KINDS for f in fields(kind.Options) if f.name == name]
    simple = (bool, int, float, str)
    return not any(value is default or (isinstance(default, simple) and type(value) is type(default) and value == default)
                   for default in defaults)


def kind_options(kind: DrafterKind, keywords: dict[str, object], function: str):
    """A call's kind `keywords` (those its signature lists, asked for or not, and its `**kind_options`)
    -> the kind's `Options`, built from every keyword it takes (validated as it is built). A keyword
    it does not take is refused by name where it asks for something (`asks`): a TypeError when no kind
    takes it, a ValueError saying why when another does."""
    own = option_names(kind)
    for name, value in keywords.items():
        if name in own:
            continue
        takers = [k.what for k in KINDS if name in option_names(k)]
        if not takers:
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}: no drafter kind takes it "
                            f"(the shared options and each kind's Options list what a call takes)")
        if not asks(name, value):
            continue
        reason = getattr(kind, "refusals", {}).get(name, f"it is an option for {' or '.join(dict.fromkeys(takers))}")
        raise ValueError(f"{name}={value!r} is not taken with {kind.what} as the drafter: {reason}; "
                         f"leave {name} out")
    return kind.Options(**{name: value for name, value in keywords.items() if name in own})
