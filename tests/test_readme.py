"""Every command of the README's "Commands" table runs, as written, at tiny scale; the README stays short,
starts with CI's own test command, and every link in it and in docs/ reaches a file and a heading;
docs/training.md's Python example runs; every results README's commands build the setting it records.

The commands are read from README.md itself (so a new row without a tiny form here fails), in the
table's order, in a fresh working directory, as a new user would type them after the demo. Only the
scale changes: ``llama-tiny`` on the built-in corpus (``--data c4`` needs the hub), a 512-token BPE,
32-token sequences, a few updates; layers and steps that do not exist at that scale are mapped onto
the tiny model (``--capture-layers 0,4,7`` -> ``0,3``). The placeholders are filled the way the README
means them: ``DIR`` is the run (or prepared directory) the previous command of the row wrote,
``PATHS`` a small ``.jsonl`` corpus and ``NAME_OR_DIR`` a saved tokenizer directory.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from meqmuon.cli import main
from meqmuon.train.corpus import builtin_documents
from meqmuon.train.tokenizer import train_bpe

REPO = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    """The ``meqmuon ...`` commands of the README's Commands table, in order."""
    table = (REPO / "README.md").read_text().split("\n## Commands\n", 1)[1].strip().split("\n\n", 1)[0]
    rows = table.splitlines()[2:]
    return [c for row in rows for c in re.findall(r"`(meqmuon [^`]*)`", row.strip().strip("|").split("|")[-1])]


def _set(args: list[str], flag: str, value: str | None = None) -> None:
    """Give ``flag`` the value ``value`` (or add the bare flag), replacing what the command had."""
    if flag in args:
        i = args.index(flag)
        if value is not None:
            args[i + 1] = value
        return
    args += [flag] if value is None else [flag, value]


def tiny(argv: list[str], ctx: dict[str, str]) -> list[str]:
    """The tiny-scale form of one README command (see the module docstring)."""
    cmd, args = argv[0], [a for a in argv[1:] if a != "..."]
    sub = args[0] if cmd == "diagnose" else None
    args = [ctx["DIR"] if a == "DIR" else ctx["PATHS"] if a == "PATHS" else ctx["NAME_OR_DIR"]
            if a == "NAME_OR_DIR" else a for a in args]
    if cmd in ("train", "compare", "sweep"):
        for flag, value in (("--model", "llama-tiny"), ("--steps", "2"), ("--vocab-size", "512"), ("--seq-len", "32"),
                            ("--global-batch", "8"), ("--val-tokens", "256"), ("--cache-dir", ctx["cache"])):
            _set(args, flag, value)
        _set(args, "--quiet")
        if "--data" not in args or args[args.index("--data") + 1] == "c4":
            _set(args, "--data", "builtin")
    if cmd == "train":
        if "--out" not in args:
            ctx["runs"] = str(int(ctx.get("runs", "0")) + 1)
            _set(args, "--out", str(Path(ctx["tmp"]) / f"run{ctx['runs']}"))
        elif args[args.index("--out") + 1] == ctx["DIR"]:  # a run the next command reads: a fresh DIR
            ctx["DIR"] = str(Path(ctx["tmp"]) / "captured")
            _set(args, "--out", ctx["DIR"])
        if "--capture-steps" in args:
            _set(args, "--capture-steps", "1,2")
            _set(args, "--capture-layers", "0,3")
    if cmd == "sweep":  # 2 lrs x 1 seed per optimizer is enough to run the table's code
        _set(args, "--lrs", ",".join(args[args.index("--lrs") + 1].split(",")[:2]))
        _set(args, "--seeds", "0")
    if sub == "ns-trajectory":
        _set(args, "--layer", "3")
    if sub == "selection":  # Table 6 reads a MeqMuon run's selection counts: the Table 2 run
        _set(args, "--run", str(Path(ctx["tmp"]) / "run1"))
    if cmd == "ablation":
        for flag, value in (("--steps", "2"), ("--seq-len", "32"), ("--batch", "8"),
                            ("--out", str(Path(ctx["tmp"]) / "ablation"))):
            _set(args, flag, value)
        args += ["--set", "vocab_size=512", "--set", "val_tokens=256", "--set", f"cache_dir={ctx['cache']}"]
    if cmd == "prepare":
        ctx["DIR"] = str(Path(ctx["tmp"]) / "prepared")
        _set(args, "--out", ctx["DIR"])
        _set(args, "--quiet")
    if cmd == "plot":  # the shell expands the README's pattern
        args = [m for a in args for m in (sorted(glob.glob(a)) if glob.has_magic(a) else [a])]
    return [cmd, *args]


def test_every_readme_command_runs_at_tiny_scale(tmp_path, monkeypatch, capsys):
    commands = readme_commands()
    assert {shlex.split(c)[1] for c in commands} >= {"train", "compare", "sweep", "plot", "diagnose", "memory",
                                                     "ablation", "prepare"}
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    docs = builtin_documents()[:300]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    train_bpe(docs, vocab_size=512).save(tmp_path / "tokenizer")
    ctx = {"cache": str(tmp_path / "cache"), "tmp": str(tmp_path), "DIR": "DIR", "PATHS": str(corpus),
           "NAME_OR_DIR": str(tmp_path / "tokenizer")}
    for command in commands:
        argv = tiny(shlex.split(command)[1:], ctx)
        code = main(argv)
        assert code == 0, (command, argv, capsys.readouterr().err[-2000:])
    # What the commands left: the demo's layout, a titled plot next to it, and the analysis outputs.
    assert sorted(p.name for p in Path("runs/compare").iterdir() if p.is_dir()) == ["adamw", "meqmuon", "muon",
                                                                                   "normuon"]
    assert Path("runs/compare/val_ppl-adamw-meqmuon-muon-normuon.png").is_file()
    captured = Path(ctx["tmp"]) / "captured"
    assert (captured / "imbalance.md").is_file() and (captured / "ns_trajectory_layer3_step1.png").is_file()
    assert (tmp_path / "run1" / "selection.md").is_file() and (tmp_path / "ablation" / "ablation.md").is_file()
    assert json.loads((tmp_path / "prepared" / "manifest.json").read_text())["complete"] is True


def python_blocks(path: Path) -> list[str]:
    """The ```python blocks of a markdown file, in order."""
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_training_md_python_example_runs_at_tiny_scale(tmp_path, monkeypatch):
    """docs/training.md's Python API example (it once failed with ``NameError: Path``), as written, with its
    runs shrunk to 2 updates of the tiny settings: ``TrainConfig`` and ``demo_config`` are swapped for ones
    that add them, so the block's own imports, calls and names are what run."""
    import dataclasses

    from meqmuon.train import compare as compare_mod
    from meqmuon.train import config as config_mod

    (block,) = python_blocks(REPO / "docs" / "training.md")
    tiny_settings = dict(steps=2, seq_len=32, global_batch=8, vocab_size=512, val_tokens=256,
                         cache_dir=str(tmp_path / "cache"), quiet=True)
    real = config_mod.TrainConfig
    monkeypatch.setattr(config_mod, "TrainConfig", lambda **kw: real(**{**kw, **tiny_settings}))
    demo = compare_mod.demo_config
    monkeypatch.setattr(compare_mod, "demo_config", lambda: dataclasses.replace(demo(), **tiny_settings))
    monkeypatch.chdir(tmp_path)
    names: dict = {}
    exec(compile(block, "docs/training.md", "exec"), names)
    assert names["summary"] and {s["optimizer"] for s in names["summary"]} == {"adamw", "meqmuon"}
    assert Path("runs/demo/summary.json").is_file() and len(names["rows"]) == 6


#: Tokenizer fingerprints the results READMEs record, and the vocabulary each was built with (pysrc-600's
#: 4,096-id BPE; horizon-micro's 1,280-id one), as their prepared directories' manifests say.
PYSRC_BPE = {"bpe-bbf99ebf7fd36a20": 4096, "bpe-f51df48fa96b38c2": 1280}


def results_commands(readme: Path) -> list[list[str]]:
    """The ``meqmuon`` commands of a results README's ```bash blocks (continuation lines joined)."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line.split(" #")[0], comments=True)
            if "meqmuon" in words:
                out.append(words[words.index("meqmuon") + 1:])
    return out


def test_results_readmes_commands_build_their_recorded_setting():
    """Each results README's ``prepare --data pysrc`` builds the tokenizer it records (the vocabulary of its
    fingerprint, and of its "N ids"), and its runs' ``--model`` has that vocabulary by default, so the
    model the commands build is the one the README describes (issue 46: horizon-micro's command built a
    4,096-id tokenizer and, from it, a 4,096-row llama-micro). Parses the commands; tokenises nothing."""
    from meqmuon.cli import build_parser
    from meqmuon.train.config import model_run_defaults

    parser = build_parser()
    readmes = sorted((REPO / "docs" / "results").glob("*/README.md"))
    checked = 0
    for readme in readmes:
        text = readme.read_text()
        commands = [c for c in results_commands(readme) if c and "<the" not in " ".join(c)]
        prepared = {}
        for argv in commands:
            if argv[0] == "prepare" and argv[argv.index("--data") + 1] == "pysrc":
                args = parser.parse_args(argv)
                prepared[args.out] = args.vocab_size
        fingerprints = set(re.findall(r"bpe-[0-9a-f]{16}", text))
        # a README of one setting prepares its one tokenizer; one over several settings (field-2026) each of them
        assert set(prepared.values()) == {PYSRC_BPE[f] for f in fingerprints} or not fingerprints, (
            readme, fingerprints, prepared)
        for argv in commands:
            if argv[0] in ("train", "sweep", "compare") and "--data" in argv:
                data = argv[argv.index("--data") + 1]
                if data in prepared:
                    model = argv[argv.index("--model") + 1]
                    assert model_run_defaults(model)["vocab_size"] == prepared[data], (readme, model, data)
                    checked += 1
        for ids in re.findall(r"BPE with \**([\d,]+) ids", text):
            assert int(ids.replace(",", "")) in set(prepared.values()), (readme, ids, prepared)
    assert checked >= 3  # pysrc-600, ns-methods-600 and horizon-micro each have one run command at least


#: Issue 46: a README a newcomer reads in two minutes.
README_MAX_LINES = 180


def test_readme_is_short_and_runs_ci_own_test_command():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line and not line.startswith(("#", "set ", "cd "))]
    # the README's test command first, then CI's own checks of the built package (.ci/package.sh, .ci/torchtitan.sh)
    assert ci[0].endswith("python3 -m pytest -q") and all(c.startswith(".ci/") for c in ci[1:]), ci
    # the README's first code block is the set-up: a venv, the demo, then CI's test command verbatim
    first = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in first.splitlines()][1:] == [
        "./scripts/install.sh train && meqmuon compare", ci[0]]


def test_readme_counts_the_suites_tests(request):
    """The README's "~N tests" is within 10 % of what pytest collects (it said ~1,300 while 1,894 passed). In a
    session that collected the whole suite the count is the session's; otherwise the suite is collected in a
    subprocess (~15 s)."""
    (stated,) = re.findall(r"~([\d,]+) tests", (REPO / "README.md").read_text())
    files = {p.name for p in (REPO / "tests").glob("test_*.py")}
    items, option = request.session.items, request.config.option
    if {Path(str(i.path)).name for i in items} >= files and not (option.keyword or option.markexpr):
        collected = len(items)
    else:
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              str(REPO / "tests")], cwd=REPO, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}).stdout
        collected = int(re.search(r"(\d+) tests? collected", out).group(1))
    assert abs(int(stated.replace(",", "")) - collected) <= 0.1 * collected, (stated, collected)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_reach_a_file_and_a_heading():
    """Every relative link of the README and of docs/ names a file of the repository, and its ``#anchor`` a
    heading there."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    checked = 0
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = page.parent / path if path else page
            assert target.exists(), (page.name, link)
            if anchor and target.is_file():
                headings = [line.lstrip("#") for line in target.read_text().splitlines() if line.startswith("#")]
                assert anchor in {_slug(h) for h in headings}, (page.name, link)
            checked += 1
    assert checked > 20


def test_slug_is_githubs():
    assert _slug(" The demo: `meqmuon compare` wall time and losses") == "the-demo-meqmuon-compare-wall-time-and-losses"
    assert _slug(" Training at scale: DDP, `--fsdp`, `--tp N`") == "training-at-scale-ddp---fsdp---tp-n"
    assert _slug(" GPU (`benchmarks/gpu.py`)") == "gpu-benchmarksgpupy"
