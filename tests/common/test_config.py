"""The strict config base: overrides parse as TOML values, errors name file and dotted field, TOML round-trips."""

from typing import Annotated, Literal

import pydantic
import pytest

from common.config import Config, ConfigError, load_toml_config, parse_overrides, to_toml, validate_config


class Inner(Config):
    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = [0.9, 0.95]
    """Adam betas."""


class A(Config):
    type: Literal["a"] = "a"
    group_size: int = pydantic.Field(4, ge=2)
    """Samples per prompt."""


class B(Config):
    type: Literal["b"] = "b"
    gamma: float = 1.0
    """Discount."""


class Root(Config):
    name: str = "x"
    """Run name."""
    inner: Inner = Inner()
    algo: Annotated[A | B, pydantic.Field(discriminator="type")] = A()
    """Algorithm."""


def test_overrides_parse_toml_values_and_bare_strings():
    got = parse_overrides(["--inner.lr", "1e-6", "--name=run one", "--inner.betas", "[0.8, 0.9]", "--flag", "true"])
    assert got == {"inner.lr": 1e-6, "name": "run one", "inner.betas": [0.8, 0.9], "flag": True}


def test_a_number_or_boolean_typed_on_the_command_line_for_a_text_field_is_that_text(tmp_path):
    # "--run.name 123" and "--run.name true" were refused: read as TOML values, and text fields are strict.
    f = tmp_path / "r.toml"
    f.write_text("[inner]\nlr = 0.1\n")
    cfg = load_toml_config(Root, f, parse_overrides(["--name", "123", "--inner.lr", "1e-6"]))
    assert (cfg.name, cfg.inner.lr) == ("123", 1e-6)
    assert load_toml_config(Root, f, parse_overrides(["--name=1e3"])).name == "1e3"  # as typed, not "1000.0"
    assert load_toml_config(Root, f, parse_overrides(["--name", "true"])).name == "true"
    f.write_text("name = true\n")  # in a file, the quotes say what is text: a boolean or number there is refused
    with pytest.raises(ConfigError, match="- name: Input should be a valid string"):
        load_toml_config(Root, f)
    f.write_text("name = 123\n")  # in a file, the quotes say what is text: a number there is still refused
    with pytest.raises(ConfigError, match="- name: Input should be a valid string"):
        load_toml_config(Root, f)


def test_override_without_value_is_an_error():
    with pytest.raises(ConfigError, match="missing value"):
        parse_overrides(["--inner.lr"])


def test_load_applies_overrides(tmp_path):
    f = tmp_path / "r.toml"
    f.write_text('name = "r"\n[inner]\nlr = 0.1\n')
    cfg = load_toml_config(Root, f, parse_overrides(["--inner.lr", "0.5"]))
    assert cfg.inner.lr == 0.5 and cfg.name == "r"


@pytest.mark.parametrize(
    "text, field, reason",
    [
        ("[inner]\nlrr = 0.1\n", "inner.lrr", "unknown key"),
        ('[inner]\nlr = "fast"\n', "inner.lr", "valid number"),
        ('[algo]\ntype = "a"\ngroup_size = 1\n', "algo.group_size", "greater than or equal to 2"),
        ('[algo]\ntype = "c"\n', "algo", "'a', 'b'"),
    ],
)
def test_errors_name_file_field_and_reason(tmp_path, text, field, reason):
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_toml_config(Root, f)
    msg = str(e.value)
    assert str(f) in msg and f"- {field}:" in msg and reason in msg, msg


def test_strict_types_reject_strings_for_numbers():
    with pytest.raises(ConfigError, match="inner.lr"):
        validate_config(Root, {"inner": {"lr": "0.1"}})


def test_missing_file_and_bad_toml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_toml_config(Root, tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[inner\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml_config(Root, bad)


def test_to_toml_round_trips(tmp_path):
    cfg = validate_config(Root, {"algo": {"type": "b", "gamma": 0.5}, "inner": {"lr": 2.0}})
    f = tmp_path / "resolved.toml"
    f.write_text(to_toml(cfg))
    assert load_toml_config(Root, f) == cfg


class WithCheck(A):
    @pydantic.model_validator(mode="after")
    def _check(self):
        if self.group_size > 8:
            raise ValueError("group_size above 8 needs more memory; lower it")
        return self


class RootWithCheck(Config):
    algo: Annotated[WithCheck | B, pydantic.Field(discriminator="type")] = WithCheck()


def test_cross_field_errors_inside_a_tagged_union_name_the_section_not_the_tag():
    with pytest.raises(ConfigError) as e:
        validate_config(RootWithCheck, {"algo": {"type": "a", "group_size": 9}})
    assert "- algo: group_size above 8" in str(e.value)


def test_base_file_merges_tables_and_replaces_values(tmp_path):
    (tmp_path / "base.toml").write_text('name = "base"\n[inner]\nlr = 0.1\nbetas = [0.1, 0.2]\n')
    (tmp_path / "variant.toml").write_text('base = "base.toml"\n[inner]\nbetas = [0.3, 0.4]\n')
    cfg = load_toml_config(Root, tmp_path / "variant.toml")
    assert cfg.name == "base" and cfg.inner.lr == 0.1 and cfg.inner.betas == [0.3, 0.4]


def test_base_cycle_is_an_error(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_toml_config(Root, tmp_path / "a.toml")


# -- where a problem was written, and what the user probably meant (issue 12) ---------------------------------------


def _error(tmp_path, text, overrides=(), name="r.toml"):
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_toml_config(Root, f, parse_overrides(list(overrides)))
    return f, str(e.value)


def test_unknown_key_suggests_the_close_field_of_its_section(tmp_path):
    _, msg = _error(tmp_path, "[inner]\nlrr = 0.1\n")
    assert "- inner.lrr: unknown key" in msg and "did you mean inner.lr?" in msg, msg


def test_unknown_key_names_the_section_that_has_a_field_of_that_name(tmp_path):
    _, msg = _error(tmp_path, "[inner]\ngroup_size = 4\n")
    assert "- inner.group_size: unknown key" in msg and "did you mean algo.group_size?" in msg, msg


def test_field_of_the_other_union_member_names_its_type(tmp_path):
    _, msg = _error(tmp_path, '[algo]\ntype = "a"\ngamma = 0.5\n')
    assert "- algo.gamma: unknown key" in msg and "is a field of type = 'b'" in msg, msg


def test_an_override_of_a_tables_type_replaces_the_table_as_a_file_naming_another_type_does(tmp_path):
    (tmp_path / "r.toml").write_text('[algo]\ntype = "b"\ngamma = 0.5\n')
    for flags in (["--algo.type", "a", "--algo.group_size", "6"], ["--algo.group_size", "6", "--algo.type", "a"]):
        cfg = load_toml_config(Root, tmp_path / "r.toml", parse_overrides(flags))
        assert cfg.algo == A(group_size=6), flags  # gamma, a key of type 'b', went with the table
    assert load_toml_config(Root, tmp_path / "r.toml", parse_overrides(["--algo.type", "b"])).algo == B(gamma=0.5)
    # What the emptied table then lacks is the flag's to give, not the file's.
    (tmp_path / "r.toml").write_text('[algo]\ntype = "a"\ngroup_size = 6\n')

    class Needs(Config):
        type: Literal["n"] = "n"
        path: str

    class WithNeeds(Config):
        algo: Annotated[A | Needs, pydantic.Field(discriminator="type")] = A()

    with pytest.raises(ConfigError, match=r"^command-line flag --algo.type: invalid recipe .*\n  - algo.path: requi"):
        load_toml_config(WithNeeds, tmp_path / "r.toml", parse_overrides(["--algo.type", "n"]))


def test_a_table_of_a_tagged_union_without_its_type_lists_the_types_and_the_one_its_keys_fit(tmp_path):
    _, msg = _error(tmp_path, "[algo]\ngamma = 0.5\n")
    assert "- algo: no type: set type = one of 'a', 'b' (its keys fit type = 'b')" in msg, msg
    _, msg = _error(tmp_path, "[algo]\n")  # no key narrows it: no hint
    assert msg.endswith("- algo: no type: set type = one of 'a', 'b'"), msg


def test_unknown_key_without_a_close_name_lists_the_fields_of_its_section(tmp_path):
    _, msg = _error(tmp_path, "[inner]\nmomentum = 0.1\n")
    assert "the fields of [inner] are: lr, betas" in msg, msg


def test_override_errors_name_the_flag_not_the_file(tmp_path):
    f, msg = _error(tmp_path, "[inner]\nlr = 0.1\n", ["--inner.lr", "abc"])
    assert msg.startswith("command-line flag --inner.lr: ") and "- inner.lr: Input should be a valid number" in msg
    assert str(f) not in msg, msg


def test_override_of_a_section_that_does_not_exist_lists_the_sections(tmp_path):
    f, msg = _error(tmp_path, 'name = "r"\n', ["--no.such.field", "1"])
    assert msg.startswith("command-line flag --no.such.field: ") and str(f) not in msg, msg
    assert "- no: unknown section 'no': there is no [no]" in msg and "are: name, inner, algo" in msg, msg


def test_problems_from_the_file_and_from_flags_are_grouped_by_source(tmp_path):
    f, msg = _error(tmp_path, "[inner]\nlrr = 0.1\n", ["--inner.lr", "abc"])
    assert f"\n  {f}:\n    - inner.lrr: unknown key" in msg, msg
    assert "\n  command-line flag --inner.lr:\n    - inner.lr: Input should be a valid number" in msg, msg


def test_missing_base_file_is_reported_with_the_file_that_names_it(tmp_path):
    f, msg = _error(tmp_path, 'base = "nope.toml"\n', name="variant.toml")
    assert msg.startswith(f"{f}: base = 'nope.toml': no file {tmp_path / 'nope.toml'}"), msg


def test_a_bad_value_of_the_base_file_is_reported_against_the_base_file(tmp_path):
    (tmp_path / "base.toml").write_text('[inner]\nlr = "fast"\n')
    _, msg = _error(tmp_path, 'base = "base.toml"\nname = "v"\n', name="variant.toml")
    assert msg.startswith(f"{tmp_path / 'base.toml'}: invalid recipe") and "- inner.lr:" in msg, msg


class RootWithFieldError(Config):
    inner: Inner = Inner()
    name: str = "x"

    @pydantic.model_validator(mode="after")
    def _check(self):
        from common.config import FieldError  # imported here so that the other tests of this file run on older code

        if self.name == "bad":
            raise FieldError("inner.lr", "lr must be small for this name")
        return self


def test_field_error_of_a_cross_section_validator_blames_that_field_and_its_source(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate_config(RootWithFieldError, {"name": "bad"})
    assert "- inner.lr: lr must be small for this name" in str(e.value)
    f = tmp_path / "r.toml"
    f.write_text('name = "bad"\n')
    with pytest.raises(ConfigError) as e:
        load_toml_config(RootWithFieldError, f, {"inner.lr": 0.5})
    assert str(e.value).startswith("command-line flag --inner.lr: "), str(e.value)


def test_a_table_of_another_type_replaces_the_base_table(tmp_path):
    from common.config import read_toml

    (tmp_path / "base.toml").write_text('[task]\ntype = "arithmetic"\nmin_digits = 1\n[run]\nname = "a"\nseed = 1\n')
    mine = 'base = "base.toml"\n[task]\ntype = "jsonl"\npath = "d.jsonl"\n[run]\nname = "b"\n'
    (tmp_path / "mine.toml").write_text(mine)
    (tmp_path / "same.toml").write_text('base = "base.toml"\n[task]\ntype = "arithmetic"\nmax_digits = 3\n')
    assert read_toml(tmp_path / "mine.toml") == {"task": {"type": "jsonl", "path": "d.jsonl"},
                                                 "run": {"name": "b", "seed": 1}}  # fmt: skip
    assert read_toml(tmp_path / "same.toml")["task"] == {"type": "arithmetic", "min_digits": 1, "max_digits": 3}


class _Adapter(Config):
    rank: int = 4
    targets: tuple[str, ...] = ("q",)


class _WithOptional(Config):
    adapter: _Adapter | None = None
    target: float | None = 0.5
    flag: bool | None = True
    options: dict[str, object] = {}


def test_false_unsets_an_optional_table_or_value_and_leaves_booleans_and_free_form_tables():
    """`lora = false` under a base recipe's [model.lora] was refused ("Input should be an object"); a field validator
    turning false into None made the table's own lists fail strict tuple checks."""
    kept = validate_config(_WithOptional, {"adapter": {"rank": 8, "targets": ["q", "v"]}})
    assert kept.adapter == _Adapter(rank=8, targets=("q", "v"))
    dropped = validate_config(_WithOptional, {"adapter": False, "target": False, "flag": False,
                                              "options": {"calculator": False}})  # fmt: skip
    assert dropped.adapter is None and dropped.target is None
    assert dropped.flag is False and dropped.options == {"calculator": False}  # a user's own options, as given


class Bounded(Config):
    lr: float = 1.0
    clip: float = pydantic.Field(default=1.0, allow_inf_nan=True)
    """inf means off."""
    count: int = 1
    workers: Annotated[int, pydantic.Field(ge=1)] | Literal["auto"] = 1
    algo: Annotated[A | B, pydantic.Field(discriminator="type")] = A()


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_a_float_is_finite_unless_its_field_says_inf_means_something(value):
    with pytest.raises(ConfigError, match=r"- lr: Input should be a finite number"):
        validate_config(Bounded, {"lr": value})
    assert validate_config(Bounded, {"clip": float("inf")}).clip == float("inf")


def test_an_integer_past_64_bits_is_refused_at_load_not_where_torch_or_numpy_overflow():
    """2**70 rollout workers passed --check and filled the driver's memory with placement bundles."""
    with pytest.raises(ConfigError, match=r"- count: 1180591620717411303424 is out of range: a recipe's integers fit"):
        validate_config(Bounded, {"count": 2**70})
    assert validate_config(Bounded, {"count": 2**63 - 1}).count == 2**63 - 1

    class Listed(Config):
        ids: list[int] = []
        table: dict[str, list[int]] = {}

    for data in ({"ids": [1, 2**70]}, {"table": {"a": [2**70]}}):  # stop_token_ids = [2**70] passed
        with pytest.raises(ConfigError, match=r"1180591620717411303424 is out of range"):
            validate_config(Listed, data)


def test_the_members_of_a_plain_union_refuse_a_value_in_one_line_under_the_field():
    with pytest.raises(ConfigError) as e:
        validate_config(Bounded, {"workers": 0})
    assert "(1 problem(s)):\n  - workers: Input should be greater than or equal to 1 (got 0); or Input should be " \
        "'auto' (got 0)" in str(e.value)  # fmt: skip


def test_a_missing_field_named_like_its_tables_type_is_named():
    class F(Config):
        type: Literal["function"] = "function"
        function: str

    class WithF(Config):
        terms: list[Annotated[F | B, pydantic.Field(discriminator="type")]] = []

    with pytest.raises(ConfigError, match=r"- terms\[0\].function: required field is missing"):
        validate_config(WithF, {"terms": [{"type": "function"}]})
    with pytest.raises(ConfigError, match=r"- terms\[0\].function: Input should be a valid string"):
        validate_config(WithF, {"terms": [{"type": "function", "function": 3}]})

    class Tools(Config):  # the tool environment: type 'tools' and a list 'tools'
        type: Literal["tools"] = "tools"
        tools: list[str] = []
        fraction: float = 0.0

    class WithTools(Config):
        env: Annotated[Tools | B, pydantic.Field(discriminator="type")] = Tools()

    with pytest.raises(ConfigError, match=r"- env.fraction: Input should be a finite number"):  # not env.tools.fraction
        validate_config(WithTools, {"env": {"type": "tools", "tools": ["calc"], "fraction": float("nan")}})
    from common.config import config_error

    # A check's own location of keys (no tags): the list is named, not taken for the tag.
    assert "- env.tools[0]: unknown" in str(config_error([(("env", "tools", 0), "unknown")],
                                                         {"env": {"type": "tools", "tools": ["calc"]}}))  # fmt: skip


def test_a_table_given_as_a_flag_merges_into_the_recipes_table_as_a_file_would(tmp_path):
    """`--run.warm_start '{num_steps=10}'` dropped the base's other warm-start settings, silently."""
    f = tmp_path / "r.toml"
    f.write_text('name = "r"\n[inner]\nlr = 0.5\nbetas = [0.1, 0.2]\n[algo]\ntype = "a"\ngroup_size = 6\n')
    cfg = load_toml_config(Root, f, parse_overrides(["--inner", "{lr = 0.25}", "--algo", '{type = "a"}']))
    assert cfg.inner == Inner(lr=0.25, betas=[0.1, 0.2]) and cfg.algo == A(group_size=6)
    assert load_toml_config(Root, f, parse_overrides(["--algo", '{type = "b"}'])).algo == B()  # another type: replaced


def test_a_recipe_path_that_is_no_utf8_file_is_named_with_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r": not a recipe file \(a directory\); name a .toml file"):
        load_toml_config(Root, tmp_path)
    (tmp_path / "latin1.toml").write_bytes('name = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.toml: not UTF-8 text \(byte 11: invalid continuation byte\)"):
        load_toml_config(Root, tmp_path / "latin1.toml")
    (tmp_path / "bom.toml").write_bytes('\ufeffname = "with a byte-order mark"\n'.encode())
    assert load_toml_config(Root, tmp_path / "bom.toml").name == "with a byte-order mark"


def test_flag_text_that_toml_reads_as_more_than_one_value_or_as_a_date_is_kept_as_text():
    """'3\\nfoo = 1' was read as 3 (the rest dropped); a date-time typed for a path came back rewritten."""
    got = parse_overrides(["--n", "3\nfoo = 1", "--dir", "1979-05-27T07:32:00", "--t", "07:32:00.5"])
    assert got == {"n": "3\nfoo = 1", "dir": "1979-05-27T07:32:00", "t": "07:32:00.5"}
