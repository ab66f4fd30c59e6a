"""The Slurm workflow profile (workflow/profiles/slurm/) against a real Slurm, on the CPU.

`workflow/scripts/local_slurm.sh start` brings up a single-node cluster on this machine (munged,
slurmctld, slurmd from Debian's packages; the node is what `slurmd -C` sees). The reduced matrix
of tests/test_pipeline.py, with two repetitions (2 cells x 2 = 4 runs in 2 benchmark jobs,
`benchmark_main_rep0` and `benchmark_main_rep1`: one process runs the cells of one sweep and
repetition), then runs twice from two copies of the workflow: through the Slurm executor with
the profile as it is, and locally with `--cores 1`, at the same time. Mid-run, one benchmark
job is killed with `scancel` while its benchmark process (workflow/scripts/run_cells.py) runs.

Checked: every job was a Slurm job (its job id in Snakemake's output, in the name of its log
under results/checkpoint3/logs/slurm/ and known to `scontrol`), CPU cells asked Slurm for no
GPU while a GPU-profile benchmark job asks for one (with a time limit that follows its group's
size), the killed job was submitted again and its cells are in the table, the tables, token
digests and provenance equal the local run's (timings aside), the checksum file verifies, and
a dry run afterwards has nothing to do.

Skipped only when Slurm is not installed or this is not root (the script's exit code 2).
Measured on 2 cores shared with other test suites: 141 s. Most of that is the benchmark jobs
running one after another (`--exclusive`) plus the executor's status polling.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from test_pipeline import REDUCED, job_counts, snakemake

ROOT = Path(__file__).resolve().parents[1]
LOCAL_SLURM = ROOT / "workflow" / "scripts" / "local_slurm.sh"
NAME = "slurmci"  # the reduced matrix's profile name (results/checkpoint3/slurmci/)
OUT = f"results/checkpoint3/{NAME}"
SLURM_LOGS = "results/checkpoint3/logs/slurm"  # the profile's slurm-logdir
# The reduced matrix's cells: every sweep's cell is one of main's, so main owns them all and the
# benchmark jobs are main's two repetitions (rules benchmark_<sweep>_rep<N>, benchmark.smk).
GROUPS = {f"main_rep{r}": [f"scheduler~{s}_policy~fcfs_batch~{b}_chunk~0_linear~torch_attn~torch"
                           f"_rate~inf_blocks~auto_load~default_rep~{r}"
                           for s, b in (("naive", 1), ("continuous", 8))] for r in (0, 1)}
CELLS = [cell for cells in GROUPS.values() for cell in cells]
RULES = {f"benchmark_{group}": group for group in GROUPS}  # rule name -> group
# The profile as a user runs it; this cluster has no slurmdbd, so sacct cannot answer and job
# states come from squeue. Status checks start after 2 s instead of 40 (a test, not a cluster).
SLURM_ARGS = ("--workflow-profile", "workflow/profiles/slurm", "--slurm-status-command", "squeue",
              "--slurm-init-seconds-before-status-checks", "2")
# Table columns that measure time: throughputs, latencies, goodput (SLO-meeting requests per
# second) and latency/throughput ratios to the baseline cell (failure_regimes.csv)
TIMING = re.compile(r"throughput|_ms_|goodput|_vs_baseline")
# provenance["process"] keys that differ between two runs of the same cells (timings, and the
# device memory free before a cell on a GPU)
PROCESS_TIMING = ("process_startup_s", "cell_wall_s", "device_free_bytes_at_start")

pytestmark = pytest.mark.slow


def reduced_config() -> str:
    """test_pipeline's reduced matrix, two repetitions, under its own profile name."""
    cfg = yaml.safe_load(REDUCED)
    cfg.update(profile=NAME, repetitions=2)
    return yaml.safe_dump(cfg, sort_keys=False)


def workdir(base: Path) -> tuple[Path, dict]:
    """A copy of the workflow with a snapshot of the engine (as test_pipeline builds it)."""
    base.mkdir()
    for folder in ("workflow", "config", "envs"):
        shutil.copytree(ROOT / folder, base / folder)
    shutil.copytree(ROOT / "engine" / "llmserve", base / "engine" / "llmserve",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (base / "config" / f"{NAME}.yaml").write_text(reduced_config())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(base / "engine"), *filter(None, [os.environ.get("PYTHONPATH")])]))
    for var in ("LLMSERVE_SLURM_ACCOUNT", "LLMSERVE_SLURM_PARTITION", "LLMSERVE_SLURM_GPU_PARTITION"):
        env.pop(var, None)  # this cluster's default partition, no account
    return base, env


def smk_popen(args, cwd: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def squeue(*states: str) -> list[tuple[str, str, str]]:
    """(job id, state, comment) of this cluster's jobs; the plugin's comment names rule + cell."""
    r = subprocess.run(["squeue", "-h", "--states", ",".join(states) or "all", "-o", "%i|%T|%k"],
                       capture_output=True, text=True, timeout=30)
    return [tuple(line.split("|", 2)) for line in r.stdout.splitlines() if line.count("|") >= 2]


def scontrol_job(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (finished jobs stay listed for MinJobAge, 10 min)."""
    r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, f"scontrol knows no job {job_id}: {r.stderr}"
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", r.stdout))


def benchmark_running(work: Path, group: str) -> bool:
    """Whether the benchmark process of this group (`run_cells.py run ... --group GROUP`) runs,
    in the given workflow copy."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if (cwd == str(work) and any(a.endswith(b"run_cells.py") for a in argv)
                and b"run" in argv and b"--group" in argv
                and argv[argv.index(b"--group") + 1] == group.encode()):
            return True
    return False


def kill_one_group_mid_run(work: Path, run: subprocess.Popen, victim: dict) -> None:
    """scancel the first benchmark job whose benchmark process is seen running (once)."""
    deadline = time.monotonic() + 400
    while run.poll() is None and time.monotonic() < deadline:
        for job_id, _, comment in squeue("RUNNING"):
            rule = comment.removeprefix("rule_")
            if rule in RULES and benchmark_running(work, RULES[rule]):
                subprocess.run(["scancel", job_id], timeout=30)
                # The group may have finished in between: then try the next one.
                for _ in range(50):
                    state = next((st for j, st, _ in squeue() if j == job_id), "")
                    if state not in ("RUNNING", "COMPLETING"):
                        break
                    time.sleep(0.2)
                if state == "CANCELLED":
                    victim.update(job_id=job_id, rule=rule, group=RULES[rule])
                    return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_slurm():
    pytest.importorskip("snakemake_executor_plugin_slurm",
                        reason="pip install snakemake-executor-plugin-slurm (the test extra)")
    if shutil.which("llmserve") is None:
        pytest.skip("the llmserve CLI is not installed (pip install -e .)")
    r = subprocess.run(["bash", str(LOCAL_SLURM), "start"], capture_output=True, text=True,
                       timeout=300)
    if r.returncode == 2:
        pytest.skip(f"no local Slurm cluster: {r.stderr.strip()}")
    assert r.returncode == 0, f"local_slurm.sh start failed:\n{r.stdout}\n{r.stderr}"
    started = "starting slurmctld" in r.stderr
    yield
    if started:  # a cluster that was already up stays up
        subprocess.run(["bash", str(LOCAL_SLURM), "stop"], timeout=120)


@pytest.fixture(scope="module")
def runs(local_slurm, tmp_path_factory):
    """Both runs of the reduced matrix: (slurm work dir, its output, env, victim, local dir)."""
    tmp = tmp_path_factory.mktemp("slurm")
    slurm_work, env = workdir(tmp / "slurm")
    local_work, local_env = workdir(tmp / "local")
    t0 = time.monotonic()
    local = smk_popen(["--cores", "1", "results/checkpoint3", "--config", f"profile={NAME}"],
                      local_work, local_env, tmp / "local.log")
    run = smk_popen([*SLURM_ARGS, "results/checkpoint3", "--config", f"profile={NAME}"],
                    slurm_work, env, tmp / "slurm.log")
    victim: dict = {}
    killer = threading.Thread(target=kill_one_group_mid_run, args=(slurm_work, run, victim))
    killer.start()
    try:
        run.wait(timeout=480)
        local.wait(timeout=120)
    finally:
        for p in (run, local):
            if p.poll() is None:
                p.terminate()
        killer.join(timeout=30)
    out = (tmp / "slurm.log").read_text()
    print(f"slurm + local runs: {time.monotonic() - t0:.0f} s")
    assert run.returncode == 0, out[-6000:]
    assert local.returncode == 0, (tmp / "local.log").read_text()[-4000:]
    return slurm_work, out, env, victim, local_work


def submissions(out: str) -> list[tuple[str, Path]]:
    """(Slurm job id, log path) of every submission the executor reported."""
    return [(m[1], Path(m[2])) for m in
            re.finditer(r"has been submitted with SLURM jobid (\d+) \(log: (\S+)\)\.", out)]


def test_every_job_ran_as_a_slurm_job(runs):
    work, out, _, victim, _ = runs
    subs = submissions(out)
    logdir = work / SLURM_LOGS
    by_rule: dict[str, list[str]] = {}
    for job_id, log in subs:
        assert log.is_file() and log.name == f"{job_id}.log" and logdir in log.parents, log
        if log.parent.name.removeprefix("rule_") in RULES:
            by_rule.setdefault(log.parent.name.removeprefix("rule_"), []).append(job_id)
    assert sorted(by_rule) == sorted(RULES), by_rule
    assert not [p for p in logdir.iterdir() if p.name.startswith("rule_benchmark_")
                and p.name.removeprefix("rule_") not in RULES], sorted(logdir.iterdir())
    for rule in ("derive_load_profile", "aggregate", "plots", "checksums"):
        assert len(list((logdir / f"rule_{rule}").glob("*.log"))) == 1, rule
    for rule, job_ids in by_rule.items():
        states = [scontrol_job(j)["JobState"] for j in job_ids]
        # one job per group; the killed group has a cancelled job and the one that replaced it
        assert states == (["CANCELLED", "COMPLETED"] if rule == victim.get("rule")
                          else ["COMPLETED"]), (rule, job_ids, states)
        for j in job_ids:
            info = scontrol_job(j)
            # the CPU matrix asks Slurm for no GPU (the rule declares gpu=0 on CPU profiles)
            assert "gpu" not in info.get("TRES", "") + info.get("TresPerJob", "") \
                + info.get("TresPerNode", ""), info
            assert info["Comment"] == f"rule_{rule}", info
            assert info["WorkDir"] == str(work)
            assert info["StdOut"] == str(logdir / f"rule_{rule}" / f"{j}.log")
            # the rule's own sizing (benchmark.smk): 2 cells x 120 s + 330 s -> 10 + 10 min
            assert info["TimeLimit"] == "00:20:00" and info["OverSubscribe"] == "NO", info


def test_killed_cell_was_resubmitted_and_is_in_the_table(runs):
    work, out, _, victim, _ = runs
    assert victim, "no benchmark job was seen running, so none was killed: " + out[-3000:]
    job_id, rule, group = victim["job_id"], victim["rule"], victim["group"]
    assert f"SLURM-job '{job_id}' failed, SLURM status is: 'CANCELLED'" in out, out[-5000:]
    jobs = [j for j, log in submissions(out) if log.parent.name == f"rule_{rule}"]
    assert len(jobs) == 2 and jobs[0] == job_id, jobs
    import pandas as pd

    summary = pd.read_csv(work / OUT / "summary.csv", dtype=str, keep_default_na=False)
    for cell in GROUPS[group]:  # the whole group ran again, in the second job
        report = json.loads((work / OUT / "raw" / f"{cell}.json").read_text())
        assert report["status"] == "ok" and report["token_digest"], report.get("error")
        prov = json.loads((work / OUT / "raw" / f"{cell}.provenance.json").read_text())
        assert prov["benchmark_exit_status"] == 0 and "died" not in prov["process"], prov
        row = summary[summary["cell"] == cell.rsplit("_rep~", 1)[0]]
        assert len(row) == 1 and row["runs_ok"].iloc[0] == "2", summary.to_string()


def test_same_tables_digests_and_files_as_the_local_run(runs):
    import pandas as pd

    work, _, _, _, local = runs
    for table in ("summary.csv", "failure_regimes.csv"):
        s = pd.read_csv(work / OUT / table, dtype=str, keep_default_na=False)
        t = pd.read_csv(local / OUT / table, dtype=str, keep_default_na=False)
        timing = [c for c in s.columns if TIMING.search(c)]
        assert list(s.columns) == list(t.columns)
        # the machine's load during a run (a "contended" note, its core and steal figures) is the
        # machine's state, not a result: two runs of the same cells may differ in it
        machine = [c for c in s.columns if c in ("runs_contended", "other_cores_max", "steal_max")]
        for d in (s, t):
            d["status"] = d["status"].str.replace(r", contended \d+/\d+$", "", regex=True)
        pd.testing.assert_frame_equal(s.drop(columns=timing + machine), t.drop(columns=timing + machine))
    summary = pd.read_csv(work / OUT / "summary.csv", dtype=str)
    status = summary["status"].str.replace(r", contended \d+/\d+$", "", regex=True)
    assert len(summary) == 2 and set(status) == {"ok"}
    assert set(summary["digest_agrees_with_naive"]) == {"reference", "yes"}
    for cell in CELLS:
        s = json.loads((work / OUT / "raw" / f"{cell}.json").read_text())
        t = json.loads((local / OUT / "raw" / f"{cell}.json").read_text())
        assert s["token_digest"] == t["token_digest"] and s["token_digest"], cell
        for key in ("status", "config", "engine_config", "profile", "hardware"):
            assert s[key] == t[key], (cell, key)
        # code hash, thread environment, the process's group and position (timings aside)
        provs = [json.loads((d / OUT / "raw" / f"{cell}.provenance.json").read_text())
                 for d in (work, local)]
        for prov in provs:
            for key in PROCESS_TIMING:
                prov["process"].pop(key)
            prov.pop("machine_load", None)      # the machine's state during the run, not a result
        assert provs[0] == provs[1] and provs[0]["process"]["group"] in GROUPS, cell
    # the same run conditions in the Markdown table (only the run timestamps differ)
    conditions = [[ln for ln in (d / OUT / "summary.md").read_text().splitlines()
                   if ln.startswith("- **") and not ln.startswith(("- **Runs:**", "- **Machine load"))]
                  for d in (work, local)]
    assert conditions[0] == conditions[1] and len(conditions[0]) >= 5
    # the same tracked files, listed in a checksum file that verifies
    checksum = f"results/checkpoint3/{NAME}/checksums.sha256"     # the run's own sums
    listed = [[ln.split("  ", 1)[1] for ln in (d / checksum).read_text().splitlines()]
              for d in (work, local)]
    # raw files (report, CSV, provenance) of every run, 6 tables (CSV + Markdown), 4 plots,
    # the derived load profile (the reduced config has no extra loads)
    assert listed[0] == listed[1], listed[0]
    raw = {f"{OUT}/raw/{cell}.{ext}" for cell in CELLS for ext in ("json", "csv", "provenance.json")}
    assert raw <= set(listed[0]) and f"{OUT}/summary.csv" in listed[0], listed[0]
    ok = subprocess.run(["sha256sum", "-c", checksum], cwd=work, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_nothing_to_do_afterwards(runs):
    work, _, env, _, _ = runs
    r = snakemake(*SLURM_ARGS, "-n", "results/checkpoint3", "--config", f"profile={NAME}",
                  cwd=work, env=env, timeout=120)
    assert r.returncode == 0 and "Nothing to be done" in r.stdout, r.stdout[-3000:]
    assert job_counts(r.stdout) == {}


def test_gpu_profile_cells_ask_slurm_for_one_gpu(runs):
    """A benchmark job of the h200 profile is submitted with --gpus=1 and a time limit that
    covers its group's own timeout; this node has no GPU, so Slurm itself refuses it (nothing
    runs)."""
    work, _, env, _, _ = runs
    dry = snakemake("-n", "--forceall", "-p", "results/checkpoint3", "--config", "profile=h200",
                    cwd=work, env=env, timeout=180)
    # a benchmark job's line is its message (rule name first); its command carries the spec
    rule = re.search(r"^Job \d+: (benchmark_\S+) \(h200,", dry.stdout, re.M)[1]
    spec = re.search(rf"run --spec '(\{{.*?\}})' .*--group {rule[len('benchmark_'):]}\b",
                     dry.stdout)[1]
    cells = [f"results/checkpoint3/h200/raw/{cell}.json" for cell in json.loads(spec)]
    timeout_s = yaml.safe_load((work / "config" / "h200.yaml").read_text())["timeout_s"]
    minutes = min(-(-(len(cells) * timeout_s + 330) // 60) + 10, 24 * 60)  # benchmark.smk's runtime
    # Slurm refuses the job, so it never reads its load profiles: they only have to exist, and
    # then the benchmark job is the only one to run (no derivation job before it)
    h200 = yaml.safe_load((work / "config" / "h200.yaml").read_text())
    for profile in set(re.findall(r"results/checkpoint3/h200/load_profile[^\s,']*\.yaml", spec)):
        (work / profile).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(work / h200["load_profile"], work / profile)
    r = snakemake(*SLURM_ARGS, "--config", "profile=h200", "--retries", "0", cells[0],
                  cwd=work, env=env, timeout=180)
    assert r.returncode != 0
    call = next(ln for ln in r.stdout.splitlines() if ln.strip().startswith("sbatch --parsable"))
    assert re.search(rf"--comment '?rule_{rule}'?( |$)", call), call  # the job of that group
    assert " --gpus=1 " in call and "--exclusive" in call and f" -t {minutes} " in call, call
    assert "SLURM sbatch failed" in r.stdout and "gres" in r.stdout, r.stdout[-3000:]
