"""The checkpoint-3 Snakemake pipeline: DAG, lint, profiles, aggregation rules, end to end.

The end-to-end test runs a reduced matrix (two cells: the naive control and continuous
batching, one repetition, a few short requests) through the real `llmserve benchmark` in a
temporary copy of the workflow, then checks the summary table, the checksum file
(`sha256sum -c`), that a second dry run has nothing to do, and that editing only the
aggregation script reruns aggregation but no benchmark cell.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "workflow" / "scripts"

pytest.importorskip("snakemake")
pytest.importorskip("pandas")


def snakemake(*args: str, cwd: Path = ROOT, timeout: int = 300,
              env: dict | None = None) -> subprocess.CompletedProcess:
    """Run Snakemake in `cwd`; stdout and stderr merged into `.stdout`."""
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                          env=env)


def script(name: str, *args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], cwd=cwd, text=True,
                          capture_output=True, timeout=120)


def job_counts(dry_run_output: str) -> dict[str, int]:
    """`{rule: count}` from the "Job stats" table of a dry run."""
    counts, in_table = {}, False
    for line in dry_run_output.splitlines():
        if line.startswith("job ") and "count" in line:
            in_table = True
            continue
        if in_table:
            parts = line.split()
            if not parts or parts[0] == "total":
                break
            if len(parts) == 2 and parts[1].isdigit():
                counts[parts[0]] = int(parts[1])
    return counts


# ---------------------------------------------------------------------------------------------
# DAG, lint, profiles (no engine runs)
# ---------------------------------------------------------------------------------------------
def test_dry_run_default_target_is_the_results_folder():
    # --forceall: list every job even when the committed results are up to date.
    r = snakemake("-n", "--nolock", "--forceall", "-p", "results/checkpoint3")
    assert r.returncode == 0, r.stdout
    counts = job_counts(r.stdout)
    groups = {k: v for k, v in counts.items() if k.startswith("benchmark_")}
    assert len(groups) >= 9 and set(groups.values()) == {1}, counts  # sweeps x repetitions
    assert {k.rsplit("_rep", 1)[1] for k in groups} == {"0", "1", "2"}, groups
    for rule in ("aggregate", "plots", "checksums", "results/checkpoint3"):
        assert counts.get(rule) == 1, (rule, counts)
    assert "scheduler~naive_policy~fcfs_batch~1_chunk~0" in r.stdout  # the groups' cell specs


def test_job_log_lines_name_the_cells_not_their_files():
    """Each job's line in Snakemake's output is its message (rule, profile, cells), never the
    list of its input and output files."""
    r = snakemake("-n", "--nolock", "--forceall", "results/checkpoint3", "results/checkpoint4")
    assert r.returncode == 0, r.stdout
    lines = r.stdout.splitlines()
    jobs = [ln for ln in lines if ln.startswith("Job ") and ":" in ln and "stats" not in ln]
    assert any(ln.split(": ", 1)[1].startswith("benchmark_main_rep0 (cpu, 8 cells") for ln in jobs), jobs
    assert any("tables from" in ln for ln in jobs) and any("quantize-eval" in ln for ln in jobs)
    assert not any(ln.lstrip().startswith(("input:", "output:")) for ln in lines), r.stdout[-2000:]
    assert max(map(len, jobs)) < 400, max(jobs, key=len)


def test_every_rule_is_named_in_the_workflow_sources():
    """A rule name in the log can be found with grep: literal rule names, and the generated
    benchmark rules' common prefix with their pattern spelled out beside it."""
    r = snakemake("--list-rules", "--nolock", "--config", "profile=h200")
    assert r.returncode == 0, r.stdout
    names = [ln.split()[0] for ln in r.stdout.splitlines()
             if ln and not ln.startswith((" ", "Using", "Assuming", "Config"))]
    sources = "\n".join(p.read_text() for p in [ROOT / "workflow" / "Snakefile",
                                                *sorted((ROOT / "workflow" / "rules").glob("*.smk"))])
    assert "benchmark_all" in names, names       # the h200 profile runs the matrix in one process
    for name in names:
        if name.startswith("benchmark_"):
            assert all(f"benchmark_{p}" in sources for p in ("<sweep>_rep<N>", "rep<N>", "all"))
        elif name.startswith("structured_rep") or name == "structured_all":
            assert "structured_rep<N>" in sources and "structured_all" in sources
        elif name.startswith("prefix_cells_"):
            assert "prefix_cells_rep<N>" in sources and "prefix_cells_all" in sources
        elif name.startswith("timeline_"):
            assert "timeline_<name>" in sources
        elif name.startswith("results/"):
            assert f'"{name}"' in sources, name
        else:
            assert f"rule {name}:" in sources, name


def test_group_cells_by_all_runs_every_repetition_in_one_process():
    """`group_cells_by: all` (the h200 profile's matrix, prefix sweep and structured-output
    cost) plans one process for each of them, holding every repetition, repetition 0's cells
    first; `repetition` plans one process a repetition."""
    r = snakemake("-n", "--nolock", "results/gpu", "--config", "profile=h200")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = job_counts(r.stdout)
    assert {"benchmark_all", "structured_all", "prefix_cells_all"} <= set(jobs), jobs
    assert not any(j.startswith(("benchmark_rep", "structured_rep", "prefix_cells_rep")) for j in jobs), jobs
    r = snakemake("-n", "--nolock", "results/checkpoint3", "--config", "profile=h200",
                  "group_cells_by=repetition")
    assert r.returncode == 0, r.stdout[-3000:]
    jobs = job_counts(r.stdout)
    assert {"benchmark_rep0", "benchmark_rep1", "benchmark_rep2"} <= set(jobs), jobs
    # the one process's spec: every cell of every repetition, repetition 0's first
    r = snakemake("-n", "--nolock", "-p", "results/checkpoint3", "--config", "profile=h200")
    spec = re.search(r"run_cells\.py run --spec '(\{.*?\})'", r.stdout)
    assert spec, r.stdout[-3000:]
    reps = [int(c.rsplit("_rep~", 1)[1]) for c in json.loads(spec.group(1))]
    assert len(reps) == 105 and reps == sorted(reps) and set(reps) == {0, 1, 2}


def test_one_process_groups_ask_a_cluster_for_at_most_a_day():
    """The runtime (minutes) a cluster executor reads is the process's own limit plus start-up,
    capped at 24 h: the h200 matrix in one process (105 cells x 900 s) would sum to ~26 h."""
    text = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    src = text[text.index("def slurm_runtime"):text.index("def run_cells_shell")]
    scope: dict = {}
    exec(src, scope)
    assert scope["slurm_runtime"](105 * 900 + 300) == 24 * 60
    assert scope["slurm_runtime"](2 * 120 + 300) == 20          # two CPU cells, as before


def test_column_table_is_the_schemas_and_the_rules():
    """The matrix's columns are defined once (workflow/scripts/matrix_columns.py): the schema's
    cell and sweep-block definitions name exactly those columns."""
    import yaml

    sys.path.insert(0, str(SCRIPTS))
    try:
        import matrix_columns as mc
    finally:
        sys.path.remove(str(SCRIPTS))
    schema = yaml.safe_load((ROOT / "workflow" / "schemas" / "config.schema.yaml").read_text())
    assert list(schema["$defs"]["cell"]["properties"]) == list(mc.COLUMN_NAMES)
    assert list(schema["$defs"]["block"]["properties"]) == list(mc.COLUMN_NAMES)
    cell = "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default_rep~0"
    assert mc.cell_params(cell)["invariant"] == "off"
    assert mc.cell_params(cell.replace("_rep~", "_invariant~on_rep~"))["invariant"] == "on"


def test_cell_flags_come_from_the_column_table():
    """Every column's benchmark flag is written from its row (workflow/scripts/matrix_columns.py):
    ``--flag value``, a switch's bare flag at ``on``, nothing at the ``unflagged`` value; the
    flag order covers every column once."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import matrix_columns as mc
    finally:
        sys.path.remove(str(SCRIPTS))
    col = {c.name: c for c in mc.COLUMNS}
    assert mc.column_flag(col["batch"], "8") == "--max-batch-size 8"
    assert mc.column_flag(col["rate"], "profile") is None
    assert mc.column_flag(col["rate"], "inf") == "--arrival-rate inf"
    assert mc.column_flag(col["invariant"], "on") == "--batch-invariant"
    assert mc.column_flag(col["invariant"], "off") is None
    with pytest.raises(ValueError):
        mc.column_flag(col["invariant"], "maybe")
    order = [c.name for c in mc.columns_in_flag_order()]
    assert sorted(order) == sorted(mc.COLUMN_NAMES) and order[:len(mc.FLAG_ORDER)] == list(mc.FLAG_ORDER)
    assert all(c.flag.startswith("--") for c in mc.COLUMNS)
    new = mc.Column("spec", "--num-speculative-tokens", "0", "0", "draft tokens", unflagged="0")
    assert mc.column_flag(new, "0") is None and mc.column_flag(new, "4") == "--num-speculative-tokens 4"
    smk = (ROOT / "workflow" / "rules" / "common.smk").read_text()
    body = smk[smk.index("def cell_flags("):smk.index("def group_spec(")]
    assert not [c.flag for c in mc.COLUMNS if c.flag in body], "cell_flags names a column's flag"


def test_rules_run_this_checkouts_engine():
    r = snakemake("-n", "--nolock", "--forceall", "-p", "results/checkpoint3")
    assert r.returncode == 0, r.stdout
    assert "workflow/scripts/run_cells.py run" in r.stdout and "--torch-threads 1" in r.stdout
    assert " llmserve benchmark" not in r.stdout  # never the console script of another install


def test_checkpoint4_plot_script_is_an_input_of_the_plot_rule_only():
    r = snakemake("-n", "--nolock", "--forceall", "--summary", "results/checkpoint4")
    assert r.returncode == 0, r.stdout
    text = (ROOT / "workflow" / "rules" / "checkpoint4.smk").read_text()
    measure = text[text.index("rule quantize_eval:"):text.index("rule quantize_plot:")]
    assert "plot_quantization.py" not in measure


def test_lint_is_clean():
    r = snakemake("--lint", "--nolock")
    assert r.returncode == 0, r.stdout
    assert "Congratulations, your workflow is in a good condition!" in r.stdout, r.stdout


def test_gpu_profile_selected_by_config_and_configfile():
    for sel in (["--config", "profile=h200"], ["--configfile", "config/h200.yaml"]):
        r = snakemake("-n", "--nolock", "-p", "results/checkpoint3", "--forceall", *sel)
        assert r.returncode == 0, r.stdout
        assert "--device cuda" in r.stdout and "results/checkpoint3/h200/raw" in r.stdout
        assert "105 cells, 1 GPU)" in r.stdout  # the one benchmark process declares the GPU
        assert "--max-batch-size 64" in r.stdout and "--paged-attention-backend triton" in r.stdout
        groups = [k for k in job_counts(r.stdout) if k.startswith("benchmark_")]
        assert groups == ["benchmark_all"], groups
        # the cross product scheduler x batch x chunk x linear of the main sweep
        for want in ("scheduler~static_policy~fcfs_batch~64_chunk~512_linear~triton-int8",
                     "scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch"):
            assert want in r.stdout, want


def copy_workflow(dest: Path) -> None:
    """The workflow and its configs (no results, no engine) under ``dest``, to run rules there."""
    for folder in ("workflow", "config"):
        shutil.copytree(ROOT / folder, dest / folder)


@pytest.mark.parametrize("sel", [["--config", "profile=h100"],
                                 ["--configfile", "config/h200.yaml", "--config", "profile=h100"],
                                 ["--configfile", "config/h100.yaml"]])
def test_a_gpu_profile_keeps_its_own_load_overrides(tmp_path, sel):
    """The GPU load profile is derived from the GPU file's overrides alone (prompts up to 2048
    tokens), never merged with the CPU profile's (prompts up to 128), whether the profile is
    named, extended (`extends:`) or given with --configfile."""
    copy_workflow(tmp_path)
    target = "results/checkpoint3/h100/load_profile.yaml"
    r = snakemake("--cores", "1", "--nolock", target, *sel, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    derived = yaml.safe_load((tmp_path / target).read_text())
    assert derived["prompt_len"]["max"] == 2048 and derived["output_len"]["min"] == 4, derived
    assert "(profile h100)" in (tmp_path / target).read_text()


def test_an_extends_loop_is_refused(tmp_path):
    copy_workflow(tmp_path)
    (tmp_path / "config" / "a.yaml").write_text("extends: config/b.yaml\nprofile: a\n")
    (tmp_path / "config" / "b.yaml").write_text("extends: config/a.yaml\nprofile: b\n")
    r = snakemake("-n", "--nolock", "--config", "profile=a", cwd=tmp_path)
    assert r.returncode != 0 and "loops back" in r.stdout, r.stdout[-2000:]
    (tmp_path / "config" / "b.yaml").write_text("extends: config/nope.yaml\nprofile: b\n")
    r = snakemake("-n", "--nolock", "--config", "profile=a", cwd=tmp_path)
    assert r.returncode != 0 and "config/nope.yaml" in r.stdout, r.stdout[-2000:]


def test_a_configfile_goes_on_top_of_a_named_profile(tmp_path):
    """`--configfile FILE --config profile=h200` runs the H200 matrix with FILE's values on top,
    never the CPU matrix under the H200 folder."""
    extra = tmp_path / "reps.yaml"
    extra.write_text("repetitions: 1\n")
    r = snakemake("-n", "--nolock", "-p", "--forceall", "results/checkpoint3", "--resources", "gpu=1",
                  "--configfile", str(extra), "--config", "profile=h200")
    assert r.returncode == 0, r.stdout[-3000:]
    groups = [k for k in job_counts(r.stdout) if k.startswith("benchmark_")]
    assert groups == ["benchmark_all"], groups
    assert "35 cells, 1 GPU)" in r.stdout                # one repetition of the H200 matrix
    assert "--device cuda" in r.stdout and "--device cpu" not in r.stdout


def test_a_bad_profile_file_is_a_clear_error(tmp_path):
    copy_workflow(tmp_path)
    bad = tmp_path / "config" / "bad.yaml"
    for text, want in [("- a\n", "not a list"), ("extends: 5\n", "names a file"),
                       ("a: [1\n", "not valid YAML")]:
        bad.write_text(text)
        r = snakemake("-n", "--nolock", "--config", "profile=bad", cwd=tmp_path)
        assert r.returncode != 0 and want in r.stdout and "Traceback" not in r.stdout, r.stdout[-2000:]


def test_unknown_profile_names_the_known_ones():
    r = snakemake("-n", "--nolock", "--config", "profile=nope")
    assert r.returncode != 0
    assert "config/nope.yaml" in r.stdout and "cpu, h100, h200" in r.stdout


def test_schema_rejects_a_bad_matrix(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sweeps:\n  main:\n    - {scheduler: [warp]}\n")
    r = snakemake("-n", "--nolock", "--configfile", str(bad))
    assert r.returncode != 0 and "warp" in r.stdout
    # the prefix-caching and quantization sections are validated too
    bad.write_text("prefix:\n  model: tiny\n  workloads: [no-such-workload]\n")
    r = snakemake("-n", "--nolock", "--configfile", str(bad))
    assert r.returncode != 0 and "no-such-workload" in r.stdout, r.stdout[-2000:]
    bad.write_text("quantization: {modes: [int3], eval_tokens: 8}\n")
    r = snakemake("-n", "--nolock", "--configfile", str(bad))
    assert r.returncode != 0 and "int3" in r.stdout, r.stdout[-2000:]


def test_prefix_rates_per_workload(tmp_path):
    """``prefix.arrival_rates`` as a mapping gives each workload its own rates (``inf`` allowed);
    a workload it leaves out stops the run with a message naming it."""
    import yaml

    prefix = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["prefix"]
    extra = tmp_path / "rates.yaml"
    extra.write_text(yaml.safe_dump({"prefix": {**prefix, "arrival_rates": {"multi-turn": [2],
                                                                            "shared-prefix": ["inf", 8]}}}))
    r = snakemake("-n", "-p", "--nolock", "--forceall", "results/prefix/cpu/table.md", "--configfile",
                  str(extra))
    assert r.returncode == 0, r.stdout[-3000:]
    cells = set(re.findall(r"workload~([a-z-]+)_caching~on_rate~([0-9a-z.]+)_rep~0\.json", r.stdout))
    assert cells == {("multi-turn", "2"), ("shared-prefix", "inf"), ("shared-prefix", "8")}, cells
    extra.write_text(yaml.safe_dump({"prefix": {**prefix, "arrival_rates": {"multi-turn": [2]}}}))
    r = snakemake("-n", "--nolock", "results/prefix/cpu/table.md", "--configfile", str(extra))
    assert r.returncode != 0 and "no rates for workload 'shared-prefix'" in r.stdout, r.stdout[-2000:]


def test_prefix_invariant_check_cells(tmp_path):
    """``prefix.invariant_check`` adds its workload and rate with caching on and off and
    ``--batch-invariant`` in its first ``repetitions`` repetitions; a workload outside the
    schema's is refused."""
    import yaml

    prefix = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["prefix"]
    extra = tmp_path / "check.yaml"
    extra.write_text(yaml.safe_dump({"prefix": {**prefix, "repetitions": 2, "invariant_check": {
        "workload": "shared-prefix", "rate": "inf", "repetitions": 1}}}))
    r = snakemake("-n", "-p", "--nolock", "--forceall", "results/prefix/cpu/table.md", "--configfile",
                  str(extra))
    assert r.returncode == 0, r.stdout[-3000:]
    checks = set(re.findall(r"workload~([a-z-]+)_caching~(on|off)_rate~([0-9a-z.]+)_invariant~on_rep~(\d)\.json",
                            r.stdout))
    assert checks == {("shared-prefix", "on", "inf", "0"), ("shared-prefix", "off", "inf", "0")}, checks
    flags = re.findall(r'"workload~shared-prefix_caching~on_rate~inf_invariant~on_rep~0": "([^"]*)"', r.stdout)
    assert flags and all("--batch-invariant" in f and "--enable-prefix-caching" in f for f in flags), flags
    assert "_invariant~on" not in "".join(re.findall(r"workload~multi-turn\S*\.json", r.stdout))
    extra.write_text(yaml.safe_dump({"prefix": {**prefix, "invariant_check": {"workload": "chat", "rate": 2}}}))
    r = snakemake("-n", "--nolock", "results/prefix/cpu/table.md", "--configfile", str(extra))
    assert r.returncode != 0 and "chat" in r.stdout, r.stdout[-2000:]
    for bad, words in (({"caching": ["on"]}, "must hold both"),
                       ({"invariant_check": {"workload": "multi-turn", "rate": 2, "repetitions": 3}},
                        "must not exceed")):
        extra.write_text(yaml.safe_dump({"prefix": {**prefix, "invariant_check": {
            "workload": "multi-turn", "rate": 2}, **bad}}))
        r = snakemake("-n", "--nolock", "results/prefix/cpu/table.md", "--configfile", str(extra))
        assert r.returncode != 0 and words in r.stdout, r.stdout[-2000:]


def test_prefix_profile_follows_its_settings(tmp_path):
    """The prefix sweep's derived load profile names its settings' digest in its first line; a
    changed override, or a profile on disk derived from other settings (a restored file, a tree
    copied without .snakemake), derives it again and reruns the cells; unchanged settings do not."""
    import yaml

    copy_workflow(tmp_path)
    shutil.copytree(ROOT / "envs", tmp_path / "envs")  # the rule's conda env (recorded in metadata)
    target = "results/prefix/cpu/load_profile.yaml"
    r = snakemake("--cores", "1", "--nolock", target, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    head = (tmp_path / target).read_text().split("\n", 1)[0]
    assert re.search(r"\(settings [0-9a-f]{16}\)$", head), head

    def planned(*extra):
        r = snakemake("-n", "--nolock", "prefix", *extra, cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:]
        return job_counts(r.stdout)

    assert "prefix_profile" not in planned()
    prefix = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["prefix"]
    changed = tmp_path / "changed.yaml"
    overrides = {**prefix["profile_overrides"], "name": "renamed"}
    changed.write_text(yaml.safe_dump({"prefix": {**prefix, "profile_overrides": overrides}}))
    jobs = planned("--configfile", str(changed))
    assert {"prefix_settings_marker", "prefix_profile", "prefix_cells_rep0"} <= set(jobs), jobs
    # the same settings, but the file on disk from elsewhere and no metadata to compare params with
    shutil.rmtree(tmp_path / ".snakemake")
    text = (tmp_path / target).read_text()
    (tmp_path / target).write_text(re.sub(r"\(settings [0-9a-f]{16}\)", "(settings 0000000000000000)", text, 1))
    assert "prefix_profile" in planned()


# ---------------------------------------------------------------------------------------------
# Scripts: code hash, checksums, aggregation rules
# ---------------------------------------------------------------------------------------------
def test_code_hash_follows_content_not_mtime(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import code_hash
    finally:
        sys.path.remove(str(SCRIPTS))
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    (pkg / "notes.txt").write_text("not code\n")
    h0 = code_hash.code_hash(pkg)
    os.utime(pkg / "a.py", (1, 1))  # touch only
    assert code_hash.code_hash(pkg) == h0
    (pkg / "notes.txt").write_text("changed, but not a source file\n")
    assert code_hash.code_hash(pkg) == h0
    (pkg / "sub" / "b.py").write_text("y = 2  # a comment\n")
    h1 = code_hash.code_hash(pkg)
    assert h1 != h0
    (pkg / "table.json").write_text('{"configs": {}}')   # packaged data (a tuned launch table) counts
    assert code_hash.code_hash(pkg) != h1


def test_checksums_write_and_verify_with_sha256sum(tmp_path):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "a.csv").write_text("a,b\n1,2\n")
    (tmp_path / "results" / "b~x_y.json").write_text("{}\n")
    r = script("checksums.py", "write", "--output", "checksums/t.sha256", "results/b~x_y.json",
               "results/a.csv", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    lines = (tmp_path / "checksums" / "t.sha256").read_text().splitlines()
    assert [ln.split("  ")[1] for ln in lines] == ["results/a.csv", "results/b~x_y.json"]
    assert lines[0].split("  ")[0] == hashlib.sha256(b"a,b\n1,2\n").hexdigest()
    if shutil.which("sha256sum"):
        ok = subprocess.run(["sha256sum", "-c", "checksums/t.sha256"], cwd=tmp_path)
        assert ok.returncode == 0
    (tmp_path / "results" / "a.csv").write_text("tampered\n")
    assert script("checksums.py", "check", "checksums/t.sha256", cwd=tmp_path).returncode == 1


CELL = ("scheduler~{s}_policy~fcfs_batch~{b}_chunk~0_linear~torch_attn~torch_rate~{r}"
        "_blocks~auto_load~default_rep~{rep}")


def fake_report(path: Path, *, scheduler: str, batch: int, rate: str = "profile",
                status: str = "ok", digest: str = "d1", throughput: float = 10.0,
                cpu: str = "AMD EPYC", error: str | None = None, rep: int = 0,
                device: str = "cpu", invariant: bool = False) -> Path:
    """A minimal report with the fields the aggregation reads, and its provenance file (a cell
    id with ``invariant~on`` before ``rep~`` when ``invariant``, as the pipeline names it)."""
    cell = CELL.format(s=scheduler, b=batch, r=rate, rep=rep)
    if invariant:
        cell = cell.replace("_rep~", "_invariant~on_rep~")
    out = path / f"{cell}.json"
    profile = {"name": "p", "seed": 0, "num_requests": 4, "arrival": {"rate": 4.0, "burstiness": 1.0},
               "dataset": {"kind": "sharegpt"}, "temperature": 0.0}
    report = {
        "status": status, "error": error, "created_at": "2026-01-01T00:00:00+00:00",
        "config": {"model": "tiny", "dtype": None, "requests": 4, "warmup_requests": 1},
        "engine_config": {"model": "tiny", "dtype": "float32", "batch_invariant": invariant},
        "profile": profile,
        "seed": 0, "workload": {"num_requests": 4}, "warmup": {"num_requests": 1},
        "git": {"revision": "abc", "dirty": False}, "versions": {"torch": "2.13.0"},
        "hardware": {"device": device, "device_name": cpu, "cpu_model": cpu, "cpu_count": 2},
        "aggregates": {"num_requests": 4, "num_completed": 4 if status == "ok" else 1,
                       "output_throughput": throughput if status == "ok" else None,
                       "ttft_ms_p95": 100.0, "tpot_ms_p95": 5.0, "kv_cache_usage_peak": 0.1,
                       "kv_memory_reduction_vs_contiguous": 0.9, "num_preemptions": 0,
                       "num_recomputed_tokens": 0},
        "requests": [{"status": "ok", "ttft_ms": 50.0 + i} for i in range(4)],
        "token_digest": digest if status == "ok" else None,
    }
    out.write_text(json.dumps(report))
    params = dict(part.split("~") for part in cell.split("_"))
    (path / f"{cell}.provenance.json").write_text(json.dumps(
        {"cell": cell, "params": params, "code_hash": "h", "thread_env": {"OMP_NUM_THREADS": "1"}}))
    return out


def run_aggregate(tmp_path: Path, main: list[Path], failure: list[Path],
                  invariant: list[Path] = ()) -> subprocess.CompletedProcess:
    out = tmp_path / "out"
    sweeps = ["--sweep", "main", *map(str, main)]
    if failure:
        sweeps += ["--sweep", "failure_regimes", *map(str, failure)]
    if invariant:
        sweeps += ["--sweep", "batch_invariant", *map(str, invariant)]
    return script("aggregate_checkpoint3.py", "--profile", "t", *sweeps,
                  "--defaults", json.dumps({"rate": "profile", "blocks": "auto", "policy": "fcfs",
                                            "chunk": "0", "linear": "torch", "attn": "torch",
                                            "load": "default"}),
                  "--out-dir", str(out))


def test_aggregation_keeps_failures_and_checks_digests(tmp_path):
    import pandas as pd

    main = [fake_report(tmp_path, scheduler="naive", batch=1, digest="same"),
            fake_report(tmp_path, scheduler="continuous", batch=8, digest="same", throughput=40.0),
            fake_report(tmp_path, scheduler="static", batch=8, digest="other"),
            fake_report(tmp_path, scheduler="static", batch=4, status="failed",
                        error="OutOfMemoryError: CUDA out of memory")]
    failure = [fake_report(tmp_path, scheduler="continuous", batch=8, rate="inf", digest="same",
                           throughput=20.0)]
    r = run_aggregate(tmp_path, main, failure)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert len(df) == 4
    verdict = dict(zip(df["scheduler"] + df["batch"].astype(str), df["digest_agrees_with_naive"]))
    assert verdict == {"naive1": "reference", "continuous8": "yes", "static8": "NO",
                       "static4": "n/a (failed)"}
    failed = df[df["status"] == "failed"].iloc[0]
    assert "CUDA out of memory" in failed["error"]
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "CUDA out of memory" in md and "**Hardware:** cpu — AMD EPYC" in md
    fdf = pd.read_csv(tmp_path / "out" / "failure_regimes.csv")
    assert fdf["output_throughput_vs_baseline"].iloc[0] == pytest.approx(0.5)


def test_two_repetitions_of_two_cells_show_median_min_max(tmp_path):
    main = [fake_report(tmp_path, scheduler=s, batch=8, rep=rep, throughput=t)
            for s, ts in (("static", (10.0, 14.0)), ("continuous", (30.0, 20.0)))
            for rep, t in enumerate(ts)]
    r = run_aggregate(tmp_path, main, [])
    assert r.returncode == 0, r.stderr
    head = (tmp_path / "out" / "headline.md").read_text()
    assert "| Static batching | 12.0 [10.0–14.0] tok/s |" in head, head
    assert "| Continuous batching | 25.0 [20.0–30.0] tok/s |" in head, head
    assert "**Repetitions:** 2" in head and "**Requests per run:** 4" in head


def test_gpu_digest_verdict_is_not_applicable(tmp_path):
    import pandas as pd

    main = [fake_report(tmp_path, scheduler="naive", batch=1, digest="a", device="cuda"),
            fake_report(tmp_path, scheduler="continuous", batch=8, digest="b", device="cuda")]
    assert run_aggregate(tmp_path, main, []).returncode == 0
    df = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert list(df["digest_agrees_with_naive"]) == ["reference", "n/a: not batch-invariant"]


def test_gpu_batch_invariant_cells_are_compared_with_batch_1_in_the_mode(tmp_path):
    """On a GPU the naive control has no fixed-order kernels: a cell with the mode on is
    compared with the paged (batch 1) cell in the mode, and a difference is a finding."""
    import pandas as pd

    main = [fake_report(tmp_path, scheduler="naive", batch=1, digest="a", device="cuda"),
            fake_report(tmp_path, scheduler="continuous", batch=8, digest="b", device="cuda")]
    inv = [fake_report(tmp_path, scheduler="continuous", batch=8, digest="c", device="cuda", invariant=True),
           fake_report(tmp_path, scheduler="continuous", batch=64, digest="d", device="cuda", invariant=True),
           fake_report(tmp_path, scheduler="paged", batch=1, digest="c", device="cuda", invariant=True)]
    assert run_aggregate(tmp_path, main, [], inv).returncode == 0
    df = pd.read_csv(tmp_path / "out" / "batch_invariant.csv")
    verdict = dict(zip(df["scheduler"] + df["batch"].astype(str), df["digest_agrees_with_naive"]))
    assert verdict == {"continuous8": "yes (vs batch 1 with the mode)",
                       "continuous64": "NO (differs from batch 1 with the mode)",
                       "paged1": "reference (batch 1 with the mode)"}


def test_batch_invariant_cells_match_on_the_requested_thread_count(tmp_path):
    """The mode pins torch to one thread: its cells record 1 where the others record the
    process's 4, and still aggregate beside them; a plain cell at 1 thread is still refused."""
    import pandas as pd

    def threads(report: Path, recorded: int) -> Path:
        rec = json.loads(report.read_text())
        rec["hardware"]["torch_threads"] = recorded
        report.write_text(json.dumps(rec))
        prov = report.with_name(report.name.replace(".json", ".provenance.json"))
        p = json.loads(prov.read_text())
        p["torch_threads"] = 4
        prov.write_text(json.dumps(p))
        return report

    main = [threads(fake_report(tmp_path, scheduler="naive", batch=1, digest="a", device="cuda"), 4),
            threads(fake_report(tmp_path, scheduler="continuous", batch=8, digest="b", device="cuda"), 4)]
    inv = [threads(fake_report(tmp_path, scheduler="continuous", batch=8, digest="c", device="cuda",
                               invariant=True), 1),
           threads(fake_report(tmp_path, scheduler="paged", batch=1, digest="c", device="cuda",
                               invariant=True), 1)]
    r = run_aggregate(tmp_path, main, [], inv)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(tmp_path / "out" / "batch_invariant.csv")
    assert len(df) == 2
    threads(main[1], 1)   # the same record without the mode: a real difference
    r = run_aggregate(tmp_path, main, [], inv)
    assert r.returncode != 0 and "torch_threads" in r.stderr, r.stderr


def test_batch_invariant_cells_beside_the_same_cells_without_the_mode(tmp_path):
    import pandas as pd

    main = [fake_report(tmp_path, scheduler="naive", batch=1, digest="same"),
            fake_report(tmp_path, scheduler="continuous", batch=8, digest="same", throughput=40.0),
            fake_report(tmp_path, scheduler="continuous", batch=64, digest="same", throughput=80.0)]
    inv = [fake_report(tmp_path, scheduler="continuous", batch=8, digest="same", throughput=30.0,
                       invariant=True),
           fake_report(tmp_path, scheduler="continuous", batch=64, digest="moved", throughput=60.0,
                       invariant=True)]
    r = run_aggregate(tmp_path, main, [], inv)
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(tmp_path / "out" / "batch_invariant.csv")
    assert list(df["batch"]) == [8, 64] and set(df["invariant"]) == {"on"}
    assert list(df["output_throughput_off"]) == [40.0, 80.0]
    assert list(df["throughput_on_vs_off"]) == pytest.approx([0.75, 0.75])
    # no naive control with the mode on: compared with the one without it, and labelled so
    assert list(df["digest_agrees_with_naive"]) == [
        "yes (vs naive with the mode off)",
        "n/a (no naive run with the mode; differs from the one without it)"]
    md = (tmp_path / "out" / "batch_invariant.md").read_text()
    assert "| continuous | 8 | off | 40.0 | 30.0 | ×0.75 |" in md, md
    assert "**Batch-invariant mode:** on in every run" in md, md
    # the mode's own naive control takes precedence once it exists
    naive_on = fake_report(tmp_path, scheduler="naive", batch=1, digest="moved", invariant=True)
    r = run_aggregate(tmp_path, main, [], [*inv, naive_on])
    assert r.returncode == 0, r.stderr
    df = pd.read_csv(tmp_path / "out" / "batch_invariant.csv")
    verdict = dict(zip(df["scheduler"] + df["batch"].astype(str), df["digest_agrees_with_naive"]))
    assert verdict == {"continuous8": "NO", "continuous64": "yes", "naive1": "reference"}
    # a report whose engine ran in the other mode than its cell id says is refused
    liar = fake_report(tmp_path, scheduler="continuous", batch=8, rep=1, invariant=True)
    rec = json.loads(liar.read_text())
    rec["engine_config"]["batch_invariant"] = False
    liar.write_text(json.dumps(rec))
    r = run_aggregate(tmp_path, main, [], [*inv, liar])
    assert r.returncode == 1 and "says batch_invariant False" in r.stderr, r.stderr
    # a profile without the sweep still writes the page, saying so
    assert run_aggregate(tmp_path, main, []).returncode == 0
    assert "no `batch_invariant` sweep" in (tmp_path / "out" / "batch_invariant.md").read_text()


def test_invariant_cells_are_named_apart_and_run_with_the_flag(tmp_path):
    """The optional matrix column: absent from the ids of cells at its default (so the cells
    of earlier results keep their names), `invariant~on` and `--batch-invariant` otherwise."""
    conf = tmp_path / "inv.yaml"
    conf.write_text("profile: inv\nrepetitions: 1\nextra_loads: {}\nsweeps:\n  main:\n"
                    "    - {scheduler: [continuous], batch: [8], invariant: [false, true]}\n")
    r = snakemake("-n", "--nolock", "-p", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode == 0, r.stdout[-3000:]
    plain = ("scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf"
             "_blocks~auto_load~default_rep~0")
    assert f'"{plain}"' in r.stdout  # a key of the group's spec
    assert f'"{plain.replace("_rep~", "_invariant~on_rep~")}"' in r.stdout
    assert "--batch-invariant" in r.stdout and "invariant~off" not in r.stdout
    conf.write_text(conf.read_text().replace("[false, true]", "[yes-please]"))
    r = snakemake("-n", "--nolock", "results/checkpoint3", "--configfile", str(conf))
    assert r.returncode != 0 and "yes-please" in r.stdout, r.stdout[-2000:]


def test_plot_scripts_raise_on_an_empty_selection(tmp_path):
    pytest.importorskip("matplotlib")
    import pandas as pd

    sys.path.insert(0, str(SCRIPTS))
    try:
        import plot_checkpoint3 as pc
    finally:
        sys.path.remove(str(SCRIPTS))
    main = [fake_report(tmp_path, scheduler="continuous", batch=8)]
    assert run_aggregate(tmp_path, main, []).returncode == 0
    df = pd.read_csv(tmp_path / "out" / "summary.csv", dtype=pc.STR_COLUMNS)
    with pytest.raises(pc.EmptySelection):  # no cell with the GPU profile's attention backend
        pc.plot_batch_scaling(df, {"attn": "triton"}, "t", tmp_path / "a.png")
    with pytest.raises(pc.EmptySelection):
        pc.plot_chunked(df.iloc[0:0], "t", tmp_path / "b.png")
    with pytest.raises(pc.EmptySelection):
        pc.plot_latency_throughput(df.iloc[0:0], "t", tmp_path / "c.png")
    pc.plot_batch_scaling(df, {"attn": "torch", "rate": "profile"}, "t", tmp_path / "d.png")
    assert (tmp_path / "d.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty.json").write_text('{"modes": []}')
    r = script("plot_quantization.py", str(tmp_path / "empty.json"), "--output",
               str(tmp_path / "q.png"))
    assert r.returncode != 0 and not (tmp_path / "q.png").exists(), r.stdout + r.stderr


@pytest.mark.parametrize("profile,min_rows", [("cpu", 3), ("h100", 2)])
def test_readme_headline_numbers_come_from_headline_md(profile, min_rows):
    """Every number in README.md's headline section of a profile appears in that profile's
    committed headline.md (so the test still passes after the README's main job reran)."""
    import re

    readme = (ROOT / "README.md").read_text()
    start, end = f"<!-- headline:{profile} -->", f"<!-- /headline:{profile} -->"
    assert start in readme and end in readme, f"README.md lacks the headline:{profile} markers"
    section = readme[readme.index(start) + len(start):readme.index(end)]
    # The committed headline (git's copy): a rerun of the pipeline on this clone rewrites the
    # working file with its own numbers, and the README copies the tracked run, not the rerun.
    path = f"results/checkpoint3/{profile}/headline.md"
    committed = subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, capture_output=True,
                               text=True)
    headline = committed.stdout if committed.returncode == 0 else (ROOT / path).read_text()
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    assert len(rows) >= min_rows, section
    numbers = re.findall(r"\d[\d,]*\.\d+", "\n".join(rows))
    assert numbers, section
    for n in numbers:
        assert n in headline, f"README headline number {n} is not in headline.md"
    for row in rows:  # whole rows, not just numbers
        assert row.strip() in headline, row


def test_contended_runs_are_flagged_in_status_and_header(tmp_path):
    import pandas as pd

    main = [fake_report(tmp_path, scheduler="naive", batch=1),
            fake_report(tmp_path, scheduler="continuous", batch=8)]
    busy = {"wall_s": 10.0, "own_cores": 1.0, "other_cores": 1.6, "steal_fraction": 0.0,
            "loadavg_start": [2.6, 2.0, 1.0], "loadavg_end": [2.8, 2.1, 1.0],
            "machine": {"cpu_count": 2}}
    for path, other in zip(main, (0.05, 1.6)):
        prov = path.with_name(path.name.replace(".json", ".provenance.json"))
        rec = json.loads(prov.read_text())
        rec["machine_load"] = dict(busy, other_cores=other)
        prov.write_text(json.dumps(rec))
    assert run_aggregate(tmp_path, main, []).returncode == 0
    df = pd.read_csv(tmp_path / "out" / "summary.csv")
    assert list(df["status"]) == ["ok", "ok, contended 1/1"]
    assert list(df["runs_contended"]) == [0, 1]
    head = (tmp_path / "out" / "headline.md").read_text()
    assert "**1 of 2 runs contended**" in head and "1-min load average 2.60–2.80" in head, head


def test_verdicts_tolerance_band_around_the_tracked_range():
    """A number just outside the tracked [min, max] reproduces inside the tolerance band (a
    fraction of the tracked median on each side), not beyond it; 0 keeps the range alone."""
    import pandas as pd
    sys.path.insert(0, str(ROOT / "workflow" / "scripts"))
    try:
        import verdicts
    finally:
        sys.path.pop(0)
    old = pd.DataFrame([{"scheduler": "continuous", "output_throughput_median": 100.0,
                         "output_throughput_min": 98.0, "output_throughput_max": 102.0}])

    def verdict(value: float, tolerance: float) -> tuple[str, bool | None, bool | None]:
        new = pd.DataFrame([{"scheduler": "continuous", "output_throughput_median": value}])
        row = verdicts.headline_rows(new, old, tolerance)[0]
        return row["verdict"], row["within"], row["in_range"]

    assert verdict(101.0, 0.1) == ("within the tracked range", True, True)
    assert verdict(93.0, 0.1) == ("7% worse than the tracked median, inside the 10% tolerance", True, False)
    assert verdict(111.5, 0.1) == ("12% better than the tracked median, inside the 10% tolerance", True, False)
    assert verdict(87.0, 0.1) == ("13% worse than the tracked median, outside its range and the 10% tolerance",
                                  False, False)
    assert verdict(93.0, 0.0) == ("7% worse than the tracked median, outside its range", False, False)
    # p95 TTFT: lower is better, so a higher number is worse
    row = verdicts.headline_rows(pd.DataFrame([{"scheduler": "continuous", "ttft_p95_ms_median": 120.0}]),
                                 pd.DataFrame([{"scheduler": "continuous", "ttft_p95_ms_median": 100.0,
                                                "ttft_p95_ms_min": 95.0, "ttft_p95_ms_max": 105.0}]), 0.1)
    ttft = [r for r in row if r["what"].endswith("p95 TTFT")][0]
    assert ttft["verdict"] == "20% worse than the tracked median, outside its range and the 10% tolerance"
    # a tracked table without min/max: the median is the range; a tolerance under 1% prints as such
    bare = pd.DataFrame([{"scheduler": "continuous", "output_throughput_median": 100.0}])
    row = verdicts.headline_rows(pd.DataFrame([{"scheduler": "continuous", "output_throughput_median": 100.4}]),
                                 bare, 0.005)[0]
    assert (row["verdict"], row["within"]) == (
        "0% better than the tracked median, inside the 0.5% tolerance", True)
    zero = pd.DataFrame([{"scheduler": "continuous", "output_throughput_median": 0.0,
                          "output_throughput_min": 0.0, "output_throughput_max": 0.0}])
    row = verdicts.headline_rows(pd.DataFrame([{"scheduler": "continuous", "output_throughput_median": 5.0}]),
                                 zero, 0.1)[0]
    assert row["verdict"] == "far better than the tracked median, outside its range and the 10% tolerance"
    r = script("verdicts.py", "--profile", "t", "--tables", ".", "--out-dir", ".", "--tolerance", "1.5")
    assert r.returncode != 0 and "--tolerance must be in [0, 1)" in r.stderr


def test_verdicts_compare_a_rerun_with_the_committed_tables(tmp_path):
    """Headline numbers against git's committed copy with its spread; claims on this run."""
    import pandas as pd

    if not shutil.which("git"):
        pytest.skip("git is not installed")
    out = tmp_path / "results"
    out.mkdir()
    cols = {"sweep": "main", "cell": "c", "policy": "fcfs", "chunk": "0", "status": "ok",
            "repetitions": 3, "runs_contended": 0}

    def tables(cont: float) -> None:
        rows = [dict(cols, scheduler="static", batch="8", output_throughput_median=200.0,
                     output_throughput_min=190.0, output_throughput_max=210.0),
                dict(cols, scheduler="continuous", batch="8", output_throughput_median=cont,
                     output_throughput_min=310.0, output_throughput_max=330.0)]
        for name in ("headline", "summary"):
            pd.DataFrame(rows).to_csv(out / f"{name}.csv", index=False)

    tables(320.0)
    (out / "raw").mkdir()
    (out / "raw" / "cell.json").write_text('{"run": 1}')
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-qm", "tracked run"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True)
    tables(150.0)  # the rerun: continuous far slower, now below static
    (out / "raw" / "cell.json").write_text('{"run": 2}')
    claims = [{"text": "continuous beats static", "table": "summary", "metric": "output_throughput",
               "row": {"scheduler": "continuous", "batch": 8},
               "than": {"scheduler": "static", "batch": 8}, "at_least": 1.0}]
    r = script("verdicts.py", "--profile", "t", "--tables", str(out), "--claims",
               json.dumps(claims), "--out-dir", str(out))
    assert r.returncode == 0, r.stderr
    md = (out / "verdicts.md").read_text()
    assert "**Not reproduced**" in md and "0 of 1 stated conclusions hold" in md, md
    assert "| Continuous batching: output throughput (tok/s) | 150.0 | 320.0 [310.0–330.0] | " \
           "53% worse than the tracked median, outside its range and the 10% tolerance |" in md, md
    assert "| continuous beats static | does not hold | 150.0 / 200.0 = ×0.75 (needs >= 1) | ×1.60 |" in md
    assert "report.rst" in {p.name for p in out.iterdir()}

    # The rerun published (its tables committed): rebuilding its verdicts judges it against the
    # run it replaced, the same text it got before the commit, not against itself.
    published = {n: (out / n).read_text() for n in ("verdicts.md", "verdicts.csv", "report.rst")}
    for cmd in (["add", "."], ["commit", "-qm", "published rerun"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True)
    r = script("verdicts.py", "--profile", "t", "--tables", str(out), "--claims",
               json.dumps(claims), "--out-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert {n: (out / n).read_text() for n in published} == published
    assert "this run is the tracked one" not in (out / "verdicts.md").read_text()

    def rebuild() -> str:
        r = script("verdicts.py", "--profile", "t", "--tables", str(out), "--claims",
                   json.dumps(claims), "--out-dir", str(out))
        assert r.returncode == 0, r.stderr
        return (out / "verdicts.md").read_text()

    def head_of(path: str) -> str:
        return subprocess.run(["git", "log", "-1", "--format=%h", "--abbrev=12", "--", path], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    # A commit that only reformats the headline brings no run: still judged against the run
    # the published one replaced (its raw reports decide), with the same verdicts.
    df = pd.read_csv(out / "headline.csv")
    df["note"] = "x"
    df.to_csv(out / "headline.csv", index=False)
    for cmd in (["add", "."], ["commit", "-qm", "headline format"]):
        subprocess.run(git + cmd, cwd=tmp_path, check=True)
    assert rebuild() == published["verdicts.md"]
    # A rerun of one sweep (its table changes, the headline does not) is judged against HEAD.
    df = pd.read_csv(out / "summary.csv")
    df["output_throughput_median"] = [200.0, 330.0]
    df.to_csv(out / "summary.csv", index=False)
    md = rebuild()
    assert f"tracked values: git {head_of('results/headline.csv')}" in md, md
    assert "1 of 1 stated conclusions hold" in md, md


def test_aggregation_refuses_runs_from_different_hardware(tmp_path):
    main = [fake_report(tmp_path, scheduler="naive", batch=1),
            fake_report(tmp_path, scheduler="continuous", batch=8, cpu="Intel Xeon")]
    r = run_aggregate(tmp_path, main, [])
    assert r.returncode == 1
    assert "refusing to put runs side by side: 'hardware' differs" in r.stderr
    assert "cpu_model" in r.stderr and "Intel Xeon" in r.stderr


# ---------------------------------------------------------------------------------------------
# End to end: a reduced matrix through the real benchmark harness
# ---------------------------------------------------------------------------------------------
REDUCED = """\
profile: citest
requests: 2
warmup_requests: 0
repetitions: 2
timeout_s: 120
load_profile_overrides:
  name: sharegpt-citest
  arrival: {rate: inf}
  prompt_len: {max: 32}
  output_len: {scale: 0.05, max: 6}
extra_loads: {}
sweeps:
  main:
    - {scheduler: [naive]}
    - {scheduler: [continuous], batch: [8]}
  chunked_prefill:
    - {scheduler: [continuous], batch: [8], chunk: [0]}
  rates:
    - {scheduler: [continuous], batch: [8], rate: [inf]}
  failure_regimes: []
timelines:
  batching: [{scheduler: naive}, {scheduler: continuous, batch: 8}]
"""


@pytest.fixture(scope="module")
def reduced_run(tmp_path_factory):
    pytest.importorskip("matplotlib")
    work = tmp_path_factory.mktemp("pipeline")
    for folder in ("workflow", "config", "envs"):
        shutil.copytree(ROOT / folder, work / folder)
    # A snapshot of the engine (the Snakefile puts <repository>/engine first on PYTHONPATH), so
    # that the run (whose cells fail on purpose when the llmserve sources change under them) is
    # independent of edits to the tree.
    shutil.copytree(ROOT / "engine" / "llmserve", work / "engine" / "llmserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ)
    (work / "config" / "citest.yaml").write_text(REDUCED)
    run = snakemake("--cores", "1", "results/checkpoint3", "--config", "profile=citest",
                    cwd=work, timeout=900, env=env)
    return work, run, env


def test_reduced_matrix_end_to_end(reduced_run):
    work, run, _ = reduced_run
    assert run.returncode == 0, run.stdout[-4000:]
    out = work / "results" / "checkpoint3" / "citest"
    md = (out / "summary.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| naive") or ln.startswith("| continuous")]
    assert len(rows) == 2, md
    assert "sharegpt-citest" in md and "**Model:** `tiny`" in md
    assert "**Repetitions:** 2" in md and "**Requests per run:** 2" in md, md
    assert "torch threads 1" in md, md
    assert "+dirty" not in md  # only engine/workflow sources can make a run dirty
    # two repetitions of two cells: every number of the headline is median [min–max]
    head = (out / "headline.md").read_text()
    cont = next(ln for ln in head.splitlines() if ln.startswith("| Continuous batching"))
    assert cont.count("[") == 3 and cont.count("–") == 3, head
    for png in ("batch_scaling", "ttft_cdf", "chunked_prefill", "latency_throughput",
                "timeline_batching"):
        assert (out / "plots" / f"{png}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # repetition 0 of the timeline's cells traced its requests, and only that repetition
    traces = sorted(p.name for p in (out / "raw").glob("*.trace.jsonl.gz"))
    assert len(traces) == 2 and all(t.endswith("_rep~0.trace.jsonl.gz") for t in traces), traces
    from llmserve.core.trace import read_trace

    events = read_trace(out / "raw" / traces[0])
    assert {e["event"] for e in events} >= {"arrived", "queued", "prefill", "finished"}, events[:5]
    prov = json.loads(next((out / "raw").glob("*rep~1.provenance.json")).read_text())
    assert prov["torch_threads"] == 1 and prov["process"]["cells_in_group"] == 2, prov
    assert prov["code_hash"] == prov["code_hash_at_dag_build"]
    # the machine's load while the cell ran, and the verdicts against the (absent) tracked run
    load = prov["machine_load"]
    assert load["other_cores"] is not None and load["machine"]["cpu_count"] >= 1, load
    assert "**Machine load during the runs:** other processes used" in md, md
    verdicts = (out / "verdicts.md").read_text()
    assert "no committed copy" in verdicts or "tracked values: git" in verdicts, verdicts
    # the run's sums beside its results; the committed sums (checksums/) only by `publish`
    checksum = out / "checksums.sha256"
    assert not (work / "checksums" / "checkpoint3-citest.sha256").exists()
    listed = [ln.split("  ", 1)[1] for ln in checksum.read_text().splitlines()]
    assert "results/checkpoint3/citest/summary.md" in listed
    assert sum(p.endswith(".json") and "/raw/" in p for p in listed) == 8  # 2 cells x 2 reps x 2
    assert sum(p.endswith(".trace.jsonl.gz") for p in listed) == 2  # the traced repetition 0
    assert "results/checkpoint3/citest/plots/timeline_batching.png" in listed
    assert not any("/logs/" in p for p in listed)
    if shutil.which("sha256sum"):
        ok = subprocess.run(["sha256sum", "-c", str(checksum.relative_to(work))], cwd=work,
                            capture_output=True, text=True)
        assert ok.returncode == 0, ok.stdout + ok.stderr
    r = snakemake("--cores", "1", "publish", "--config", "profile=citest", cwd=work)
    assert r.returncode == 0, r.stdout[-3000:]
    assert (work / "checksums" / "checkpoint3-citest.sha256").read_text() == checksum.read_text()


def test_report_embeds_every_table_and_plot(reduced_run):
    import base64
    import re

    work, run, env = reduced_run
    assert run.returncode == 0
    report = work / "results" / "checkpoint3" / "citest" / "report.html"
    r = snakemake("--report", str(report.relative_to(work)), "results/checkpoint3",
                  "--config", "profile=citest", cwd=work, env=env)
    assert r.returncode == 0, r.stdout[-3000:]
    html = report.read_text()
    assert "<html" in html.lower()
    plots = sorted((work / "results" / "checkpoint3" / "citest" / "plots").glob("*.png"))
    assert len(plots) == 5   # the four plots and the timeline of the config's `timelines`
    # self-contained: the results are embedded as data (base64), not linked files
    for png in plots:
        assert png.name in html, png.name
        b64 = base64.b64encode(png.read_bytes()).decode()
        assert b64[:200] in html or b64[:200] in re.sub(r"\\/", "/", html), png.name
    for table in ("headline.md", "summary.md", "chunked_prefill.md", "rates.md",
                  "failure_regimes.md", "batch_invariant.md"):
        assert table in html, table


def test_reduced_matrix_reruns_only_what_changed(reduced_run):
    work, run, env = reduced_run
    assert run.returncode == 0
    dry = ("-n", "results/checkpoint3", "--config", "profile=citest")
    r = snakemake(*dry, cwd=work, env=env)
    assert r.returncode == 0 and "Nothing to be done" in r.stdout, r.stdout[-3000:]
    # Only the aggregation script changes: aggregation (and what follows) reruns, no cell.
    agg = work / "workflow" / "scripts" / "aggregate_checkpoint3.py"
    agg.write_text(agg.read_text() + "\n# an edit of the aggregation script only\n")
    counts = job_counts(snakemake(*dry, cwd=work, env=env).stdout)
    assert counts.get("aggregate") == 1 and "benchmark_cell" not in counts, counts
    # A comment in an engine file: every cell reruns (params trigger), and so it does without
    # Snakemake's metadata too (a fresh clone), through the provenance files' code hash.
    engine_file = work / "engine" / "llmserve" / "core" / "sampling_params.py"
    engine_file.write_text(engine_file.read_text() + "\n# a comment\n")
    counts = job_counts(snakemake(*dry, cwd=work, env=env).stdout)
    assert counts.get("benchmark_main_rep0") == 1 and counts.get("benchmark_main_rep1") == 1, counts
    shutil.rmtree(work / ".snakemake")
    counts = job_counts(snakemake(*dry, cwd=work, env=env).stdout)
    assert counts.get("benchmark_main_rep0") == 1 and counts.get("code_changed_marker") == 4, counts
    # Rerun for real (still without the old metadata): afterwards nothing is left to do.
    r = snakemake("--cores", "1", *dry[1:], cwd=work, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:]
    r = snakemake(*dry, cwd=work, env=env)
    assert "Nothing to be done" in r.stdout, r.stdout[-3000:]


def test_structured_table_names_model_hardware_and_command(tmp_path):
    """The structured-output table says where it ran: the model, the device and the command of
    its profile (the folder it is written to), and where a step's time went (host work, of it
    the bitmask fills, and the wait for the device, in ms per step)."""
    raw = tmp_path / "raw"
    raw.mkdir()
    for schema, tput, wait in (("off", 100.0, 0.3), ("on", 90.0, 0.02)):
        (raw / f"batch~8_schema~{schema}_rep~0.json").write_text(json.dumps({
            "status": "ok", "config": {"model": "random:qwen2.5-1.5b", "dtype": "bfloat16"},
            "hardware": {"device_name": "NVIDIA H100 80GB HBM3", "cpu_count": 16},
            "aggregates": {"output_throughput": tput, "tpot_ms_p50": 2.0, "num_requests": 32,
                           "num_steps": 100},
            "host": {"step_seconds": {"schedule": 0.05, "execute": 0.05, "sample": 0.1,
                                      "device_wait": wait, "postprocess": 0.02}},
            "structured_output": {"engine": {"mask_seconds": 0.04}} if schema == "on" else None}))
    out = tmp_path / "h100"
    out.mkdir()
    r = script("structured_table.py", "--code-hash", "abc", "--md", str(out / "table.md"),
               "--json", str(out / "table.json"), *map(str, sorted(raw.glob("*.json"))))
    assert r.returncode == 0, r.stderr
    md = (out / "table.md").read_text()
    assert "`random:qwen2.5-1.5b` (bfloat16) on NVIDIA H100 80GB HBM3" in md, md
    assert "--config profile=h100" in md and "| 8 | 32 |" in md and "| 0.90 |" in md, md
    assert "| 8 | 2.20 | 2.20 | 0.40 | 3.00 | 0.20 |" in md, md


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def _stale_compare(root: Path, profile: str = "h100") -> tuple[Path, Path]:
    """A GPU profile's compare.json measured on other sources (hash 0...0), and the path of the
    marker that makes it rerun."""
    (root / "engine").symlink_to(ROOT / "engine")        # the code hash the workflow computes
    current = script("code_hash.py").stdout.strip()
    out = root / "results" / profile
    out.mkdir(parents=True)
    (out / "compare.json").write_text(json.dumps({"code_hash": "0" * 64}))
    (out / "compare.md").write_text("measured\n")
    (out / "decode_sweep.png").write_bytes(b"png")
    marker = (root / "results" / "checkpoint3" / profile / "logs" / "code-changed" / "gpu~compare"
              / f"{'0' * 16}-to-{current[:16]}.stamp")
    return out / "compare.json", marker


def test_a_stale_gpu_result_reruns_even_when_restored_after_its_marker(tmp_path):
    """A marker left by a run that stopped before its job finished, older than the job's output
    copied back afterwards (which still records the old code hash): the job still reruns (its
    marker is moved past the output), instead of the stale output passing for current."""
    copy_workflow(tmp_path)
    compare, marker = _stale_compare(tmp_path)
    marker.parent.mkdir(parents=True)
    marker.write_text("")
    os.utime(marker, (1_000_000, 1_000_000))                       # long before the output
    # the comparison's target (its outputs and markers; named results/h200 for every profile)
    r = snakemake("-n", "--nolock", "results/h200", "--config", "profile=h100", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert job_counts(r.stdout).get("h200_compare") == 1, r.stdout[-3000:]
    assert marker.stat().st_mtime > compare.stat().st_mtime


@pytest.mark.skipif(_cuda_here(), reason="checks a machine without a CUDA device")
def test_no_gpu_job_runs_where_there_is_no_gpu(tmp_path):
    """On a machine without a GPU a run that would start a GPU profile's measuring job stops
    before any job starts, naming the jobs: a stale measured result is left as it is (no CPU
    run replaces it with a failed one, or deletes it when that run fails); a dry run still
    shows what a GPU machine would run."""
    copy_workflow(tmp_path)
    compare, marker = _stale_compare(tmp_path)
    before = compare.read_text()
    r = snakemake("--cores", "1", "--nolock", "results/h200", "--config", "profile=h100", cwd=tmp_path)
    assert r.returncode != 0 and "measure on a GPU" in r.stdout and "h200_compare" in r.stdout, \
        r.stdout[-3000:]
    assert "Nothing was run" in r.stdout and compare.read_text() == before and not marker.exists()
    r = snakemake("-n", "--nolock", "results/h200", "--config", "profile=h100", cwd=tmp_path)
    assert r.returncode == 0 and job_counts(r.stdout).get("h200_compare") == 1, r.stdout[-3000:]
