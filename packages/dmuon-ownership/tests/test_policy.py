"""Routing policy: the seed's type-split example, matching rules, and every error message."""

import pytest

from dmuon_ownership import (
    POLICY_FIELDS,
    ParamPolicy,
    ResolvedPolicy,
    Route,
    resolve_param_policy,
    validate_param_policy,
)


class FakeDtype:
    """Stands in for a torch dtype: this package never imports torch."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


BF16 = FakeDtype("bfloat16")

MATRICES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# The type-split routing recipe (projections on Muon, embeddings and head sharded, the rest on
# AdamW, all in bf16), with torch.bfloat16 duck-typed.
TYPE_SPLIT = {
    "defaults": {"route": "adamw", "param_dtype": BF16},
    "overrides": [
        {"name": MATRICES, "set": {"route": "muon"}},
        {"name": ["embed_tokens", "lm_head"], "set": {"route": "sharded_adamw"}},
    ],
}

LLAMA_NAMES = [
    "model.embed_tokens.weight",
    *(f"model.layers.0.self_attn.{m}.weight" for m in MATRICES[:4]),
    *(f"model.layers.0.mlp.{m}.weight" for m in MATRICES[4:]),
    "model.layers.0.input_layernorm.weight",
    "model.layers.0.post_attention_layernorm.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def test_seed_type_split_routing() -> None:
    policy = validate_param_policy(TYPE_SPLIT)
    for name in LLAMA_NAMES:
        resolved = resolve_param_policy(name, TYPE_SPLIT)
        assert resolved == policy.resolve(name)
        # Overrides only set the route: every parameter keeps the default bf16 param dtype.
        assert resolved.param_dtype == "bfloat16"
        assert resolved.grad_dtype is None and resolved.cast_forward_inputs is True
        component = name.split(".")[-2]
        if component in MATRICES:
            assert resolved.route is Route.MUON, name
        elif component in ("embed_tokens", "lm_head"):
            assert resolved.route is Route.SHARDED_ADAMW, name
        else:
            assert resolved.route is Route.ADAMW, name
    assert policy.unmatched_tokens(LLAMA_NAMES) == ()
    assert [policy.matching(name) for name in LLAMA_NAMES] == [
        (1,),
        *[(0,)] * len(MATRICES),
        (),
        (),
        (),
        (1,),
    ]
    assert validate_param_policy(None).matching("lm_head.weight") == ()


def test_default_is_muon_with_no_dtype_changes() -> None:
    assert resolve_param_policy("any.weight", None) == ResolvedPolicy()
    assert resolve_param_policy("any.weight", {}).route is Route.MUON
    assert ResolvedPolicy().route == "muon"
    assert POLICY_FIELDS[0] == "route" and len(POLICY_FIELDS) == 9


def test_overrides_apply_in_order_and_set_only_their_fields() -> None:
    policy = {
        "defaults": {"grad_dtype": "fp32", "output_dtype": "bf16"},
        "overrides": [
            {"name": ["layers"], "set": {"route": "adamw", "param_dtype": "float16"}},
            {
                "name": ["layers.1"],
                "set": {"param_dtype": "bfloat16", "cast_forward_inputs": False},
            },
            {"name": "norm", "set": {"route": "sharded_adamw", "optim_dtype": None}},
        ],
    }
    assert resolve_param_policy("layers.0.norm.weight", policy) == ResolvedPolicy(
        route=Route.SHARDED_ADAMW,
        param_dtype="float16",
        grad_dtype="float32",
        output_dtype="bfloat16",
    )
    assert resolve_param_policy("layers.1.attn.weight", policy) == ResolvedPolicy(
        route="adamw",  # type: ignore[arg-type]
        param_dtype="bfloat16",
        grad_dtype="float32",
        output_dtype="bfloat16",
        cast_forward_inputs=False,
    )
    # "layers.1" is a dotted run of components: it does not match layers.10.
    assert resolve_param_policy("layers.10.attn.weight", policy).param_dtype == "float16"


def test_tokens_match_whole_components_or_explicit_patterns() -> None:
    def route(name: str, token: str) -> Route:
        return resolve_param_policy(
            name,
            {
                "defaults": {"route": "adamw"},
                "overrides": [{"name": [token], "set": {"route": "muon"}}],
            },
        ).route

    assert route("model.layers.0.self_attn.q_proj.weight", "q_proj") is Route.MUON
    assert route("model.layers.0.self_attn.qkv_proj.weight", "v_proj") is Route.ADAMW
    assert route("model.layers.0.mlp.gate_up_proj.weight", "up_proj") is Route.ADAMW
    assert route("lm_head.weight", "head") is Route.ADAMW
    assert route("model.layers.0.self_attn.qkv_proj.weight", "*proj") is Route.MUON
    assert route("model.layers.0.mlp.gate_up_proj.weight", "*up_proj*") is Route.MUON
    assert route("model.layers.0.mlp.up.weight", "layers.?.mlp") is Route.MUON
    assert route("model.layers.0.mlp.up.weight", "mlp.layers") is Route.ADAMW
    assert route("Model.Q_PROJ.weight", "q_proj") is Route.ADAMW  # case sensitive
    policy = ParamPolicy.from_dict(
        {"overrides": [{"name": ["q_proj", "qproj", "layers.0"], "set": {"route": "adamw"}}]}
    )
    assert policy.unmatched_tokens(["a.layers.0.q_proj.weight"]) == ("qproj",)
    assert ParamPolicy.from_dict(policy) is policy


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            [],
            r"param_policy must be a dict with keys 'defaults' and/or 'overrides' \(or None\), got list",
        ),
        (
            {"override": []},
            r"param_policy: unknown key 'override'; allowed keys: 'defaults', 'overrides'",
        ),
        (
            {"defaults": {"rout": "muon"}},
            r"param_policy\['defaults'\]: unknown field 'rout'; allowed fields: 'route', 'param_dtype', ",
        ),
        (
            {"defaults": ["route"]},
            r"param_policy\['defaults'\] must be a dict of fields \('route', ",
        ),
        (
            {"defaults": {"route": "sgd"}},
            r"param_policy\['defaults'\]\['route'\]: unknown route 'sgd'; use one of 'muon', 'adamw', 'sharded_adamw'",
        ),
        ({"defaults": {"route": None}}, r"\['route'\]: unknown route None; use one of"),
        (
            {"defaults": {"param_dtype": "int8"}},
            r"param_policy\['defaults'\]\['param_dtype'\]: unsupported dtype 'int8'; use torch.bfloat16 / torch.float16 / torch.float32, one of the names 'bfloat16', 'bf16'",
        ),
        (
            {"defaults": {"grad_dtype": FakeDtype("float64")}},
            r"\['grad_dtype'\]: unsupported dtype <.*FakeDtype",
        ),
        (
            {"defaults": {"master_dtype": float}},
            r"\['master_dtype'\]: unsupported dtype <class 'float'>",
        ),
        (
            {"defaults": {"cast_forward_inputs": "yes"}},
            r"param_policy\['defaults'\]\['cast_forward_inputs'\]: must be True or False, got 'yes'",
        ),
        (
            {"overrides": {"name": ["x"]}},
            r"param_policy\['overrides'\] must be a list of \{'name': \[...\], 'set': \{...\}\} dicts, got dict",
        ),
        (
            {"overrides": ["x"]},
            r"param_policy\['overrides'\]\[0\] must be a dict \{'name': \[...\], 'set': \{...\}\}, got str",
        ),
        (
            {"overrides": [{"name": ["x"], "set": {}, "when": 1}]},
            r"param_policy\['overrides'\]\[0\]: unknown key 'when'; allowed keys: 'name', 'set'",
        ),
        (
            {"overrides": [{"name": ["x"]}]},
            r"param_policy\['overrides'\]\[0\]: missing key 'set'; an override needs 'name' and 'set'",
        ),
        (
            {"overrides": [{"name": [], "set": {}}]},
            r"param_policy\['overrides'\]\[0\]\['name'\] must be a non-empty list of module-name tokens",
        ),
        (
            {"overrides": [{"name": ["a..b"], "set": {}}]},
            r"\['name'\]: bad token 'a..b'; a token is a non-empty dotted module name",
        ),
        ({"overrides": [{"name": [3], "set": {}}]}, r"\['name'\]: bad token 3"),
        (
            {
                "overrides": [
                    {"name": ["x"], "set": {"route": "muon"}},
                    {"name": ["y"], "set": {"dtype": "bf16"}},
                ]
            },
            r"param_policy\['overrides'\]\[1\]\['set'\]: unknown field 'dtype'; allowed fields: 'route', ",
        ),
        (
            {"overrides": [{"name": ["x"], "set": {"optim_dtype": "fp8"}}]},
            r"param_policy\['overrides'\]\[0\]\['set'\]\['optim_dtype'\]: unsupported dtype 'fp8'",
        ),
    ],
)
def test_policy_errors(policy: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_param_policy(policy)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        resolve_param_policy("x.weight", policy)  # type: ignore[arg-type]


def test_resolved_policy_validates_its_fields() -> None:
    assert ResolvedPolicy(param_dtype=BF16).param_dtype == "bfloat16"  # type: ignore[arg-type]
    assert ResolvedPolicy(grad_dtype="HALF").grad_dtype == "float16"
    with pytest.raises(ValueError, match=r"ResolvedPolicy.route: unknown route 'x'"):
        ResolvedPolicy(route="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ResolvedPolicy.output_dtype: unsupported dtype 'int4'"):
        ResolvedPolicy(output_dtype="int4")


def test_contains_tokens_match_plain_substrings() -> None:
    def route(name: str, token: str) -> Route:
        return resolve_param_policy(
            name,
            {
                "defaults": {"route": "adamw"},
                "overrides": [{"contains": [token], "set": {"route": "muon"}}],
            },
        ).route

    # Substrings cross component boundaries, unlike `name` tokens ("v_proj" vs qkv_proj).
    assert route("model.layers.0.self_attn.qkv_proj.weight", "v_proj") is Route.MUON
    assert route("lm_head.weight", "head") is Route.MUON
    assert route("model.layers.0.mlp.up_proj.bias", ".bias") is Route.MUON
    assert route("model.layers.0.mlp.up_proj.weight", ".bias") is Route.ADAMW
    assert route("h.0.ln_1.weight", "ln_") is Route.MUON
    assert route("h.0.ln1.weight", "ln_") is Route.ADAMW
    # No pattern syntax: "*" and "?" are literal characters.
    assert route("model.layers.0.q_proj.weight", "*proj") is Route.ADAMW
    assert route("Model.Norm.weight", "norm") is Route.ADAMW  # case sensitive
    # A single string is one token, as for `name`.
    single = {"overrides": [{"contains": "norm", "set": {"route": "adamw"}}]}
    assert resolve_param_policy("model.norm.weight", single).route is Route.ADAMW
    assert resolve_param_policy("model.embed.weight", single).route is Route.MUON


def test_name_and_contains_overrides_mix_in_order() -> None:
    policy = validate_param_policy(
        {
            "defaults": {"route": "muon"},
            "overrides": [
                {"contains": ["norm"], "set": {"route": "adamw", "param_dtype": "fp32"}},
                {"name": ["layers.0"], "set": {"param_dtype": "bf16"}},
            ],
        }
    )
    # Both overrides match: the later one sets param_dtype last, the route stays from the first.
    assert policy.resolve("model.layers.0.input_layernorm.weight") == ResolvedPolicy(
        route=Route.ADAMW, param_dtype="bfloat16"
    )
    assert policy.resolve("model.layers.1.input_layernorm.weight") == ResolvedPolicy(
        route=Route.ADAMW, param_dtype="float32"
    )
    assert policy.resolve("model.layers.0.mlp.up_proj.weight") == ResolvedPolicy(
        param_dtype="bfloat16"
    )
    names = ["model.layers.0.input_layernorm.weight", "model.layers.0.mlp.up_proj.weight"]
    assert policy.unmatched_tokens(names) == ()
    # matching() names the overrides resolve() applied, in order.
    assert policy.matching("model.layers.0.input_layernorm.weight") == (0, 1)
    assert policy.matching("model.layers.1.input_layernorm.weight") == (0,)
    assert policy.matching("model.layers.0.mlp.up_proj.weight") == (1,)
    assert policy.matching("model.layers.1.mlp.up_proj.weight") == ()
    typo = validate_param_policy({"overrides": [{"contains": ["nrom", "norm"], "set": {}}]})
    assert typo.unmatched_tokens(names) == ("nrom",)


# A recipe in the style of the first public DMuon release: GPT-2-like names, substring tokens.
REFERENCE_RECIPE = {
    "defaults": {"route": "muon"},
    "overrides": [
        {"contains": [".bias", "ln_", "norm"], "set": {"route": "adamw"}},
        {"contains": ["wte", "wpe", "lm_head"], "set": {"route": "sharded_adamw"}},
    ],
}

GPT2_NAMES = {
    "transformer.wte.weight": Route.SHARDED_ADAMW,
    "transformer.wpe.weight": Route.SHARDED_ADAMW,
    "transformer.h.0.ln_1.weight": Route.ADAMW,
    "transformer.h.0.ln_1.bias": Route.ADAMW,
    "transformer.h.0.attn.c_attn.weight": Route.MUON,
    "transformer.h.0.attn.c_attn.bias": Route.ADAMW,
    "transformer.h.0.attn.c_proj.weight": Route.MUON,
    "transformer.h.0.ln_2.weight": Route.ADAMW,
    "transformer.h.0.mlp.c_fc.weight": Route.MUON,
    "transformer.h.0.mlp.c_fc.bias": Route.ADAMW,
    "transformer.h.0.mlp.c_proj.weight": Route.MUON,
    "transformer.h.0.mlp.c_proj.bias": Route.ADAMW,
    "transformer.ln_f.weight": Route.ADAMW,
    "transformer.final_norm.weight": Route.ADAMW,
    "lm_head.weight": Route.SHARDED_ADAMW,
}


def test_reference_style_recipe_routes_norms_biases_and_embeddings() -> None:
    policy = validate_param_policy(REFERENCE_RECIPE)
    for name, expected in GPT2_NAMES.items():
        assert policy.resolve(name).route is expected, name
    # The same tokens as `name` tokens mean something else: ".bias" is not a dotted module
    # name, and "ln_" / "norm" are not whole components, so they would route nothing.
    with pytest.raises(ValueError, match=r"\['name'\]: bad token '.bias'"):
        validate_param_policy({"overrides": [{"name": [".bias"], "set": {"route": "adamw"}}]})
    as_names = validate_param_policy(
        {"overrides": [{"name": ["bias", "ln_", "norm"], "set": {"route": "adamw"}}]}
    )
    assert as_names.unmatched_tokens(GPT2_NAMES) == ("ln_", "norm")
    # One token missed by each selector's rule: selector says which rule missed which.
    mixed = validate_param_policy(
        {
            "overrides": [
                {"contains": ["ln_", "nrom"], "set": {"route": "adamw"}},
                {"name": ["ln_", "wte"], "set": {"route": "sharded_adamw"}},
            ]
        }
    )
    assert mixed.unmatched_tokens(GPT2_NAMES) == ("nrom", "ln_")
    assert mixed.unmatched_tokens(GPT2_NAMES, selector="contains") == ("nrom",)
    assert mixed.unmatched_tokens(GPT2_NAMES, selector="name") == ("ln_",)
    with pytest.raises(ValueError, match="selector must be None, 'name' or 'contains'"):
        mixed.unmatched_tokens(GPT2_NAMES, selector="names")
    assert as_names.resolve("transformer.h.0.ln_1.weight").route is Route.MUON


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            {"name": ["q_proj"], "contains": ["norm"], "set": {"route": "adamw"}},
            r"param_policy\['overrides'\]\[0\]: has both 'name' and 'contains'; use one selector "
            r"per override: 'name' for whole dotted components, 'contains' for plain substrings "
            r"\(split it into two overrides to select by both\)",
        ),
        (
            {"set": {"route": "adamw"}},
            r"param_policy\['overrides'\]\[0\]: missing key 'name'; an override needs 'name' and "
            r"'set' \(or 'contains' and 'set' for substring matching\)",
        ),
        (
            {"contains": ["norm"]},
            r"param_policy\['overrides'\]\[0\]: missing key 'set'; an override needs 'name' and 'set'",
        ),
        (
            {"contains": [], "set": {}},
            r"param_policy\['overrides'\]\[0\]\['contains'\] must be a non-empty list of "
            r"substrings of parameter names such as \['.bias', 'norm'\], got \[\]",
        ),
        (
            {"contains": ["norm", ""], "set": {}},
            r"param_policy\['overrides'\]\[0\]\['contains'\]: bad token ''; a 'contains' token is "
            r"a non-empty string matched as a plain substring",
        ),
        ({"contains": [None], "set": {}}, r"\['contains'\]: bad token None"),
        (
            {"contains": ["norm"], "set": {"route": "sgd"}},
            r"param_policy\['overrides'\]\[0\]\['set'\]\['route'\]: unknown route 'sgd'",
        ),
        (
            {"contains": ["norm"], "set": {}, "where": 1},
            r"unknown key 'where'; allowed keys: 'name', 'set', 'contains'",
        ),
    ],
)
def test_contains_errors(override: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_param_policy({"overrides": [override]})


def test_glu_mode_of_fused_expert_stacks() -> None:
    policy = {"overrides": [{"name": ["gate_up_proj"], "set": {"glu": "joint"}}]}
    assert resolve_param_policy("layers.0.mlp.experts.gate_up_proj", policy).glu == "joint"
    assert resolve_param_policy("layers.0.mlp.experts.down_proj", policy).glu is None
    with pytest.raises(ValueError, match="glu must be 'split'"):
        resolve_param_policy("x", {"defaults": {"glu": "fused"}})


def test_a_parameter_with_several_names_matches_by_any_of_them() -> None:
    # A tied embedding and head: named_parameters() names it embed_tokens.weight only, but an
    # override naming lm_head must route it, as dedicate_params' predicate sees both names.
    policy = ParamPolicy.from_dict(
        {
            "defaults": {"route": "muon"},
            "overrides": [
                {"name": ["lm_head"], "set": {"route": "sharded_adamw"}},
                {"name": ["embed_tokens"], "set": {"optim_dtype": "fp32"}},
            ],
        }
    )
    assert policy.resolve("embed_tokens.weight").route is Route.MUON
    tied = policy.resolve("embed_tokens.weight", ["embed_tokens.weight", "lm_head.weight"])
    assert tied.route is Route.SHARDED_ADAMW and tied.optim_dtype == "float32"
    assert policy.matching("embed_tokens.weight", ["lm_head.weight"]) == (0, 1)


def test_a_tied_parameter_routed_two_ways_by_its_names_raises() -> None:
    # Two overrides that set one field differently through different names of one tied
    # parameter: which wins would hang on their order (it went silently to the last one).
    names = ["embed_tokens.weight", "lm_head.weight"]
    policy = ParamPolicy.from_dict(
        {
            "overrides": [
                {"name": ["lm_head"], "set": {"route": "sharded_adamw"}},
                {"name": ["embed_tokens"], "set": {"route": "muon", "optim_dtype": "fp32"}},
            ]
        }
    )
    with pytest.raises(ValueError) as info:
        policy.resolve(names[0], names)
    assert str(info.value) == (
        "param_policy['overrides'][0] sets route='sharded_adamw' for 'lm_head.weight' and"
        " param_policy['overrides'][1] sets route='muon' for 'embed_tokens.weight', which are"
        " names of one tied parameter: it takes one route. Set route in one of the two"
        " overrides only, or the same route in both"
    )
    # The same value by both names, a general override before a specific one, or one name of
    # the two: one intent, resolved in policy order.
    for overrides in (
        [{"name": ["lm_head"], "set": {"route": "adamw"}}] * 2,
        [
            {"name": ["*"], "set": {"route": "muon"}},
            {"name": ["lm_head"], "set": {"route": "adamw"}},
        ],
        [
            {"name": ["lm_head"], "set": {"route": "muon"}},
            {"name": ["lm_head"], "set": {"route": "adamw"}},
        ],
        # Two names that disagree until a later override of one of them (or a general one
        # after both) replaces its value: what is left is one intent, whatever the order.
        [
            {"name": ["embed_tokens"], "set": {"route": "muon"}},
            {"name": ["lm_head"], "set": {"route": "adamw"}},
            {"name": ["embed_tokens"], "set": {"route": "adamw"}},
        ],
        [
            {"name": ["lm_head"], "set": {"route": "sharded_adamw"}},
            {"name": ["embed_tokens"], "set": {"route": "muon"}},
            {"name": ["*"], "set": {"route": "adamw"}},
        ],
    ):
        assert (
            ParamPolicy.from_dict({"overrides": overrides}).resolve(names[0], names).route
            is Route.ADAMW
        )
