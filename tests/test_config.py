"""Config resolution: defaults < registry < TOML < CLI; one-line errors; round trips; --help."""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import fsspec
import pytest
from helpers import ADDED_KEYS, titan_in_process

from titan_core.cli.config import config_main
from titan_core.config.job import JobConfig, Slurm
from titan_core.config.schema import flatten, schema, to_dict, to_toml, validate
from titan_core.config.toml import load_toml
from titan_core.errors import ConfigError
from titan_core.models.llama3 import config_registry
from titan_core.resolve import ConfigManager, parse_args

REPO = Path(__file__).resolve().parents[1]
DEBUG = ["--module", "llama3", "--config", "llama3_debugmodel"]
REGISTRY_NAMES = sorted(
    name
    for name, fn in inspect.getmembers(config_registry, inspect.isfunction)
    if fn.__module__ == config_registry.__name__ and not name.startswith("_")
)


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def config_error(argv: list[str]) -> str:
    """The message of the ConfigError that ``argv`` raises; asserts it is one line."""
    with pytest.raises(ConfigError) as info:
        parse_args(argv)
    message = str(info.value)
    assert "\n" not in message
    return message


def run_manager(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80"}  # wider terminals get a multi-column help
    return subprocess.run(
        [sys.executable, "-m", "titan_core.config.manager", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


# -- precedence ----------------------------------------------------------------------------------


def test_no_arguments_gives_the_dataclass_defaults() -> None:
    assert parse_args([]) == JobConfig()


def test_each_layer_overrides_the_one_before(tmp_path: Path) -> None:
    toml = write(tmp_path, "[training]\nsteps = 300\nseq_len = 128\n[optimizer]\nlr = 1e-3\n")
    cfg = parse_args([*DEBUG, "--job.config_file", toml, "--training.steps", "400"])
    assert cfg.training.gc_freq == JobConfig().training.gc_freq == 50  # default layer
    assert cfg.checkpoint.interval == 50 and cfg.model.flavor == "debugmodel"  # registry layer
    assert cfg.training.seq_len == 128 and cfg.optimizer.lr == 1e-3  # TOML over registry
    assert cfg.training.steps == 400  # CLI over TOML
    assert cfg.job.config_file == toml


def test_registry_layer_alone() -> None:
    cfg = parse_args(DEBUG)
    assert cfg == config_registry.llama3_debugmodel()
    assert cfg.training.steps == 200 and cfg.lr_scheduler.decay_type == "cosine"


def test_toml_without_registry_starts_from_defaults(tmp_path: Path) -> None:
    toml = write(tmp_path, "[training]\nsteps = 30\n")
    cfg = parse_args(["--job.config_file", toml, "--optimizer.lr", "0.01"])
    assert cfg.training.steps == 30 and cfg.optimizer.lr == 0.01
    assert cfg.model.flavor == JobConfig().model.flavor


def test_toml_accepts_int_for_float_and_hyphenated_keys(tmp_path: Path) -> None:
    toml = write(tmp_path, "[optimizer]\nlr = 1\n[training]\nlocal-batch-size = 3\n")
    cfg = load_toml(toml, JobConfig())
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.training.local_batch_size == 3


def test_toml_from_an_fsspec_url() -> None:
    fs = fsspec.filesystem("memory")
    fs.pipe("/test_config/run.toml", b"[training]\nsteps = 12\n")
    try:
        assert (
            parse_args(["--job.config_file", "memory://test_config/run.toml"]).training.steps == 12
        )
    finally:
        fs.rm("/test_config", recursive=True)


def test_load_toml_does_not_mutate_base(tmp_path: Path) -> None:
    base = JobConfig()
    load_toml(write(tmp_path, "[checkpoint]\nexclude_from_loading = ['optimizer']\n"), base)
    assert base == JobConfig()


# -- CLI syntax ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.local-batch-size", "4"],
        ["--training.local_batch_size", "4"],
        ["--training.local-batch-size=4"],
        ["--training.local_batch_size=4"],
        ["--training.local_batch_size", "7", "--training.local-batch-size", "4"],
    ],
)
def test_hyphens_underscores_and_equals_are_interchangeable(argv: list[str]) -> None:
    assert parse_args(argv).training.local_batch_size == 4


def test_boolean_flags() -> None:
    assert parse_args(["--profiling.enable_memory_snapshot"]).profiling.enable_memory_snapshot
    assert parse_args(["--profiling.enable-memory-snapshot"]).profiling.enable_memory_snapshot
    for flag in ["--dataloader.no_streaming", "--dataloader.no-streaming"]:
        assert parse_args([flag]).dataloader.streaming is False
    argv = ["--profiling.enable_memory_snapshot", "--profiling.no-enable-memory-snapshot"]
    assert parse_args(argv).profiling.enable_memory_snapshot is False


def test_no_flag_overrides_a_true_registry_value() -> None:
    assert parse_args([*DEBUG, "--checkpoint.no-enable"]).checkpoint.enable is False


def test_boolean_with_a_value_is_refused() -> None:
    expected = (
        "--profiling.enable_memory_snapshot=False: boolean options are flags; use "
        "--profiling.no_enable_memory_snapshot (or --profiling.enable_memory_snapshot to enable)"
    )
    assert config_error(["--profiling.enable_memory_snapshot=False"]) == expected
    assert expected in (REPO / "docs" / "configuration.md").read_text()
    for argv in (
        ["--profiling.enable_memory_snapshot=True"],
        ["--profiling.enable-memory-snapshot=0"],
        ["--profiling.no_enable_memory_snapshot=1"],
        ["--profiling.enable_memory_snapshot", "False"],
    ):
        assert "boolean options are flags" in config_error(argv)


def test_lists() -> None:
    argv = ["--checkpoint.exclude_from_loading", "optimizer", "dataloader"]
    assert parse_args(argv).checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    for argv in (
        ["--checkpoint.exclude-from-loading=optimizer,dataloader"],
        ["--checkpoint.exclude-from-loading", "optimizer,dataloader", "--training.steps", "3"],
    ):
        assert parse_args(argv).checkpoint.exclude_from_loading == ["optimizer", "dataloader"]
    assert parse_args(["--compile.components", "loss"]).compile.components == ["loss"]
    assert parse_args(["--compile.components"]).compile.components == []
    assert parse_args(["--float8.filter_fqns="]).float8.filter_fqns == []
    message = config_error(["--compile.components", "model", "optimizer"])
    assert message == (
        "--compile.components: expected a list of values, each one of 'model', 'loss', "
        "got 'optimizer'"
    )


def test_values_that_look_like_flags_or_hold_equals_signs() -> None:
    cfg = parse_args(
        ["--job.description", "-x", "--model.n_layers", "-1", "--job.dump_folder=s3://b/k=v"]
    )
    assert cfg.job.description == "-x" and cfg.model.n_layers == -1
    assert cfg.job.dump_folder == "s3://b/k=v"
    assert parse_args(["--float8.recipe_name="]).float8.recipe_name == ""


# -- errors --------------------------------------------------------------------------------------


def test_unknown_cli_option_suggests_close_keys() -> None:
    message = config_error(["--training.stepz", "3"])
    assert message.startswith("unknown option --training.stepz; did you mean --training.steps")
    assert "--training.steps" in config_error(["--steps", "3"])
    assert "see --help" in config_error(["--nothing.like_this", "3"])


def test_stray_value_is_an_error() -> None:
    message = config_error(["--training.steps", "3", "4"])
    assert message.startswith("unexpected argument '4' after --training.steps")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--training.steps", "abc"], "--training.steps: expected an int, got 'abc'"),
        (["--training.steps=1.5"], "--training.steps: expected an int, got '1.5'"),
        (["--optimizer.lr", "fast"], "--optimizer.lr: expected a finite float, got 'fast'"),
        (
            ["--model.moe_aux_loss_coef", "inf"],
            "--model.moe_aux_loss_coef: expected a finite float, got 'inf'",
        ),
        (["--optimizer.lr", "nan"], "--optimizer.lr: expected a finite float, got 'nan'"),
        (
            ["--optimizer.name", "SGD"],
            "--optimizer.name: expected one of 'AdamW', 'Adam', got 'SGD'",
        ),
        (["--training.steps"], "--training.steps: expected a value (an int)"),
    ],
)
def test_wrong_cli_type(argv: list[str], expected: str) -> None:
    assert config_error(argv) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[training]\nsteps = "ten"\n', "training.steps: expected an int, got 'ten'"),
        ("[training]\nsteps = true\n", "training.steps: expected an int, got True"),
        ('[optimizer]\nlr = "1e-3"\n', "optimizer.lr: expected a finite float, got '1e-3'"),
        ("[optimizer]\nlr = nan\n", "optimizer.lr: expected a finite float, got nan"),
        ("[optimizer]\nweight_decay = -inf\n", "optimizer.weight_decay: expected a finite float"),
        ("[job]\nprint_config = 1\n", "job.print_config: expected true or false, got 1"),
        ('[lr_scheduler]\ndecay_type = "exp"\n', "expected one of 'linear', 'sqrt', 'cosine'"),
        ('[compile]\ncomponents = "model"\n', "compile.components: expected a list of values"),
        ("training = 3\n", "training must be a [training] table, got 3"),
    ],
)
def test_wrong_toml_type(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    message = config_error(["--job.config_file", path])
    assert message.startswith(f"{path}: ") and expected in message


def test_unknown_toml_keys_suggest_close_keys(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nstepz = 3\n")
    message = config_error(["--job.config_file", path])
    assert message.startswith(f"{path}: unknown key training.stepz; did you mean training.steps")
    path = write(tmp_path, "[trainin]\nsteps = 3\n")
    assert "unknown section [trainin]; did you mean [training]" in config_error(
        ["--job.config_file", path]
    )
    path = write(tmp_path, "steps = 3\n")
    assert "outside any [section] table; did you mean training.steps" in config_error(
        ["--job.config_file", path]
    )


def test_malformed_toml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[training]\nsteps = 3\nseq_len = \n")
    message = config_error(["--job.config_file", path])
    assert message.startswith(f"{path}: invalid TOML:") and "line 3" in message


def test_missing_toml_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.toml")
    assert config_error(["--job.config_file", missing]) == f"config file not found: {missing}"
    assert "is a directory" in config_error(["--job.config_file", str(tmp_path)])


def test_post_init_errors_propagate_with_the_key_path(tmp_path: Path) -> None:
    assert config_error(["--training.steps", "0"]) == "training.steps: expected an int > 0, got 0"
    assert config_error(["--optimizer.lr=-1"]) == "optimizer.lr: expected > 0, got -1.0"
    assert config_error(["--checkpoint.exclude_from_loading", "weights"]).startswith(
        "checkpoint.exclude_from_loading: expected names among"
    )
    path = write(tmp_path, "[profiling]\nprofile_freq = 2\nprofiler_warmup = 5\n")
    assert config_error(["--job.config_file", path]).startswith("profiling.profiler_warmup:")


def test_registry_errors_list_the_choices() -> None:
    message = config_error(["--module", "llama3", "--config", "llama3_9b"])
    assert message.startswith("--config 'llama3_9b': not in titan_core.models.llama3")
    assert "llama3_8b" in message and "llama3_debugmodel_tiny" in message
    assert "_llama3_gpu_recipe" not in message
    assert config_error(["--module=gpt", "--config=x"]) == (
        "--module 'gpt': unknown model family; choices: deepseek_v3, llama3, qwen3, qwen3_moe"
    )
    assert "names the family of a --config recipe" in config_error(["--module", "llama3"])
    # Recipe names are unique: --config alone finds its family.
    assert parse_args(["--config", "qwen3_debugmodel"]).model.name == "qwen3"
    assert config_error(["--config", "qwen3_debugmodl"]).startswith(
        "recipe 'qwen3_debugmodl': no such registry recipe; did you mean"
    )
    assert config_error(["--config"]) == "--config expects a value"


def test_validate_type_checks_and_reruns_post_init() -> None:
    cfg = JobConfig()
    cfg.training.steps = "10"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"^training\.steps: expected an int, got '10'$"):
        validate(cfg)
    cfg = JobConfig()
    cfg.validation.freq = 0
    with pytest.raises(ConfigError, match=r"^validation\.freq: expected an int > 0"):
        validate(cfg)


# -- registry ------------------------------------------------------------------------------------


def test_registry_recipes() -> None:
    from titan_core.models.llama3 import llama3_flavors

    assert set(REGISTRY_NAMES) >= {
        "llama3_debugmodel",
        "llama3_debugmodel_tiny",
        "llama3_1b",
        "llama3_3b",
        "llama3_8b",
        "llama3_70b",
        "llama3_405b",
    }
    for name in REGISTRY_NAMES:
        assert getattr(config_registry, name)().model.flavor in llama3_flavors, name
    debug = config_registry.llama3_debugmodel()
    assert (debug.training.local_batch_size, debug.training.seq_len) == (8, 256)
    assert (debug.checkpoint.interval, debug.checkpoint.keep_latest_k) == (50, 3)
    assert (debug.validation.freq, debug.validation.steps) == (50, 4)
    tiny = config_registry.llama3_debugmodel_tiny().training
    assert (tiny.local_batch_size, tiny.seq_len, tiny.steps) == (4, 64, 20)
    big = config_registry.llama3_8b()
    assert (big.training.seq_len, big.optimizer.lr) == (8192, 3e-4)
    assert big.activation_checkpoint.mode == "selective"
    assert big.training.mixed_precision_param == "bfloat16"
    assert config_registry.llama3_70b().parallelism.tensor_parallel_degree == 8
    assert config_registry.llama3_405b().compile.enable


# -- outputs -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", REGISTRY_NAMES)
def test_toml_round_trip_of_every_registry_config(tmp_path: Path, name: str) -> None:
    cfg = parse_args(["--module", "llama3", "--config", name, "--training.steps", "11"])
    path = write(tmp_path, to_toml(cfg))
    again = parse_args(["--job.config_file", path])
    assert again == dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=path))
    assert tomllib.loads(to_toml(cfg)) == to_dict(cfg)


def test_flatten_has_a_scalar_per_field() -> None:
    cfg = parse_args(["--checkpoint.exclude_from_loading", "optimizer", "dataloader"])
    flat = flatten(cfg)
    assert list(flat) == list(schema(JobConfig))  # nested sections: launch.slurm.*
    assert flat["training.steps"] == 100 and flat["optimizer.name"] == "AdamW"
    assert (
        flat["checkpoint.exclude_from_loading"] == '["optimizer", "dataloader"]'
    )  # JSON: an item may hold a comma
    assert all(isinstance(v, bool | int | float | str) for v in flat.values())


def test_main_prints_toml_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert config_main(["--training.steps", "5"]) == 0
    assert tomllib.loads(capsys.readouterr().out)["training"]["steps"] == 5
    assert config_main(["--training.steps", "x"]) == 2
    assert capsys.readouterr().err == "error: --training.steps: expected an int, got 'x'\n"


def test_config_manager_class_matches_module_function() -> None:
    argv = [*DEBUG, "--training.steps", "9"]
    assert ConfigManager().parse_args(argv) == parse_args(argv)


def test_subprocess_prints_resolved_toml() -> None:
    result = run_manager("--module", "llama3", "--config", "llama3_8b", "--training.steps", "7")
    assert result.returncode == 0, result.stderr
    resolved = tomllib.loads(result.stdout)
    assert resolved["training"]["steps"] == 7
    assert resolved["model"]["flavor"] == "8B" and resolved["training"]["seq_len"] == 8192


def test_subprocess_help_lists_flags_and_docstrings() -> None:
    result = run_manager("--module", "llama3", "--config", "llama3_debugmodel", "--help")
    assert result.returncode == 0, result.stderr
    # Drop the box-drawing borders and re-join wrapped lines before searching.
    text = " ".join(re.sub(r"[│╭╰─╮╯]", " ", result.stdout).split())
    for flag in (
        "--profiling.enable-memory-snapshot, --profiling.no-enable-memory-snapshot",
        "--training.local-batch-size INT",
        "--checkpoint.exclude-from-loading",
        "--lr-scheduler.decay-type {linear,sqrt,cosine}",
        "launch.slurm options Slurm batch jobs (backend slurm).",
        "--launch.slurm.partition STR",
        "--launch.slurm.sbatch-args [STR [STR ...]]",
    ):
        assert flag in text
    for doc in (
        "Write memory snapshots every profile_freq steps (a CPU memory report on CPU).",
        "Sequences per micro-batch on each data-parallel rank.",
        "Peak learning rate.",
    ):
        assert doc in text
    assert "(default: ./outputs/llama3_debugmodel)" in text  # defaults come from the registry


def test_subprocess_error_is_one_line_and_exit_2() -> None:
    result = run_manager("--module", "llama3", "--config", "llama3_8b", "--training.stepz", "7")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith("error: unknown option --training.stepz; did you mean")


# -- docs ----------------------------------------------------------------------------------------


def test_docs_toml_example_parses(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    blocks = dict(re.findall(r"```toml\n# ([\w.]+)\n(.*?)```", doc, flags=re.S))
    assert list(blocks) == ["my_run.toml", "slurm_settings.toml"]
    path = write(tmp_path, blocks["my_run.toml"], "my_run.toml")
    cfg = parse_args([*DEBUG, "--job.config_file", path])
    assert cfg.training.steps == 500 and cfg.training.seq_len == 512
    assert cfg.training.local_batch_size == 8  # from the registry function
    assert cfg.checkpoint.exclude_from_loading == ["dataloader"]
    assert cfg.profiling.enable_memory_snapshot
    path = write(tmp_path, blocks["slurm_settings.toml"], "slurm_settings.toml")
    cfg = parse_args([*DEBUG, "--job.config_file", path])
    assert (cfg.launch.backend, cfg.launch.nnodes) == ("slurm", 2)
    assert cfg.launch.slurm.partition == "gpu"
    assert cfg.launch.slurm.sbatch_args == ["gpus-per-node=8", "exclusive"]


def test_docs_section_table_lists_every_section() -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    table = doc.split("## Sections", 1)[1]
    documented = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert documented == [f.name for f in dataclasses.fields(JobConfig)]


@pytest.mark.parametrize(
    "argv",
    [
        ["--training.stepz", "3"],
        ["--training.steps", "abc"],
        ["--optimizer.name", "SGD"],
        ["--training.steps", "0"],
        ["--module", "gpt", "--config", "x"],
        ["--launch.slurm_partition", "gpu"],
    ],
)
def test_docs_error_examples_match_the_code(argv: list[str]) -> None:
    doc = (REPO / "docs" / "configuration.md").read_text()
    assert f"error: {config_error(argv)}\n" in doc


@pytest.mark.parametrize(
    "entries, expected",
    [
        (["data/a=x"], r"dataloader\.mix\[0\]: expected URL=WEIGHT with a weight > 0"),
        (["data/a=1", "data/b"], r"dataloader\.mix\[1\]: expected URL=WEIGHT"),
        (["data/a=0"], r"dataloader\.mix\[0\]: expected URL=WEIGHT with a weight > 0"),
        (["data/a=1", "data/a=2"], r"dataloader\.mix: expected each dataset once"),
        # Two spellings of one folder would mix it with itself.
        (["data/a=1", "./data/a/=1"], r"dataloader\.mix: expected each dataset once"),
        (["s3://b/a=1", "s3://b/a/=1"], r"dataloader\.mix: expected each dataset once"),
    ],
)
def test_mix_weights_that_do_not_parse_are_one_line(
    entries: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`titan train` (in this process) with a bad dataloader.mix: one line, exit 2, nothing
    written. test_subprocess_error_is_one_line_and_exit_2 runs the same path in a process."""
    argv = ["train", "--job.dump_folder", str(tmp_path / "run"), "--dataloader.mix", *entries]
    code, _, err = titan_in_process(argv, capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(expected, err), err
    assert not (tmp_path / "run").exists()


def test_mix_weights_are_normalised() -> None:
    from titan_core.config.job import parse_mix

    assert parse_mix(["s3://b/x=prefix/a=3", "b=1"]) == [("s3://b/x=prefix/a", 0.75), ("b", 0.25)]


# -- nested sections ([launch.slurm]) ------------------------------------------------------------


def test_nested_section_from_cli_and_toml_round_trip(tmp_path: Path) -> None:
    argv = [*DEBUG, "--launch.slurm.partition", "gpu", "--launch.slurm.time-limit=30"]
    argv += ["--launch.slurm.sbatch_args", "exclusive", "gpus-per-node=8"]
    cfg = parse_args([*argv, "--launch.slurm.poll_seconds", "2"])
    assert cfg.launch.slurm == Slurm(
        partition="gpu", time_limit="30", sbatch_args=["exclusive", "gpus-per-node=8"],
        poll_seconds=2.0,
    )  # fmt: skip
    text = to_toml(cfg)
    assert '\n[launch.slurm]\npartition = "gpu"\n' in text
    path = write(tmp_path, text)
    again = parse_args(["--job.config_file", path])
    assert again == dataclasses.replace(cfg, job=dataclasses.replace(cfg.job, config_file=path))
    flat = flatten(cfg)
    assert flat["launch.slurm.partition"] == "gpu" and "launch.slurm" not in flat
    assert flat["launch.slurm.sbatch_args"] == '["exclusive", "gpus-per-node=8"]'
    # A nested table only changes the keys it names; an inline table reads the same.
    path = write(tmp_path, '[launch]\nnnodes = 2\nslurm = { account = "proj" }\n')
    cfg = parse_args([*DEBUG, "--job.config_file", path, "--launch.slurm.partition", "gpu"])
    assert (cfg.launch.nnodes, cfg.launch.slurm.account, cfg.launch.slurm.partition) == (
        2, "proj", "gpu",
    )  # fmt: skip
    assert cfg.launch.slurm.time_limit == Slurm().time_limit


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[launch.slurm]\npartitio = "gpu"\n', "unknown key launch.slurm.partitio; did you mean "
         "launch.slurm.partition or launch.slurm.python or launch.slurm.account?"),
        ('[launch.slurmm]\npartition = "gpu"\n', "unknown section [launch.slurmm]; did you "
         "mean [launch.slurm]?"),
        ('[launch]\nslurm = "gpu"\n', "launch.slurm must be a [launch.slurm] table, got 'gpu'"),
        ('[launch.slurm]\nrdzv_port_base = "x"\n', "launch.slurm.rdzv_port_base: expected an "
         "int, got 'x'"),
        ('[launch]\nslurm_rdzv_port_base = "x"\n', "launch.slurm.rdzv_port_base: expected an "
         "int, got 'x'"),
    ],
)  # fmt: skip
def test_nested_toml_errors_are_one_line(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    assert config_error(["--job.config_file", path]) == f"{path}: {expected}"


def test_a_config_saved_before_keys_moved_still_loads(tmp_path: Path) -> None:
    """Every saved config.toml lists every key: one written before [launch.slurm] existed
    (flat launch.slurm_*) loads with its values under the new keys (retrain, eval and export
    read old runs' configs); the new spelling wins when a file has both."""
    path = write(
        tmp_path,
        '[launch]\nslurm_partition = "gpu"\nslurm_time_limit = "01:00:00"\n'
        '[launch.slurm]\ntime_limit = "02:00:00"\n',
    )
    cfg = parse_args(["--job.config_file", path])
    assert cfg.launch.slurm.partition == "gpu" and cfg.launch.slurm.time_limit == "02:00:00"


def test_old_flat_keys_name_the_new_key_at_every_door() -> None:
    from titan_core.config.form import flow_values
    from titan_core.resolve import resolve_job

    assert config_error(["--launch.slurm_partition", "gpu"]) == (
        "unknown option --launch.slurm_partition; it moved to --launch.slurm.partition"
    )
    assert config_error(["--launch.slurm-time-limit=30"]).endswith(
        "it moved to --launch.slurm.time_limit"
    )
    with pytest.raises(ConfigError) as err:
        resolve_job("", "", {"launch.slurm_partition": "gpu"})
    assert str(err.value) == (
        "launch.slurm_partition: unknown config key; it moved to launch.slurm.partition"
    )
    with pytest.raises(ConfigError) as err:
        flow_values({"launch": {"slurm_partition": "gpu"}}, None)
    assert str(err.value) == (
        "config.launch.slurm_partition: no such section or field of the job config; it moved "
        "to config.launch.slurm.partition"
    )
    assert flow_values({"launch": {"slurm": {"partition": "gpu"}}}, None) == {
        "launch.slurm.partition": "gpu"
    }
    assert resolve_job("", "", {"launch.slurm.partition": "gpu"}).launch.slurm.partition == "gpu"
    cfg = JobConfig()
    cfg.launch.slurm.poll_seconds = 0
    with pytest.raises(ConfigError, match=r"^launch\.slurm\.poll_seconds: expected > 0, got 0$"):
        validate(cfg)  # the nested section's __post_init__ runs too
    cfg.launch.slurm.poll_seconds = "1"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match=r"^launch\.slurm\.poll_seconds: expected a finite float"):
        validate(cfg)


STORAGE_ROOT_MOVED = "it moved to {}job.dump_folder (the one output root)"


def test_storage_root_is_refused_at_every_door_naming_job_dump_folder(tmp_path: Path) -> None:
    """``storage.root`` became ``job.dump_folder``: the CLI, flow values, the config form and a
    deployment's parameters refuse it in one line naming the new key."""
    from titan_core.cli.deploy import check_parameters
    from titan_core.config.form import flow_values
    from titan_core.resolve import resolve_job

    assert config_error(["--storage.root", "/runs"]) == (
        "unknown option --storage.root; " + STORAGE_ROOT_MOVED.format("--")
    )
    with pytest.raises(ConfigError) as err:
        resolve_job("llama3_debugmodel", "", flow_values(None, {"storage.root": "/runs"}))
    assert str(err.value) == "storage.root: unknown config key; " + STORAGE_ROOT_MOVED.format("")
    with pytest.raises(ConfigError) as err:
        flow_values({"storage": {"root": "/runs"}}, None)
    assert str(err.value) == (
        "config.storage.root: no such section or field of the job config; "
        + STORAGE_ROOT_MOVED.format("config.")
    )
    deployment = "deployments:\n- name: old\n  entrypoint: flows/pipeline.py:pretrain_pipeline\n"
    path = Path(
        write(tmp_path, deployment + "  parameters: {config: {storage: {root: s3://b/r}}}\n")
    )
    with pytest.raises(ConfigError) as err:
        check_parameters(path)
    assert str(err.value) == (
        f"{path.name}: deployment 'old': config.storage.root: no such section or field of the "
        "job config; " + STORAGE_ROOT_MOVED.format("config.")
    )
    path.write_text(deployment + "  parameters: {storage_root: s3://b/r}\n")
    with pytest.raises(ConfigError, match=r"parameter storage_root is gone; use config\.job\.dump"):
        check_parameters(path)


@pytest.mark.parametrize("dump_folder", ["", "/runs/titan/20260101-000000-abcdef"])
def test_an_old_toml_storage_root_is_read_as_job_dump_folder(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, dump_folder: str
) -> None:
    """A file written before the one root (a hand-written pipeline config, or an old run's saved
    config.toml, which retrain reads) loads with a warning: ``[storage] root`` becomes
    job.dump_folder, unless the file sets job.dump_folder too (an old run's config.toml, where it
    is the run's folder): then storage.root is ignored."""
    from titan_core.logging import logger
    from titan_core.resolve import resolve_job

    text = '[storage]\nroot = "/old-root"\nretries = 2\n'
    if dump_folder:
        text = f'[job]\ndump_folder = "{dump_folder}"\n' + text
    path = write(tmp_path, text)
    logger.addHandler(caplog.handler)
    try:
        cfg = parse_args(["--job.config_file", path])
        assert resolve_job("", path) == dataclasses.replace(
            cfg, job=dataclasses.replace(cfg.job, config_file=path)
        )
    finally:
        logger.removeHandler(caplog.handler)
    assert cfg.job.dump_folder == (dump_folder or "/old-root") and cfg.storage.retries == 2
    if dump_folder:
        expected = f"{path}: old keys ignored, the file sets their new names: storage.root"
    else:
        expected = f"{path}: old keys read as their new names: storage.root as job.dump_folder"
    assert {r.getMessage() for r in caplog.records if r.levelname == "WARNING"} == {expected}


DATALOADER_MOVED = "data-loader settings have their own [dataloader] section"
# Every key of [dataloader] and the [training] key it was, with the value that
# tests/data/config_saved_before_house.toml (saved before the section existed) gives it.
OLD_DATALOADER_KEYS = {
    "dataset": ("dataset", "titan_corpus"),
    "path": ("dataset_path", "/data/corpus.jsonl"),
    "split": ("dataset_split", "train"),
    "text_field": ("dataset_text_field", "body"),
    "streaming": ("dataset_streaming", False),
    "streams": ("data_streams", 2),
    "mix": ("dataset_mix", ["/data/a=0.7", "/data/b=0.3"]),
    "shuffle": ("dataset_shuffle", True),
    "seed": ("dataset_seed", 7),
    "verify": ("dataset_verify", "checksum"),
    "prefetch": ("dataset_prefetch", 4),
    "cache_mb": ("dataset_cache_mb", 32),
    "document_masking": ("document_masking", True),
}


def test_a_config_saved_before_the_dataloader_section_loads_under_the_new_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A config.toml saved before [dataloader] existed (its keys under [training]) loads with
    every value under its new key and one warning naming each old key read."""
    from titan_core.logging import logger

    fields = [f.name for f in dataclasses.fields(JobConfig().dataloader)]
    assert [f for f in fields if f"dataloader.{f}" not in ADDED_KEYS] == list(OLD_DATALOADER_KEYS)
    path = str(REPO / "tests" / "data" / "config_saved_before_house.toml")
    logger.addHandler(caplog.handler)
    try:
        cfg = parse_args(["--job.config_file", path])
    finally:
        logger.removeHandler(caplog.handler)
    loaded_section = to_dict(cfg)["dataloader"]
    assert {k: loaded_section[k] for k in OLD_DATALOADER_KEYS} == {
        new: v for new, (_, v) in OLD_DATALOADER_KEYS.items()
    }
    assert (cfg.training.seq_len, cfg.training.document_positions) == (64, False)
    read = ", ".join(
        f"training.{old} as dataloader.{new}" for new, (old, _) in OLD_DATALOADER_KEYS.items()
    )
    warnings = {r.getMessage() for r in caplog.records if r.levelname == "WARNING"}
    assert warnings == {f"{path}: old keys read as their new names: {read}"}
    # Every other key of the file loads unchanged (only job.config_file names the file now).
    from titan_core.config.schema import flatten_tables

    in_file = flatten_tables(tomllib.loads(Path(path).read_text()))
    old = {f"training.{old}" for old, _ in OLD_DATALOADER_KEYS.values()}
    loaded = flatten(cfg)
    kept = {k: v for k, v in in_file.items() if k not in old and k != "job.config_file"}
    assert kept and {k: loaded[k] for k in kept} == kept
    # Every key of the release is in the file, and back; keys added since are the only others.
    renamed = {f"dataloader.{new}" for new in OLD_DATALOADER_KEYS}
    assert set(loaded) - set(in_file) == renamed | ADDED_KEYS
    assert set(in_file) - set(loaded) == old
    # What `titan train` saves now lists them under the new keys only.
    saved = tomllib.loads(to_toml(cfg))
    assert saved["dataloader"]["path"] == "/data/corpus.jsonl"
    assert not {old for old, _ in OLD_DATALOADER_KEYS.values()} & set(saved["training"])


@pytest.mark.parametrize(
    "argv, new",
    [
        (["--training.dataset", "c4"], "--dataloader.dataset"),
        (["--training.dataset_path", "/data"], "--dataloader.path"),
        (["--training.dataset-text-field=body"], "--dataloader.text_field"),
        (["--training.data_streams", "4"], "--dataloader.streams"),
        (["--training.dataset_mix", "a=1", "b=1"], "--dataloader.mix"),  # a list
        (["--training.document_masking"], "--dataloader.document_masking"),  # a bool
        (["--training.no-dataset_streaming"], "--dataloader.no_streaming"),  # its no- spelling
        (["--training.no_dataset_shuffle"], "--dataloader.no_shuffle"),
    ],
)
def test_old_dataloader_flags_name_the_new_key(argv: list[str], new: str) -> None:
    assert config_error(argv) == (
        f"unknown option {argv[0].split('=')[0]}; it moved to {new} ({DATALOADER_MOVED})"
    )


def test_old_dataloader_keys_are_refused_by_flow_values_and_forms() -> None:
    from titan_core.config.form import flow_values
    from titan_core.resolve import resolve_job

    with pytest.raises(ConfigError) as err:
        resolve_job("llama3_debugmodel", "", flow_values(None, {"training.dataset_mix": ["a=1"]}))
    assert str(err.value) == (
        f"training.dataset_mix: unknown config key; it moved to dataloader.mix ({DATALOADER_MOVED})"
    )
    with pytest.raises(ConfigError) as err:
        flow_values({"training": {"dataset_path": "/data"}}, None)
    assert str(err.value) == (
        "config.training.dataset_path: no such section or field of the job config; it moved to "
        f"config.dataloader.path ({DATALOADER_MOVED})"
    )
    assert flow_values({"dataloader": {"path": "/data"}}, None) == {"dataloader.path": "/data"}


def test_a_pipeline_run_config_is_its_run_root(tmp_path: Path) -> None:
    """A pipeline run trains with job.dump_folder = its run root: its saved config.toml resumes
    the run in place (``titan train --job.config_file <run>/config.toml``). That what runs share
    (data, the MLflow store) stays under the root is checked on real runs (test_pipeline.py,
    test_pipeline_edges.py)."""
    from titan_core.pipeline.run.config import run_config
    from titan_core.pipeline.run.paths import RunPaths

    root = str(tmp_path / "root")
    cfg = parse_args([*DEBUG, "--job.dump_folder", root, "--job.experiment", "line"])
    paths = RunPaths(root, "line", "run-1")
    job = run_config(cfg, paths, "/tok.tiktoken")
    assert job.job.dump_folder == paths.run_root == f"{root}/line/run-1"
    saved = Path(write(tmp_path, to_toml(job), "config.toml"))
    resumed = parse_args(["--job.config_file", str(saved)])
    assert resumed.job.dump_folder == paths.run_root and resumed.checkpoint.folder == "checkpoint"
    assert "root" not in tomllib.loads(saved.read_text())["storage"]


@dataclasses.dataclass(kw_only=True)
class _Inner:
    """A nested section with a boolean and a list (Slurm has no boolean)."""

    flag: bool = True
    """A switch."""
    sizes: list[int] = dataclasses.field(default_factory=list)
    """Some sizes."""

    def __post_init__(self) -> None:
        if any(size < 0 for size in self.sizes):
            raise ConfigError(f"outer.inner.sizes: expected sizes >= 0, got {self.sizes!r}")


@dataclasses.dataclass(kw_only=True)
class _Outer:
    """A section holding a nested one."""

    name: str = "x"
    """A name."""
    inner: _Inner = dataclasses.field(default_factory=_Inner)
    """The nested section."""


@dataclasses.dataclass(kw_only=True)
class _NestedConfig(JobConfig):
    """JobConfig plus a section whose nested section has a boolean and a list."""

    outer: _Outer = dataclasses.field(default_factory=_Outer)
    """The extra section."""


def test_nested_booleans_and_lists(tmp_path: Path) -> None:
    parse = ConfigManager(_NestedConfig).parse_args
    cfg = parse(["--outer.inner.no_flag", "--outer.inner.sizes", "1", "2"])
    assert isinstance(cfg, _NestedConfig) and cfg.outer.inner == _Inner(flag=False, sizes=[1, 2])
    assert parse(["--outer.inner.no-flag", "--outer.inner.flag"]).outer.inner.flag
    assert parse(["--outer.inner.sizes=3,4"]).outer.inner.sizes == [3, 4]
    for argv, expected in [
        (["--outer.inner.flag=false"], "--outer.inner.flag=false: boolean options are flags; "
         "use --outer.inner.no_flag (or --outer.inner.flag to enable)"),
        (["--outer.no_inner_flag"], "unknown option --outer.no_inner_flag; it moved to "
         "--outer.inner.no_flag"),
        (["--outer.inner_sizes", "1"], "unknown option --outer.inner_sizes; it moved to "
         "--outer.inner.sizes"),
        (["--outer.inner.sizes", "x"], "--outer.inner.sizes: expected a list of values, each "
         "an int, got 'x'"),
        (["--outer.inner.sizes", "-1"], "outer.inner.sizes: expected sizes >= 0, got [-1]"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError) as err:
            parse(argv)
        assert str(err.value) == expected
    path = write(tmp_path, to_toml(cfg))
    assert "[outer.inner]\nflag = false\n" in Path(path).read_text()
    assert parse(["--job.config_file", path]).outer == cfg.outer
    path = write(tmp_path, "[outer.inner]\nflag = 1\n")
    with pytest.raises(ConfigError, match=r"outer\.inner\.flag: expected true or false, got 1$"):
        parse(["--job.config_file", path])


def test_help_shows_each_docstring_as_one_paragraph(capsys, monkeypatch) -> None:
    from itertools import pairwise

    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as info:
        parse_args(["--help"])
    assert info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(next(line for line in lines if "--job.dump-folder STR" in line))
    end = lines.index(next(line for line in lines if "--job.description STR" in line))
    # job.dump_folder's docstring spans four source lines: one paragraph, wrapped by the
    # terminal only. A kept line break shows as a line that the next word would have fit on.
    inner = [line[1:-1] for line in lines[start + 1 : end]]
    text = " ".join(" ".join(inner).split())
    assert text.startswith("Output root, a folder") and "the default MLflow store" in text
    room = len(inner[0]) - 1  # the box's width, less its right padding
    for line, after in pairwise(inner):
        assert len(line.rstrip()) + 1 + len(after.split()[0]) > room, (line, after)
