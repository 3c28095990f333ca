"""Per-parameter routing and dtype policy: ``{"defaults": {...}, "overrides": [...]}``.

[Note: name matching]

An override applies to a parameter when any of its ``name`` tokens matches the parameter's
fully-qualified name (FQN). A token matches *whole dotted components*, not substrings: the
token is split at dots and must equal a contiguous run of the FQN's components. So
``"q_proj"`` matches ``"model.layers.0.self_attn.q_proj.weight"`` and ``"layers.0.mlp"``
matches ``"model.layers.0.mlp.up_proj.weight"``, but ``"v_proj"`` does not match
``"...self_attn.qkv_proj.weight"`` and ``"head"`` does not match ``"lm_head.weight"``.

Why components: the seed's type-split example names modules (``q_proj`` … ``down_proj``,
``embed_tokens``, ``lm_head``), and substring matching would silently misroute common layouts
(``v_proj`` ⊂ ``qkv_proj``, ``up_proj`` ⊂ ``gate_up_proj``, ``head`` ⊂ ``lm_head``). Where a
pattern is wanted, say so: each dotted part is an ``fnmatch`` pattern (``"*proj"``,
``"layers.1?"``), so ``"*proj*"`` gives the substring behaviour explicitly. Matching is case
sensitive. :meth:`ParamPolicy.unmatched_tokens` lists tokens that match none of a model's
names, which catches typos that would otherwise be silent.

[Note: substring matching]

An override may select by ``"contains": [...]`` instead of ``"name"``: it applies when any
token is a plain, case-sensitive substring of the FQN (no patterns), the way recipes written
for earlier DMuon releases select parameters (``".bias"``, ``"ln_"``, ``"norm"``). Those
recipes keep their meaning unchanged, and the substring intent is visible in the policy
rather than hidden in a token's spelling. One override uses one form: ``name`` and
``contains`` together raise, because "both must match" and "either may match" are equally
plausible readings and a policy should never depend on which one the reader assumed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

from ._route import Route, normalize_dtype, parse_route
from ._split import MatrixSplit

__all__ = [
    "POLICY_FIELDS",
    "ParamPolicy",
    "ResolvedPolicy",
    "resolve_param_policy",
    "validate_param_policy",
]

_DTYPE_FIELDS = ("param_dtype", "grad_dtype", "master_dtype", "optim_dtype", "output_dtype")
POLICY_FIELDS: tuple[str, ...] = (
    "route",
    *_DTYPE_FIELDS,
    "cast_forward_inputs",
    "glu",
    "split",
)
# How a fused GLU expert stack (gate and up in one tensor) is orthogonalised: None reads the
# layout from the model (gate and up apart), "split" asks for that, "joint" orthogonalises
# each expert's fused matrix as one.
GLU_MODES = ("split", "joint")
_TOP_KEYS = ("defaults", "overrides")
_SELECTORS = ("name", "contains")
_OVERRIDE_KEYS = ("name", "set", "contains")


def _quoted(names: Iterable[str]) -> str:
    return ", ".join(repr(n) for n in names)


def _normalize_field(field_name: str, value: object, where: str) -> object:
    if field_name == "route":
        return parse_route(value, where)
    if field_name == "cast_forward_inputs":
        if not isinstance(value, bool):
            raise ValueError(f"{where}: must be True or False, got {value!r}")
        return value
    if field_name == "glu":
        if value is not None and value not in GLU_MODES:
            raise ValueError(
                f"{where}: glu must be 'split' (gate and up orthogonalised apart) or 'joint' "
                f"(each expert's fused matrix as one), got {value!r}"
            )
        return value
    if field_name == "split":
        return MatrixSplit.parse(value, where)
    return normalize_dtype(value, where)


@dataclass(frozen=True)
class ResolvedPolicy:
    """One parameter's route and dtypes. Dtypes are ``"bfloat16"``, ``"float16"``,
    ``"float32"`` or ``None`` (the runtime's default: the parameter's own dtype)."""

    route: Route = Route.MUON
    param_dtype: str | None = None
    grad_dtype: str | None = None
    master_dtype: str | None = None
    optim_dtype: str | None = None
    output_dtype: str | None = None
    # FSDP2's MixedPrecisionPolicy casts forward inputs by default too.
    cast_forward_inputs: bool = True
    # A fused GLU expert stack: see GLU_MODES.
    glu: str | None = None
    # A fused 2-D weight's pieces, orthogonalised apart: see [Note: declared splits] in _split.
    split: MatrixSplit | None = None

    def __post_init__(self) -> None:
        for name in POLICY_FIELDS:
            value = _normalize_field(name, getattr(self, name), f"ResolvedPolicy.{name}")
            object.__setattr__(self, name, value)


@dataclass(frozen=True)
class _Override:
    tokens: tuple[str, ...]
    values: tuple[tuple[str, Any], ...]
    # True: ``contains`` tokens (substrings of the FQN); False: ``name`` tokens (components).
    substring: bool = False

    def matches(self, name: str, components: Sequence[str]) -> bool:
        if self.substring:
            return any(token in name for token in self.tokens)
        return any(_token_matches(token, components) for token in self.tokens)


def _token_matches(token: str, components: Sequence[str]) -> bool:
    parts = token.split(".")
    span = len(parts)
    return any(
        all(fnmatchcase(components[start + i], part) for i, part in enumerate(parts))
        for start in range(len(components) - span + 1)
    )


def _parse_fields(raw: object, where: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where} must be a dict of fields ({_quoted(POLICY_FIELDS)}), got {type(raw).__name__}"
        )
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in POLICY_FIELDS:
            raise ValueError(
                f"{where}: unknown field {key!r}; allowed fields: {_quoted(POLICY_FIELDS)}"
            )
        out[key] = _normalize_field(key, value, f"{where}[{key!r}]")
    return out


class _Selector(NamedTuple):
    """What one override selector (``name`` or ``contains``) holds: the test a token passes, and
    the errors for a value that is no list of tokens and for a bad token."""

    valid: Callable[[str], bool]  # on a non-empty string
    not_a_list: Callable[[str, object], ValueError]  # (where, raw)
    bad_token: Callable[[str, object], ValueError]  # (where, token)


_NAME = _Selector(
    valid=lambda token: "" not in token.split("."),
    not_a_list=lambda where, raw: ValueError(
        f"{where} must be a non-empty list of module-name tokens such as ['q_proj'], got {raw!r}"
    ),
    bad_token=lambda where, token: ValueError(
        f"{where}: bad token {token!r}; a token is a non-empty dotted module name "
        "such as 'q_proj' or 'layers.0.mlp' (each part may be an fnmatch pattern)"
    ),
)
_CONTAINS = _Selector(
    valid=lambda token: True,
    not_a_list=lambda where, raw: ValueError(
        f"{where} must be a non-empty list of substrings of parameter names such as "
        f"['.bias', 'norm'], got {raw!r}"
    ),
    bad_token=lambda where, token: ValueError(
        f"{where}: bad token {token!r}; a 'contains' token is a non-empty string "
        "matched as a plain substring of the parameter name, such as '.bias'"
    ),
)


def _parse_tokens(raw: object, where: str, selector: _Selector) -> tuple[str, ...]:
    """A selector's tokens: one string, or a non-empty list of non-empty strings it accepts."""
    tokens = (raw,) if isinstance(raw, str) else raw
    if not isinstance(tokens, list | tuple) or not tokens:
        raise selector.not_a_list(where, raw)
    for token in tokens:
        if not isinstance(token, str) or not token or not selector.valid(token):
            raise selector.bad_token(where, token)
    return tuple(tokens)


def _parse_override(raw: object, where: str) -> _Override:
    if not isinstance(raw, Mapping):
        raise ValueError(
            f"{where} must be a dict {{'name': [...], 'set': {{...}}}}, got {type(raw).__name__}"
        )
    for key in raw:
        if key not in _OVERRIDE_KEYS:
            raise ValueError(
                f"{where}: unknown key {key!r}; allowed keys: {_quoted(_OVERRIDE_KEYS)}"
            )
    if all(key in raw for key in _SELECTORS):
        raise ValueError(
            f"{where}: has both 'name' and 'contains'; use one selector per override: 'name' "
            "for whole dotted components, 'contains' for plain substrings (split it into two "
            "overrides to select by both)"
        )
    if "set" not in raw or not any(key in raw for key in _SELECTORS):
        missing = "set" if "set" not in raw else "name"
        raise ValueError(
            f"{where}: missing key {missing!r}; an override needs 'name' and 'set' "
            "(or 'contains' and 'set' for substring matching)"
        )
    values = tuple(_parse_fields(raw["set"], f"{where}['set']").items())
    if "contains" in raw:
        return _Override(
            _parse_tokens(raw["contains"], f"{where}['contains']", _CONTAINS), values, True
        )
    return _Override(_parse_tokens(raw["name"], f"{where}['name']", _NAME), values)


@dataclass(frozen=True)
class ParamPolicy:
    """A validated policy; build it once with :meth:`from_dict` and resolve many names."""

    defaults: ResolvedPolicy = ResolvedPolicy()
    overrides: tuple[_Override, ...] = ()

    @classmethod
    def from_dict(cls, policy: Mapping[str, Any] | ParamPolicy | None) -> ParamPolicy:
        if policy is None:
            return cls()
        if isinstance(policy, ParamPolicy):
            return policy
        if not isinstance(policy, Mapping):
            raise ValueError(
                "param_policy must be a dict with keys 'defaults' and/or 'overrides' (or None), "
                f"got {type(policy).__name__}"
            )
        for key in policy:
            if key not in _TOP_KEYS:
                raise ValueError(
                    f"param_policy: unknown key {key!r}; allowed keys: {_quoted(_TOP_KEYS)}"
                )
        defaults = ResolvedPolicy(
            **_parse_fields(policy.get("defaults", {}), "param_policy['defaults']")
        )
        raw_overrides = policy.get("overrides", [])
        if not isinstance(raw_overrides, list | tuple):
            raise ValueError(
                "param_policy['overrides'] must be a list of {'name': [...], 'set': {...}} "
                f"dicts, got {type(raw_overrides).__name__}"
            )
        overrides = tuple(
            _parse_override(raw, f"param_policy['overrides'][{index}]")
            for index, raw in enumerate(raw_overrides)
        )
        return cls(defaults, overrides)

    def matching(self, name: str, aliases: Iterable[str] = ()) -> tuple[int, ...]:
        """The indices (into ``param_policy['overrides']``) of the overrides that apply to
        parameter ``name``, in policy order: the ones :meth:`resolve` applies. ``aliases``
        are the parameter's other names (a tied embedding and head): an override that matches
        any of them applies, as the predicate of ``dedicate_params`` accepts any of them."""
        names = [(n, n.split(".")) for n in dict.fromkeys((name, *aliases))]
        return tuple(
            index
            for index, override in enumerate(self.overrides)
            if any(override.matches(n, components) for n, components in names)
        )

    def resolve(self, name: str, aliases: Iterable[str] = ()) -> ResolvedPolicy:
        """The defaults, then every override that matches ``name`` or one of its ``aliases``,
        in policy order (each sets only its fields). Two overrides that set one field to
        different values through different names of the parameter raise ``ValueError`` (see
        [Note: one policy per tied parameter])."""
        names = list(dict.fromkeys((name, *aliases)))
        fields: dict[str, Any] = {}
        # Per field, the overrides whose value still stands: a later one that matches every
        # name an earlier one matched replaces it (policy order).
        setters: dict[str, list[tuple[int, set[str], Any]]] = {}
        for index in self.matching(name, aliases):
            override = self.overrides[index]
            by = {n for n in names if override.matches(n, n.split("."))}
            for field, value in override.values:
                standing = [s for s in setters.get(field, ()) if not s[1] <= by]
                setters[field] = [*standing, (index, by, value)]
            fields.update(override.values)
        for field, standing in setters.items():
            for later_index, later in enumerate(standing):
                for earlier in standing[:later_index]:
                    _check_one_intent(field, earlier, later)
        return dataclasses.replace(self.defaults, **fields) if fields else self.defaults

    def unmatched_tokens(
        self, names: Iterable[str], *, selector: str | None = None
    ) -> tuple[str, ...]:
        """Override tokens (``name`` and ``contains``) that match none of ``names`` (likely
        typos), in policy order; ``selector`` (``"name"`` or ``"contains"``) keeps the tokens
        of that selector's overrides only, which match by different rules (whole dotted
        components; plain substrings) and so want different advice."""
        if selector not in (None, *_SELECTORS):
            raise ValueError(
                f"unmatched_tokens: selector must be None, 'name' or 'contains', not {selector!r}"
            )
        split = [(name, name.split(".")) for name in names]
        out: list[str] = []
        for override in self.overrides:
            if selector is not None and override.substring != (selector == "contains"):
                continue
            for token in override.tokens:
                single = dataclasses.replace(override, tokens=(token,))
                if token not in out and not any(single.matches(n, c) for n, c in split):
                    out.append(token)
        return tuple(out)


def _shown(value: Any) -> Any:
    """A field's value as a policy spells it (a route by its name)."""
    return value.value if isinstance(value, Route) else value


def _check_one_intent(
    field: str, earlier: tuple[int, set[str], Any], later: tuple[int, set[str], Any]
) -> None:
    """Raise when two overrides set ``field`` of one parameter differently, each through a
    name of it that the other does not match.

    [Note: one policy per tied parameter]
    A tied parameter (an embedding and a head sharing one weight) has one route and one set
    of dtypes, whichever of its names an override matches. Two overrides of one name that
    disagree are the policy's usual order (the later one wins, as a specific rule after a
    general one), and so is a general override that matches every name before a specific
    one. But ``lm_head`` routed one way and ``embed_tokens`` another names two intents for
    one tensor: which wins would depend on the order the overrides happen to be listed in,
    so it raises, naming both. Only the values that still stand count: a later override
    that matches every name an earlier one matched (the same name again, or a general one)
    replaces its value before the two are compared."""
    (i, by_i, value_i), (j, by_j, value_j) = earlier, later
    if value_i == value_j or by_i <= by_j or by_j <= by_i:
        return
    raise ValueError(
        f"param_policy['overrides'][{i}] sets {field}={_shown(value_i)!r} for "
        f"{_quoted(sorted(by_i - by_j))} and param_policy['overrides'][{j}] sets "
        f"{field}={_shown(value_j)!r} for {_quoted(sorted(by_j - by_i))}, which are names of "
        f"one tied parameter: it takes one {field}. Set {field} in one of the two overrides "
        f"only, or the same {field} in both"
    )


def validate_param_policy(policy: Mapping[str, Any] | ParamPolicy | None) -> ParamPolicy:
    """Check a policy once up front; returns the parsed :class:`ParamPolicy`.

    Raises ``ValueError`` naming the offending key or value and the allowed ones.
    """
    return ParamPolicy.from_dict(policy)


def resolve_param_policy(
    name: str, policy: Mapping[str, Any] | ParamPolicy | None
) -> ResolvedPolicy:
    """Route and dtypes of parameter ``name`` (its FQN) under ``policy``.

    ``None`` gives the default: route ``"muon"``, no dtype changes. For many names, parse once
    with :func:`validate_param_policy` and pass the :class:`ParamPolicy`.
    """
    return ParamPolicy.from_dict(policy).resolve(name)
