"""The typed doors of the config: ``ConfigForm`` (flow parameters, the Prefect UI form) and
``resolve_job`` (recipe < TOML file < dotted-key values), with the CLI's type checks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from form_helpers import form_problems

from titan_core.config.argv import cli_values
from titan_core.config.form import (
    CHANGE_TAB,
    KEEP_TAB,
    RUN_FIELDS,
    ConfigForm,
    attribute_docstrings,
    flow_values,
    form_to_values,
    markdown_safe,
    recipe_schema,
)
from titan_core.config.job import JobConfig, Training
from titan_core.config.schema import schema as config_schema
from titan_core.config.schema import to_dict
from titan_core.errors import ConfigError
from titan_core.resolve import parse_args, resolve_job


def test_form_has_every_section_and_field_with_help_and_no_default() -> None:
    schema = ConfigForm.model_json_schema()
    keys = []

    def walk(section: str, ref: str) -> None:
        for name, field in schema["$defs"][ref.rsplit("/", 1)[-1]]["properties"].items():
            if "$ref" in field:  # a nested section (launch.slurm): a nested form
                assert field["title"] == name and "default" not in field, name
                assert field["description"].startswith(f"[{section}.{name}] "), name
                walk(f"{section}.{name}", field["$ref"])
                continue
            keys.append(f"{section}.{name}")
            # No default and no null type, switches included: an empty field shows as an empty
            # input, an untouched switch as off, and neither is submitted (the chosen recipe's
            # value stays); titled by its key; the help claims no recipe's value.
            assert "default" not in field and "anyOf" not in str(field), name
            assert field["title"] == name and field["description"].endswith(")."), name
            assert "keeps the chosen recipe's value" in field["description"], name
            assert " (engine default: " in field["description"], name
            switch = "Left untouched, it keeps the chosen recipe's value, whatever the switch"
            assert (switch in field["description"]) == (field["type"] == "boolean"), name

    # The run group first, then every section folded: two tabs, the first of which submits
    # nothing (only an empty object is valid there), the second the section's form.
    sections = schema["properties"]
    assert list(sections) == ["run", *(f.name for f in dataclasses.fields(JobConfig))]
    for section, prop in list(sections.items())[1:]:
        keep, change = prop["anyOf"]
        assert keep == {
            "title": KEEP_TAB,
            "description": f"Every {section} setting keeps the chosen recipe's value; change "
            "sets some.",
            "type": "object",
            "properties": {},
            "additionalProperties": False,
        }, section
        assert change["title"] == CHANGE_TAB and "default" not in prop, section
        assert prop["title"] == section and prop["description"].startswith(f"[{section}]")
        walk(section, change["$ref"])
    assert form_problems(schema) == []  # no null, no class name, every tab titled
    # Every key but the config file (the flows' config_file parameter) is in the form.
    assert keys == [k for k in config_schema(JobConfig) if k != "job.config_file"]
    docs = attribute_docstrings(Training)
    steps = schema["$defs"]["TrainingForm"]["properties"]["steps"]
    assert steps["type"] == "integer"
    assert steps["description"] == (
        docs["steps"] + " Empty keeps the chosen recipe's value (engine default: 100)."
    )
    mix = schema["$defs"]["DataloaderForm"]["properties"]["mix"]
    assert mix["type"] == "array" and mix["items"] == {"type": "string"}
    assert mix["examples"] == [[]] and "(engine default: [])" in mix["description"]
    # Placeholders survive a markdown renderer (the Prefect UI's help text).
    root = schema["$defs"]["JobForm"]["properties"]["dump_folder"]["description"]
    assert "`<dump_folder>/<experiment>/<run_id>/`" in root
    assert markdown_safe("in <a>/<b>/, then <c>.") == "in `<a>/<b>/`, then `<c>`."


def test_run_group_comes_first_and_sets_its_keys() -> None:
    schema = ConfigForm.model_json_schema()
    run = schema["$defs"]["RunForm"]["properties"]
    assert {name: field["title"] for name, field in run.items()} == RUN_FIELDS
    assert run["steps"]["type"] == "integer" and "default" not in run["steps"]
    assert "Sets training.steps. Empty keeps the " in run["steps"]["description"]
    assert run["lr"]["type"] == "number" and run["dataset"]["type"] == "string"
    form = ConfigForm.model_validate({"run": {"steps": 5, "lr": 0.01}, "training": {"seq_len": 64}})
    assert form_to_values(form) == {
        "training.seq_len": 64,
        "training.steps": 5,
        "optimizer.lr": 0.01,
    }
    agree = ConfigForm.model_validate({"run": {"steps": 5}, "training": {"steps": 5}})
    assert form_to_values(agree) == {"training.steps": 5}
    disagree = ConfigForm.model_validate({"run": {"steps": 5}, "training": {"steps": 6}})
    with pytest.raises(ConfigError, match=r"^config.run.steps \(5\) and config.training.steps"):
        form_to_values(disagree)
    with pytest.raises(ConfigError, match="the flow's config_file parameter sets it"):
        flow_values({"job": {"config_file": "a.toml"}}, None)


def test_recipe_schema_shows_the_recipes_values() -> None:
    """What ``titan pipeline deploy`` does to a deployment's schema: every field's help adds the
    value its runs start from, named as the deployed one (a user may pick another recipe in the
    same form), and its examples are that value; nothing gets a default, switches included."""
    schema = {
        "properties": {"recipe": {"type": "string"},
                       "config": {"$ref": "#/definitions/ConfigForm", "default": {}}},
        "definitions": ConfigForm.model_json_schema(ref_template="#/definitions/{model}")[
            "$defs"] | {"ConfigForm": ConfigForm.model_json_schema()},
    }  # fmt: skip
    schema["definitions"]["ConfigForm"].pop("$defs")
    cfg = resolve_job("llama3_debugmodel")
    new = recipe_schema(schema, cfg, "recipe llama3_debugmodel")
    defs = new["definitions"]
    warmup = defs["LRSchedulerForm"]["properties"]["warmup_steps"]
    assert warmup["examples"] == [cfg.lr_scheduler.warmup_steps]
    assert warmup["description"].endswith(
        "Empty keeps the chosen recipe's value (as deployed, recipe llama3_debugmodel: "
        f"{cfg.lr_scheduler.warmup_steps})."
    )
    steps = defs["RunForm"]["properties"]["steps"]
    assert steps["description"].endswith(
        "Sets training.steps. Empty keeps the chosen recipe's value (as deployed, recipe "
        f"llama3_debugmodel: {cfg.training.steps})."
    )
    enable = defs["CheckpointForm"]["properties"]["enable"]
    assert enable == schema["definitions"]["CheckpointForm"]["properties"]["enable"] | {
        "description": enable["description"], "examples": [cfg.checkpoint.enable]
    }  # fmt: skip
    assert enable["description"].endswith(
        "whatever the switch shows (as deployed, recipe llama3_debugmodel: "
        f"{str(cfg.checkpoint.enable).lower()})."
    )
    assert "engine default" in schema["definitions"]["TrainingForm"]["properties"]["steps"][
        "description"]  # a copy  # fmt: skip
    fields = [f for d in defs.values() for f in d.get("properties", {}).values() if "type" in f]
    assert len(fields) > 180 and not [f for f in fields if "default" in f]
    assert not [f for f in fields if "engine default" in f.get("description", "")]
    assert form_problems(new) == []


def test_form_to_values_gives_only_the_fields_set() -> None:
    assert form_to_values(None) == {} and form_to_values(ConfigForm()) == {}
    # A section given as null (what run forms before the folded tabs submitted) is untouched.
    assert flow_values({"training": None, "run": None, "job": {}}, None) == {}
    form = ConfigForm.model_validate(
        {"training": {"steps": 4, "max_norm": 2}, "validation": {"enable": False}}
    )
    assert form_to_values(form) == {
        "training.steps": 4,
        "training.max_norm": 2.0,
        "validation.enable": False,
    }
    nested = ConfigForm.model_validate({"launch": {"nnodes": 2, "slurm": {"partition": "gpu"}}})
    values = form_to_values(nested)
    assert values == {"launch.nnodes": 2, "launch.slurm.partition": "gpu"}
    assert resolve_job("", "", values).launch.slurm.partition == "gpu"


@pytest.mark.parametrize(
    "config, overrides, expected",
    [
        ({"training": {"steps": "4"}}, None, "config.training.steps: input should be a valid "
         "integer, got '4'"),
        ({"validation": {"enable": 1}}, None, "config.validation.enable: input should be a "
         "valid boolean, got 1"),
        ({"trainin": {"steps": 4}}, None, "config.trainin: no such section or field of the "
         "job config"),
        ({"optimizer": {"name": "SGD"}}, None, "config.optimizer.name: input should be 'AdamW' "
         "or 'Adam', got 'SGD'"),
        ("llama3_debugmodel", None, "config: expected the job's settings by section (e.g. "
         "{'training': {'steps': 20}}), got 'llama3_debugmodel'; a recipe name goes in the "
         "recipe parameter"),
        (None, ["--training.steps", "4"], "overrides: expected a mapping of dotted config keys "
         "to values (e.g. {\"training.steps\": 20}), got ['--training.steps', '4']"),
    ],
)  # fmt: skip
def test_flow_parameters_errors_are_one_line(
    config: object, overrides: object, expected: str
) -> None:
    with pytest.raises(ConfigError) as err:
        flow_values(config, overrides)  # type: ignore[arg-type]
    assert str(err.value) == expected


def test_layers_recipe_file_form_then_overrides(tmp_path: Path) -> None:
    toml = tmp_path / "job.toml"
    toml.write_text("[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 0.01\n")
    values = flow_values(
        {"training": {"steps": 9, "seq_len": None}, "optimizer": {"lr": 0.02}},
        {"training.steps": 11},
    )
    cfg = resolve_job("llama3_debugmodel_tiny", str(toml), values)
    assert (cfg.training.steps, cfg.training.seq_len, cfg.optimizer.lr) == (11, 64, 0.02)
    assert cfg.model.flavor == "debugmodel_tiny" and cfg.job.config_file == str(toml)
    argv = ["--module", "llama3", "--config", "llama3_debugmodel_tiny"]
    argv += ["--job.config_file", str(toml), "--training.steps", "11", "--optimizer.lr", "0.02"]
    assert to_dict(cfg) == to_dict(parse_args(argv))  # the CLI door resolves the same config


def test_recipes_by_name_or_family() -> None:
    assert resolve_job("qwen3_debugmodel_tiny").model.name == "qwen3"
    assert resolve_job("qwen3/qwen3_debugmodel_tiny").model.flavor == "debugmodel_tiny"
    assert resolve_job().model.flavor == JobConfig().model.flavor  # no recipe: the defaults
    with pytest.raises(ConfigError) as err:
        resolve_job("llama3_debugmodl")
    assert str(err.value) == (
        "recipe 'llama3_debugmodl': no such registry recipe; did you mean llama3_debugmodel or "
        "llama3_debugmodel_tiny or qwen3_debugmodel?"
    )
    with pytest.raises(ConfigError, match=r"^recipe 'qwen3/llama3_8b': .* llama3/llama3_8b"):
        resolve_job("qwen3/llama3_8b")


@pytest.mark.parametrize(
    "values, expected",
    [
        ({"training.stepz": 4}, "training.stepz: unknown config key; did you mean training.steps"),
        ({"training.steps": "4"}, "training.steps: expected an int, got '4'"),
        ({"training.steps": True}, "training.steps: expected an int, got True"),
        ({"training.steps": 0}, "training.steps: expected an int > 0, got 0"),
        ({"evaluate.batches": -1}, "evaluate.batches: expected an int >= 0 (0 = all), got -1"),
        ({"compile.components": ["graph"]}, "compile.components: expected a list of values, "
         "each one of 'model', 'loss', got ['graph']"),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_errors(values: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        resolve_job("llama3_debugmodel_tiny", "", values)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_cli_tokens_become_typed_values() -> None:
    argv = ["--training.steps", "4", "--validation.no_enable", "--data.sources", "a,b"]
    argv += ["--optimizer.lr=1e-3", "--evaluate.batches", "0"]
    assert cli_values(argv) == {
        "training.steps": 4,
        "validation.enable": False,
        "data.sources": ["a", "b"],
        "optimizer.lr": 1e-3,
        "evaluate.batches": 0,
    }


def test_evaluate_section_defaults_and_round_trips(tmp_path: Path) -> None:
    assert [f.name for f in dataclasses.fields(JobConfig)].index("evaluate") > 0
    assert resolve_job().evaluate.batches == 20
    toml = tmp_path / "eval.toml"
    toml.write_text("[evaluate]\nbatches = 0\n")
    assert resolve_job("", str(toml)).evaluate.batches == 0


def test_config_flows_take_the_config_the_same_way() -> None:
    """pretrain_pipeline, retrain, sweep and compare take the config alike: a recipe name, the
    typed ``config`` form (one definition, the same for all), ``overrides`` and ``config_file``,
    each described, with the same default recipe; compare finds the store from them (no
    tracking_uri parameter)."""
    from prefect.utilities.callables import parameter_schema

    from flows.compare import compare
    from flows.pipeline import pretrain_pipeline
    from flows.retrain import retrain
    from flows.sweep import sweep
    from titan_core.pipeline.run.config import DEFAULT_RECIPE

    schemas = {
        f.name: parameter_schema(f.fn).model_dump_for_openapi()
        for f in (pretrain_pipeline, retrain, sweep, compare)
    }
    forms = schemas["pretrain_pipeline"]["definitions"]
    for name, schema in schemas.items():
        params = schema["properties"]
        assert {"recipe", "config", "overrides", "config_file"} <= set(params), name
        assert all(p.get("description") for p in params.values()), name
        assert params["recipe"]["type"] == "string", name
        # One default recipe: retrain and compare default to the line and store pretrain writes.
        assert params["recipe"]["default"] == DEFAULT_RECIPE, name
        # The form itself and plain objects, with nothing set: no "| None" switch, no null
        # type, default or class name anywhere in the run form.
        assert params["config"]["$ref"] == "#/definitions/ConfigForm", name
        assert params["config"]["default"] == {}, name
        assert {k: schema["definitions"][k] for k in forms} == forms, name
        assert params["overrides"]["type"] == "object" and params["overrides"]["default"] == {}
        assert form_problems(schema, f"{name}: ") == []
    assert list(schemas["retrain"]["properties"]) == [
        "steps", "recipe", "experiment", "config", "overrides", "config_file", "parent_run_id"
    ]  # fmt: skip
    assert list(schemas["compare"]["properties"]) == [
        "recipe", "experiment", "config", "overrides", "config_file", "runs", "max_runs", "log",
        "parent_run_id",
    ]  # fmt: skip
