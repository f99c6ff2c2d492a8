"""``specdec generate``: its arguments, the constraints it maps onto ``SamplingParams``, and the default
dtype it shares with ``LLM()`` and ``python -m experiments.run`` (issue 24)."""

from __future__ import annotations

import inspect
import json

import pytest

from specdec.cli import build_parser, sampling_params_from_args


def parse(*argv: str):
    return build_parser().parse_args(["generate", *argv])


def test_every_entry_point_defaults_to_float32(hydra_conf_for_cli):
    from specdec.llm import LLM

    llm_default = inspect.signature(LLM.__init__).parameters["dtype"].default
    cli_default = parse().dtype
    hydra_cfg = hydra_conf_for_cli()
    hydra_default = hydra_cfg.engine.llm_kwargs(hydra_cfg.model)["dtype"]
    assert llm_default == cli_default == hydra_default == "float32"


@pytest.fixture
def hydra_conf_for_cli():
    from hydra import compose, initialize_config_module

    from experiments.config import register_configs, to_experiment_config

    register_configs()
    with initialize_config_module(config_module="experiments.conf", version_base=None):
        yield lambda *overrides: to_experiment_config(
            compose(config_name="config", overrides=list(overrides))
        )


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: float32" in text and "(default: smollm2-135m-instruct)" in text
    assert "(default: 64)" in text and "(default: 4)" in text


def test_constraints_map_onto_sampling_params(tmp_path):
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    params = sampling_params_from_args(parse("--json-schema", json.dumps(schema), "--max-tokens", "8"))
    assert params.json_schema == schema and params.regex is None and params.choice is None
    assert params.max_tokens == 8
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    assert sampling_params_from_args(parse("--json-schema", f"@{path}")).json_schema == schema
    assert sampling_params_from_args(parse("--regex", "[0-9]{3}")).regex == "[0-9]{3}"
    params = sampling_params_from_args(parse("--choice", "yes", "--choice", "no", "--temperature", "0.5"))
    assert list(params.choice or []) == ["yes", "no"] and params.temperature == 0.5
    plain = sampling_params_from_args(parse())
    assert plain.json_schema is None and plain.regex is None and plain.choice is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--json-schema", "{not json"], "not valid JSON"),
        (["--json-schema", "[1, 2]"], "a JSON schema is an object"),
        (["--json-schema", "@/nonexistent/schema.json"], "cannot read"),
        (["--regex", "a", "--choice", "b"], "not allowed with argument"),
    ],
)
def test_bad_constraints_are_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


def test_grammar_forced_drafts_needs_a_drafter():
    """``--grammar-forced-drafts`` extends a drafter's chains: alone it is an error, before any model
    loads (not silently ignored)."""
    from specdec.cli import _generate

    with pytest.raises(SystemExit, match="give --drafter too"):
        _generate(parse("--grammar-forced-drafts", "--json-schema", '{"type": "object"}'))
    args = parse("--grammar-forced-drafts", "--drafter", "ngram")
    assert args.grammar_forced_drafts and args.drafter == "ngram"
    with pytest.raises(SystemExit, match="--suffix-share-across-requests applies to --drafter suffix or"):
        _generate(parse("--suffix-share-across-requests", "--json-schema", "{}"))
    with pytest.raises(SystemExit, match="--hybrid-union applies to --drafter hybrid"):
        _generate(parse("--hybrid-union", "--drafter", "suffix", "--json-schema", "{}"))
    assert parse("--hybrid-union", "--drafter", "hybrid").hybrid_union
    with pytest.raises(SystemExit, match="--max-forced-drafts needs --grammar-forced-drafts"):
        _generate(parse("--max-forced-drafts", "8", "--drafter", "ngram", "--json-schema", "{}"))
    assert (
        parse("--grammar-forced-drafts", "--drafter", "ngram", "--max-forced-drafts", "8").max_forced_drafts
        == 8
    )
