"""Check a value against the type a function declares for it, at run time: the keys of each
``TypedDict`` (every required one, no other), and the value of each key, item of each list and
entry of each dict.

    from dmuon_testing.typed_dicts import check_returns

    check_returns(get_backend_status, get_backend_status("cpu"))

A type checker trusts the declared return type; this checks that the function keeps to it
(mypy sees only the dict literals the function builds, not the values it copies into them).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import (
    Any,
    NotRequired,
    Required,
    Union,
    get_args,
    get_origin,
    get_type_hints,
    is_typeddict,
)

__all__ = ["check_returns", "check_typed"]


def check_returns(function: Callable[..., Any], value: object) -> None:
    """Raise ``AssertionError`` unless ``value`` is of ``function``'s declared return type,
    and that type declares every part of it (no ``Any``: a type checker sees nothing there)."""
    hint = get_type_hints(function)["return"]
    check_typed(value, hint, f"{function.__name__}()", allow_any=False)


def check_typed(value: object, hint: Any, where: str = "value", *, allow_any: bool = True) -> None:
    """Raise ``AssertionError``, naming the path to the first mismatch, unless ``value`` is of
    ``hint``: a ``TypedDict``, ``list[T]``, ``dict[K, V]``, a union (``T | None``), ``Any``
    (unless ``allow_any`` is false), or a plain class (``int`` excludes ``bool``; ``float``
    takes an ``int``, as in typing)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        assert allow_any, f"{where}: declared Any ({value!r}), which a type checker cannot see into"
        return
    if origin in (Union, types.UnionType):
        failures = []
        for option in args:
            try:
                check_typed(value, option, where, allow_any=allow_any)
                return
            except AssertionError as err:
                failures.append(str(err))
        raise AssertionError(f"{where}: {value!r} is none of {hint}: {'; '.join(failures)}")
    if is_typeddict(hint):
        assert isinstance(value, dict), f"{where}: {type(value).__name__}, not a {hint.__name__}"
        hints = get_type_hints(hint, include_extras=True)
        marked = sorted(k for k, h in hints.items() if get_origin(h) in (Required, NotRequired))
        # Python 3.11 does not see them under ``from __future__ import annotations``.
        assert not marked, (
            f"{hint.__name__} marks {marked} Required/NotRequired: declare the keys only some"
            " dicts hold in a total=False subclass instead"
        )
        missing = sorted(hint.__required_keys__ - value.keys())
        unknown = sorted(value.keys() - hints.keys())
        assert not missing, f"{where}: {hint.__name__} keys missing: {missing}"
        assert not unknown, f"{where}: keys {hint.__name__} does not declare: {unknown}"
        for key, item in value.items():
            check_typed(item, hints[key], f"{where}[{key!r}]", allow_any=allow_any)
        return
    if origin is list:
        assert isinstance(value, list), f"{where}: {type(value).__name__}, not a list"
        for index, item in enumerate(value):
            check_typed(item, args[0], f"{where}[{index}]", allow_any=allow_any)
        return
    if origin is dict:
        assert isinstance(value, dict), f"{where}: {type(value).__name__}, not a dict"
        for key, item in value.items():
            check_typed(key, args[0], f"{where} key {key!r}", allow_any=allow_any)
            check_typed(item, args[1], f"{where}[{key!r}]", allow_any=allow_any)
        return
    assert origin is None and isinstance(hint, type), f"{where}: no check for {hint!r}"
    if hint is type(None):
        assert value is None, f"{where}: {value!r}, not None"
    elif hint is float:
        ok = isinstance(value, float | int) and not isinstance(value, bool)
        assert ok, f"{where}: {value!r}, not a float"
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        assert ok, f"{where}: {value!r}, not an int"
    else:
        assert isinstance(value, hint), f"{where}: {value!r}, not a {hint.__name__}"
