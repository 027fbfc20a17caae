"""Every kind of bad input through the real CLI entry point (`relpos_ablate.cli.main`), as one
table: `train --set` / `train --config` (bad values, unknown keys with "did you mean", wrong types,
out-of-range, contradictions, several problems at once, unreadable files, a grid spec, a run dir
that is a file), `grid` (bad specs and flags, a run config), `status`, `collect`, `table`, `plot`
(bad options, no finished runs, unknown metric, a bias curve of a run without a bias) and argparse's
own errors. Each must exit with status 2, print one line per problem starting with "error:" and
naming the field (no traceback), and launch nothing. Also: `status` and `grid` say that their metric
column is the last training batch's.
Run: pytest tests/test_bad_input.py -q   (about 10 s)
"""

import json

import pytest
import yaml

from fixtures.report_runs import make_grid, make_run
from fixtures.runner import tiny_base
from relpos_ablate.cli import main
from relpos_ablate.config import RunConfig, from_dict
from relpos_ablate.io import atomic_write_json
from relpos_ablate.train.run import train_run

TRAIN = ["train", "--config", "{cfg}", "--run-dir", "{tmp}/run"]
GRID = ["grid", "{spec}", "--results", "{tmp}/results"]


def sets(*pairs):
    return [*TRAIN, *[item for pair in pairs for item in ("--set", pair)]]


def spec(**changes):
    """`grid` on a valid tiny spec with `changes` merged in at the top level."""
    return ["grid", ("spec", changes), "--results", "{tmp}/results"]


def base_with(**sections):
    """The tiny base run config with some fields of its sections replaced."""
    base = tiny_base()
    for section, fields in sections.items():
        base[section].update(fields)
    return base


SEVERAL_BAD = (
    "model: {dropout: '0', n_layers: 0, attention: {bias: foo}}\ntrain: {max_steps: "
    "150.5, lr: -1}\n"
)
SEVERAL_BAD_LINES = (
    "model.n_layers: 0 is out of range",
    "model.dropout: expected a number, got '0'",
    "model.attention.bias: 'foo' is not registered",
    "train.max_steps: expected an integer, got 150.5",
    "train.lr: -1.0 is out of range",
)

# (argv, a phrase of the error, or a tuple: one phrase per expected line). Placeholders: {tmp} a
# scratch dir, {cfg} a valid run config, {spec} a valid grid spec, {runs} a dir of finished runs,
# {none} a dir with no finished run, {nobias} a trained run without any bias, {bin} a binary file,
# {dir} a directory.
BAD_INPUTS = [
    # train --set: values
    (sets("model.d_model=-1"), "model.d_model: -1 is out of range; allowed [1, inf]"),
    (sets("model.n_heads=abc"), "model.n_heads: expected an integer, got 'abc'"),
    (sets("model.dropout=1.5"), "model.dropout: 1.5 is out of range; allowed [0.0, 1.0]"),
    (sets("model.mem_len=-1"), "model.mem_len: -1 is out of range"),
    (sets("model.n_layers=0"), "model.n_layers: 0 is out of range"),
    (
        sets("model.attention.terms=xyz"),
        "model.attention.terms: 'xyz' has 'x'; only the letters a, b, c, d",
    ),
    (
        sets("model.attention.bias=foo"),
        "model.attention.bias: 'foo' is not registered; registered: none",
    ),
    (sets("model.attention.clamp_len=-1"), "model.attention.clamp_len: -1 is out of range"),
    (sets("train.lr=-1"), "train.lr: -1.0 is out of range; allowed [0.0, inf]"),
    (sets("train.lr=nan"), "train.lr: expected a number, got 'nan'"),
    (sets("train.lr=[1]"), "train.lr: expected a number, got [1]"),
    (sets("train.max_steps=0"), "train.max_steps: 0 is out of range"),
    (sets("train.max_steps=1e3"), "train.max_steps: expected an integer, got 1000.0"),
    (sets("train.batch_size=true"), "train.batch_size: expected an integer, got True"),
    (sets("train.precision=8"), "train.precision: expected a string, got 8"),
    (
        sets("train.accelerator=tpu"),
        "train.accelerator: 'tpu' is not allowed; choose one of auto, cpu, gpu",
    ),
    (sets("train.segment_len=0"), "train.segment_len: 0 is out of range"),
    (sets("train.grad_clip=-1"), "train.grad_clip: -1.0 is out of range"),
    (sets("train.warmup_steps=-1"), "train.warmup_steps: -1 is out of range"),
    (sets("train.log_every=0"), "train.log_every: 0 is out of range"),
    (sets("data.source=foo"), "data.source: 'foo' is not allowed; choose one of synthetic, text"),
    (
        sets("data.task=foo"),
        "data.task: 'foo' is not allowed; choose one of offset_copy, recall, repeat",
    ),
    (
        sets("data.tokenizer=wordpiece"),
        "data.tokenizer: 'wordpiece' is not allowed; choose one of char, byte, word, bpe, file",
    ),
    (
        sets("data.source=text", "data.corpus=wiki"),
        "data.corpus: 'wiki' is not allowed; choose one of tinyshakespeare, wikitext-2",
    ),
    (sets("data.num_symbols=1"), "data.num_symbols: 1 is out of range; allowed [2, inf]"),
    (sets("eval.split=foo"), "eval.split: 'foo' is not allowed; choose one of valid, test"),
    (sets("eval.settings=[{segment_len: 0}]"), "eval.settings[0].segment_len: 0 is out of range"),
    (sets("seed=-1"), "seed: -1 is out of range"),
    (sets("seed=1.5"), "seed: expected an integer, got 1.5"),
    # train --set: unknown keys, malformed overrides, contradictions
    (sets("model.d_modle=32"), "model.d_modle: unknown key; did you mean 'd_model'?"),
    (
        sets("eval.settings=[{segmnt_len: 4}]"),
        "eval.settings[0].segmnt_len: unknown key; did you mean 'segment_len'?",
    ),
    (sets("foo=1"), "foo: unknown key; allowed: model, data, train, eval, seed"),
    (sets("model=3"), "model: expected a mapping of fields, got 3"),
    (sets("nokey"), "--set: expected KEY=VALUE, got 'nokey'"),
    (sets("=3"), "--set: '=3' has an empty key"),
    (
        sets("train.loggers=[csv,", "eval.settings=[{segment_len: 32"),
        (
            "train.loggers: '[csv,' is not valid YAML",
            "eval.settings: '[{segment_len: 32' is not valid YAML",
        ),
    ),
    (
        sets("encoding=alibi"),
        "encoding: a grid spec word, not a run config key: in a grid spec `encoding: alibi` sets "
        "model.attention.terms=a, model.attention.absolute=none, model.attention.bias=alibi; with "
        "train use those",
    ),
    (
        sets("data.offset=100"),
        "data.offset: 100 leaves no target inside a segment; use < train.segment_len (16)",
    ),
    (sets("data.source=text"), "data.corpus: source='text' needs a corpus name or a train_file"),
    (
        sets("data.source=text", "data.corpus=text8", "data.train_file=x.txt"),
        "corpus: set either a corpus name or a train_file",
    ),
    (
        sets("data.source=text", "data.corpus=text8", "data.valid_file=v.txt"),
        "data.valid_file: local valid/test files go",
    ),
    (
        sets("data.train_file=x.txt"),
        "data.train_file: is read only with source='text' (source is 'synthetic')",
    ),
    (
        sets("eval.settings=[{mem_len: 4}]"),
        "eval.settings[0].segment_len: missing; this field has no default",
    ),
    # several problems in one config: every one reported, one line each
    (
        sets('model.dropout="0"', "train.max_steps=150.5"),
        (
            "model.dropout: expected a number, got '0'",
            "train.max_steps: expected an integer, got 150.5",
        ),
    ),
    (
        sets(
            "model.dropout=1.5",
            "model.n_layers=0",
            "model.attention.bias=x",
            "model.attention.backend=y",
        ),
        (
            "model.n_layers: 0 is out of range",
            "model.dropout: 1.5 is out of range",
            "model.attention.bias: 'x' is not registered",
            "model.attention.backend: 'y' is not allowed",
        ),
    ),
    (["train", "--config", ("file", SEVERAL_BAD), "--run-dir", "{tmp}/run"], SEVERAL_BAD_LINES),
    # train: files and flags
    (
        ["train", "--config", "{tmp}/missing.yaml", "--run-dir", "{tmp}/run"],
        "missing.yaml: file not found",
    ),
    (["train", "--config", "{bin}", "--run-dir", "{tmp}/run"], "garbage.bin: not a text file"),
    (
        ["train", "--config", "{dir}", "--run-dir", "{tmp}/run"],
        "is a directory; expected a YAML file",
    ),
    (
        ["train", "--config", ("file", "model: {d_model: 3\n"), "--run-dir", "{tmp}/run"],
        "not valid YAML",
    ),
    (
        ["train", "--config", ("file", "- 1\n- 2\n"), "--run-dir", "{tmp}/run"],
        "expected a mapping at the top level",
    ),
    (["train", "--run-dir", "{tmp}/run"], "--config: not given and"),
    (
        ["train", "--config", "{spec}", "--run-dir", "{tmp}/run"],
        "{spec}: a grid spec, not a run config; run it with: relpos-ablate grid {spec}",
    ),
    ([*TRAIN[:3], "--run-dir", "{bin}"], "--run-dir: {bin} is a file; give a directory"),
    ([*TRAIN[:3], "--run-dir", "{bin}/run"], "--run-dir: {bin}/run lies under the file {bin}"),
    ([*TRAIN, "--threads", "0"], "--threads: 0 is not allowed; use 1 or more"),
    ([*TRAIN, "--threads", "x"], "argument --threads: invalid int value: 'x'"),
    ([*TRAIN, "--bogus"], "unrecognized arguments: --bogus"),
    # grid: specs
    (spec(grdi={}), "grdi: unknown spec key; did you mean 'grid'?"),
    (
        spec(grid={"encoding": ["xl", "kerpel_log"]}),
        "grid.encoding: unknown encoding 'kerpel_log'; did you mean 'kerple_log'?",
    ),
    (spec(grid={"model.atention.terms": ["a"]}), "grid.model.atention.terms"),
    (spec(grid={"model.mem_len": []}), "grid.model.mem_len: empty axis"),
    (spec(grid={"model.mem_len": [-1]}), "model.mem_len: -1 is out of range"),
    (spec(seeds="x"), "seeds: expected a list of values, got 'x'"),
    (spec(seeds=[0, -1]), "seed: -1 is out of range"),
    (spec(name="a b"), "name"),
    (spec(base="nothere.yaml"), "nothere.yaml: file not found"),
    (spec(base={"model": {"d_modle": 32}}), "model.d_modle: unknown key; did you mean 'd_model'?"),
    (
        spec(base=base_with(model={"dropout": "0"}, train={"max_steps": 150.5})),
        (
            "model.dropout: expected a number, got '0'",
            "train.max_steps: expected an integer, got 150.5",
        ),
    ),
    (spec(model={"d_model": 32}), "model: unknown spec key; a run config's key goes under base:"),
    (
        spec(imports=["my_schemes"]),
        "imports: unknown spec key; a run config's key goes under base:",
    ),
    (
        ["grid", "{cfg}", "--results", "{tmp}/results"],
        "{cfg}: a run config, not a grid spec; train it with: relpos-ablate train --config "
        "{cfg} --run-dir DIR",
    ),
    (
        spec(launcher={"partiton": "gpu"}),
        "launcher.partiton: unknown key; did you mean 'partition'?",
    ),
    (spec(exclude=[{"encoding": "xl"}]), "exclude[0].encoding"),
    (["grid", "{tmp}/missing.yaml"], "missing.yaml: file not found"),
    (["grid", "{bin}"], "garbage.bin: not a text file"),
    # grid: flags
    ([*GRID, "--slots", "0"], "--slots: 0 is out of range"),
    (
        [*GRID, "--devices", "0", "--slots", "2"],
        "--devices (GPUs) and --slots (CPU) exclude each other",
    ),
    ([*GRID, "--devices", "a,b"], "--devices: 'a,b': give GPU numbers"),
    ([*GRID, "--account", "lab"], "--account: only with --launcher slurm"),
    ([*GRID, "--launcher", "k8s"], "argument --launcher: invalid choice: 'k8s'"),
    (["grid", "{spec}", "--results", "{bin}"], "--results: {bin} is a file"),
    (
        ["grid", "{spec}", "--results", "{bin}/results"],
        "--results: {bin}/results lies under the file {bin}",
    ),
    # status / collect / table / plot
    (["status", "{tmp}/missing"], "missing: no run directories found"),
    (["collect", "{tmp}/missing"], "missing: not a directory"),
    (
        ["collect", "{runs}", "--out", "{tmp}/x.json"],
        "--out: '.json' is not supported; use .csv or .parquet",
    ),
    (["table", "{none}"], "no finished runs with metrics (1 failed)"),
    (
        ["table", "{runs}", "--metric", "bleu"],
        "metric: 'bleu' is not a metric of these runs; available: ppl",
    ),
    (["table", "{runs}", "--rows", "encodng"], "rows: 'encodng' is not a config field"),
    (
        ["table", "{runs}", "--baseline", "zz"],
        "baseline: 'zz' is not a row label; rows are: alibi; xl",
    ),
    (
        ["table", "{runs}", "--rows", "segment_len", "--cols", "segment_len"],
        "cannot be both a row and a column",
    ),
    (["table", "{runs}", "--format", "html"], "argument --format: invalid choice: 'html'"),
    (["table", "{runs}", "--out", "{tmp}/t.xlsx"], "--out: '.xlsx' does not say the format"),
    (["plot", "{none}", "--kind", "extrapolation"], "no finished runs with metrics (1 failed)"),
    (
        ["plot", "{runs}", "--kind", "extrapolation", "--metric", "bleu"],
        "metric: 'bleu' is not a metric",
    ),
    (
        ["plot", "{runs}", "--kind", "bias", "--formats", "gif"],
        "--formats: gif not allowed; choose from png, pdf, svg",
    ),
    (["plot", "{runs}", "--kind", "bogus"], "argument --kind: invalid choice: 'bogus'"),
    (["plot", "{nobias}", "--kind", "bias"], "has no bias curve: bias='none' and term d is off"),
    (["plot", "{tmp}/missing", "--kind", "bias"], "missing: not a directory"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
]


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """The files and dirs the placeholders stand for (the trained no-bias run is built once)."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "cfg.yaml").write_text(yaml.safe_dump(tiny_base()))
    (root / "spec.yaml").write_text(
        yaml.safe_dump({"name": "g", "base": tiny_base(), "grid": {"encoding": ["xl"]}})
    )
    (root / "garbage.bin").write_bytes(bytes(range(128, 256)) * 4)
    (root / "adir").mkdir()
    make_grid(root / "runs", {("xl", 0): [3.0, 4.0], ("alibi", 0): [2.0, 3.0]})
    make_run(root / "none", ["seed=0"], state="failed")
    config = tiny_base(2)
    config["model"]["attention"] = {"terms": "a"}
    assert train_run(from_dict(RunConfig, config), root / "nobias") == "done"
    return {
        "cfg": root / "cfg.yaml",
        "spec": root / "spec.yaml",
        "bin": root / "garbage.bin",
        "dir": root / "adir",
        "runs": root / "runs",
        "none": root / "none",
        "nobias": root / "nobias",
    }


def resolve(argv, places, tmp_path) -> list[str]:
    """Fill in the placeholders; ("spec", changes) and ("file", text) become files under
    tmp_path."""
    out = []
    for i, item in enumerate(argv):
        if isinstance(item, tuple) and item[0] == "spec":
            path = tmp_path / "bad_spec.yaml"
            path.write_text(yaml.safe_dump({"name": "g", "base": tiny_base(), **item[1]}))
            item = str(path)
        elif isinstance(item, tuple):
            path = tmp_path / f"file{i}.yaml"
            path.write_text(item[1])
            item = str(path)
        out.append(fill(item, places, tmp_path))
    return out


def fill(text: str, places, tmp_path) -> str:
    for name, value in {"tmp": tmp_path, **places}.items():
        text = text.replace("{" + name + "}", str(value))
    return text


def argv_is_spec(argv) -> bool:
    return isinstance(argv[1], tuple) and argv[1][0] == "spec"


def run_cli(argv, capsys) -> tuple[int, list[str]]:
    """Exit status and stderr lines of the real entry point (argparse errors exit through
    SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(
    "argv, phrases", BAD_INPUTS, ids=[f"{i:02d}" for i in range(len(BAD_INPUTS))]
)
def test_bad_input_is_one_line_per_problem_exit_2_and_nothing_launched(
    argv, phrases, places, tmp_path, capsys
):
    phrases = [
        fill(phrase, places, tmp_path)
        for phrase in ((phrases,) if isinstance(phrases, str) else phrases)
    ]
    code, lines = run_cli(resolve(argv, places, tmp_path), capsys)
    assert code == 2, lines
    assert lines and all(line.startswith("error: ") for line in lines), lines
    assert not any("Traceback" in line for line in lines)
    # a bad spec: a count first
    problems = [line for line in lines if "problem(s) in the grid spec" not in line]
    assert len(problems) == len(phrases), lines
    for phrase, line in zip(phrases, problems):
        assert phrase in line, (phrase, lines)
    assert not (tmp_path / "results").exists() and not (tmp_path / "run" / "status.json").exists()


def test_the_table_is_big_enough_and_covers_every_command():
    assert len(BAD_INPUTS) >= 40
    assert {argv[0] for argv, _ in BAD_INPUTS} >= {
        "train",
        "grid",
        "status",
        "collect",
        "table",
        "plot",
    }


def test_the_entry_point_in_a_fresh_process_prints_no_traceback(places, tmp_path):
    """The same through `python -m relpos_ablate`, for one error of each layer (config, spec,
    argparse)."""
    import subprocess
    import sys

    for argv, phrase in (
        BAD_INPUTS[0],
        next(case for case in BAD_INPUTS if argv_is_spec(case[0])),
        BAD_INPUTS[-1],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "relpos_ablate", *resolve(argv, places, tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert (
            result.returncode == 2 and phrase in result.stderr and "Traceback" not in result.stderr
        )


def test_status_and_grid_say_the_metric_is_the_last_training_batchs(tmp_path, capsys):
    """status.json's last_metric is what the last training batch logged, not an evaluation
    result."""
    run_dir = make_run(tmp_path, ["seed=0"], state="running")
    status = json.loads((run_dir / "status.json").read_text())
    atomic_write_json(
        run_dir / "status.json", {**status, "last_metric": {"loss": 2.5, "acc": 0.25}}
    )
    assert main(["status", str(tmp_path / "demo")]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = (
        next(line for line in lines if key in line) for key in ("last train batch", run_dir.name)
    )
    column = header.index("last train batch")
    assert row[column:].startswith("loss 2.5 acc 0.25")
