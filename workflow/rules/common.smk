# Shared definitions of the checkpoint-3 pipeline: output paths, the benchmark matrix (cells
# named like snakemake.utils.Paramspace's instance patterns) and helpers. No jobs are defined
# in this file.

import hashlib
import importlib.util
import json
import os
from itertools import product
from pathlib import Path

import pandas as pd
from snakemake.exceptions import WorkflowError

# ----------------------------------------------------------------------------------------------
# Output layout (all paths relative to the working directory, the repository root)
# ----------------------------------------------------------------------------------------------
PROFILE = config["profile"]
OUT = f"results/checkpoint3/{PROFILE}"
RAW = f"{OUT}/raw"
LOGS = f"{OUT}/logs"  # git-ignored (results/**/logs/)
PLOTS = f"{OUT}/plots"
# The run's checksums live beside its results; `snakemake --cores 1 publish` copies them to
# checksums/ (the committed sums, which a rerun never rewrites: `sha256sum -c checksums/*.sha256`
# then says which tracked results the rerun changed).
CHECKSUM_FILE = f"{OUT}/checksums.sha256"
PUBLISHED_CHECKSUM_FILE = f"checksums/checkpoint3-{PROFILE}.sha256"
ENV = "../../envs/llmserve.yaml"  # relative to this file, as the conda directive expects

# The load profile every cell of the `default` load runs: the file itself, or a derived copy with
# the overrides; each extra load is a derived copy of the default load with its own changes.
DERIVE_PROFILE = bool(config.get("load_profile_overrides"))
LOAD_PROFILE = f"{OUT}/load_profile.yaml" if DERIVE_PROFILE else config["load_profile"]
EXTRA_LOADS = dict(config.get("extra_loads") or {})
LOAD_FILES = {"default": LOAD_PROFILE,
              **{name: f"{OUT}/load_profile-{name}.yaml" for name in EXTRA_LOADS}}

# Benchmarks on a GPU declare it, so `--resources gpu=1` serialises them (docs/benchmarking.md).
GPU = 1 if str(config["device"]).startswith("cuda") else 0


def _gpu_jobs_without_a_gpu(dag):
    """The jobs of ``dag`` that would measure on a GPU (a ``gpu`` resource above 0) on this
    machine although torch sees no CUDA device here (see the ``onstart`` handler below)."""
    if not workflow.local_exec:
        return []
    out = []
    for job in dag.needrun_jobs():
        gpu = job.resources.get("gpu")               # evaluated for the job; None: not declared
        if isinstance(gpu, int) and gpu > 0:
            out.append(job)
    if out and _cuda_here():
        return []
    return out


def _cuda_here():
    """Whether torch sees a CUDA device here (without torch in Snakemake's own environment:
    whether an NVIDIA driver's nvidia-smi is on PATH)."""
    try:
        import torch                                 # only when a GPU job is about to run
    except ImportError:
        import shutil

        return shutil.which("nvidia-smi") is not None
    return torch.cuda.is_available()


onstart:
    # A GPU profile's measuring jobs never run on a machine without a GPU, e.g. a laptop that
    # pulled a GPU run's results to rebuild its tables or publish its checksums: such a run would
    # replace the measured results with failed rows (or delete them when its job fails). Checked
    # once the jobs to run are known and before any starts; dry runs and cluster executors,
    # whose jobs run elsewhere, are not concerned.
    _stranded = _gpu_jobs_without_a_gpu(workflow.dag)
    if _stranded:
        _names = sorted({j.rule.name for j in _stranded})
        raise WorkflowError(
            f"{len(_stranded)} job(s) of profile {PROFILE!r} measure on a GPU and torch sees no "
            f"CUDA device on this machine: {', '.join(_names)}. Their results are missing or "
            "measured on other llmserve sources (see `snakemake -n` for the reasons); run them on a GPU machine "
            "(docs/benchmarking.md), or target only what needs no GPU (tables, plots, `publish`). "
            "Nothing was run.")


def _load_code_hash_module():
    """workflow/scripts/code_hash.py as a module (the workflow's scripts are not a package)."""
    path = REPO / SCRIPTS / "code_hash.py"
    spec = importlib.util.spec_from_file_location("checkpoint3_code_hash", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# Hash of every llmserve source file that `llmserve` imports. Passed to each benchmark job as a
# param: Snakemake's params trigger reruns the cells when any engine .py file changes.
_CODE_HASH_MOD = _load_code_hash_module()
CODE_HASH = _CODE_HASH_MOD.code_hash(Path(ENGINE_DIR) / "llmserve")

# ----------------------------------------------------------------------------------------------
# The matrix
# ----------------------------------------------------------------------------------------------
# The columns and the cell-id format: workflow/scripts/matrix_columns.py, the one table the
# rules and the scripts import. Column order = order of the fields in a cell id, e.g.
#   scheduler~continuous_policy~fcfs_batch~8_chunk~0_linear~torch_attn~torch_rate~inf_blocks~auto_load~default_rep~0
# A column of OPTIONAL_COLUMNS is left out of the id at its default value: the batch-invariant
# mode appears as "_invariant~on" before "_rep~".
import matrix_columns

COLUMNS = list(matrix_columns.COLUMN_NAMES)
OPTIONAL_COLUMNS = matrix_columns.OPTIONAL_COLUMNS


def _fmt(value):
    """A matrix value as it appears in a cell id (4.0 -> "4", 0.5 -> "0.5", True -> "on")."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def normalise_cell(cell):
    """Canonical form of a cell: fields the configuration ignores take one fixed value, so the
    same run is never scheduled twice under two names.

    naive keeps no KV cache and runs one request at a time (batch 1, no chunking, no paged
    attention, no block budget, arrival order); paged is continuous batching at batch 1.
    """
    cell = dict(cell)
    if cell["scheduler"] == "naive":
        cell.update(policy="fcfs", batch=1, chunk=0, attn="torch", blocks="auto")
    elif cell["scheduler"] == "paged":
        cell.update(batch=1)
    return {k: _fmt(cell[k]) for k in COLUMNS}


def expand_sweep(blocks, defaults):
    """Cells of one sweep: the union of each block's cartesian product, in order, de-duplicated."""
    cells, seen = [], set()
    for block in blocks:
        lists = [block.get(k, [defaults[k]]) for k in COLUMNS]
        for values in product(*lists):
            cell = normalise_cell(dict(zip(COLUMNS, values)))
            key = tuple(cell.values())
            if key not in seen:
                seen.add(key)
                cells.append(cell)
    return cells


def cell_frame(cells, repetitions):
    """DataFrame of cells x repetitions (every value a string), in matrix order."""
    rows = [dict(cell, rep=str(r)) for cell in cells for r in range(repetitions)]
    return pd.DataFrame(rows, columns=COLUMNS + ["rep"], dtype=str)


def cell_ids(frame):
    """Cell ids of a cell_frame: `name~value` pairs joined by `_` in column order (the form of
    Paramspace's instance patterns), without the optional columns at their default value."""
    return ["_".join(f"{k}~{v}" for k, v in row.items() if OPTIONAL_COLUMNS.get(k) != v)
            for row in frame.to_dict("records")]


DEFAULTS = {**OPTIONAL_COLUMNS, **config["defaults"]}
SWEEPS = {name: expand_sweep(blocks, DEFAULTS) for name, blocks in config["sweeps"].items()}
_ALL = expand_sweep([b for blocks in config["sweeps"].values() for b in blocks], DEFAULTS)
ALL_CELLS = cell_ids(cell_frame(_ALL, config["repetitions"]))
SWEEP_CELLS = {name: cell_ids(cell_frame(cells, config["repetitions"]))
               for name, cells in SWEEPS.items()}
_unknown_loads = sorted({c["load"] for c in _ALL} - set(LOAD_FILES))
if _unknown_loads:
    raise WorkflowError(f"sweeps name loads {_unknown_loads} that are neither 'default' nor keys "
                        f"of extra_loads ({sorted(EXTRA_LOADS)}): add them to extra_loads")


def _cell_params(cell_id):
    """Matrix values of a cell id (the `rep` included; optional columns at their default when
    the id leaves them out)."""
    return matrix_columns.cell_params(cell_id)


# ---- per-request timelines (the config's `timelines`; workflow/scripts/plot_timeline.py) -------
# Repetition 0 of every cell a figure lists runs with `--trace`, writing its requests' lifecycle
# events beside its report; no other cell's flags change (a traced run pays one tuple append a
# step, so only the cells drawn carry it).
TRACED_REP = "0"


def timeline_cells(figures):
    """``{figure: [cell id of repetition 0, ...]}`` of the config's `timelines`.

    Each entry is a mapping of column settings, unset columns taking `defaults`, normalised as
    the sweeps' cells are. A setting that is not a cell of the matrix is refused: a timeline of
    a run that never happens cannot be drawn, and tracing it would add a cell behind the
    sweeps' back.

    Raises:
        WorkflowError: a setting names no cell of the matrix, or a figure lists a cell twice.
    """
    known = set(ALL_CELLS)
    out = {}
    for name, settings in (figures or {}).items():
        ids = []
        for setting in settings:
            cell = normalise_cell({**DEFAULTS, **setting})
            cid = cell_ids(cell_frame([cell], 1))[0]
            if cid not in known:
                wanted = _cell_params(cid)
                nearest = sorted({c.rsplit("_rep~", 1)[0] for c in known},
                                 key=lambda c: sum(_cell_params(c)[k] != wanted[k] for k in COLUMNS))
                raise WorkflowError(
                    f"timelines: figure {name!r} lists {dict(setting)}, i.e. the cell "
                    f"{cid.rsplit('_rep~', 1)[0]}, which no sweep of profile {PROFILE!r} runs. "
                    "List a cell of the matrix (unset columns take `defaults`) or add it to a "
                    "sweep. Nearest cells of the matrix: " + "; ".join(nearest[:3]))
            if cid in ids:
                raise WorkflowError(f"timelines: figure {name!r} lists the cell "
                                    f"{cid.rsplit('_rep~', 1)[0]} twice ({dict(setting)})")
            ids.append(cid)
        out[name] = ids
    return out


TIMELINES = timeline_cells(config.get("timelines"))
TRACED_CELLS = {c for cells in TIMELINES.values() for c in cells}


def trace_file(cell_id):
    """The lifecycle trace a traced cell writes (gzip-compressed JSON lines)."""
    return f"{RAW}/{cell_id}.trace.jsonl.gz"


# Benchmark processes: the cells of one sweep and repetition run in one process (the first sweep
# that names a cell runs it), so start-up (torch, tokenizer, prompts; CUDA context, kernels) is
# paid once a group, while repetitions stay separate processes and an edit of one sweep reruns
# that sweep's groups only. `group_cells_by: repetition` puts every cell of a repetition in one
# process (a CUDA start-up a repetition instead of one a sweep and repetition); `all` puts the
# whole matrix in one process (group `all`), repetition 0's cells first: the runner then runs
# the cells of one engine setting, every repetition of them, on one engine
# (workflow/scripts/run_cells.py), so its weights load, its CUDA graphs are captured and its
# kernels warm up once, not once a repetition.
def group_name(grouping, sweep, rep):
    """The process group of a cell of ``sweep`` and repetition ``rep`` under ``grouping``
    (`sweep`, `repetition` or `all`; the prefix and structured sections name no sweep)."""
    if grouping == "all":
        return "all"
    return f"rep{rep}" if grouping == "repetition" else f"{sweep}_rep{rep}"


GROUPS = {}
_owner = {}
for _sweep, _ids in SWEEP_CELLS.items():
    for _cell in _ids:
        if _cell not in _owner:
            _owner[_cell] = _sweep
            _rep = _cell_params(_cell)["rep"]
            GROUPS.setdefault(group_name(config["group_cells_by"], _sweep, _rep), []).append(_cell)
# within a process, repetition 0 of every cell first, then repetition 1, ... (a stable sort)
GROUPS = {name: sorted(cells, key=lambda c: int(_cell_params(c)["rep"])) for name, cells in GROUPS.items()}


def cell_label(cell_id):
    """A cell in a few words: its scheduler and batch, then every column off the defaults."""
    c = _cell_params(cell_id)
    words = [c["scheduler"]] + ([f"b{c['batch']}"] if c["scheduler"] not in ("naive", "paged") else [])
    words += [f"{k} {c[k]}" for k in COLUMNS
              if k not in ("scheduler", "batch") and c[k] != _fmt(DEFAULTS[k])
              and not (c["scheduler"] == "naive" and k in ("policy", "chunk", "attn"))]
    return " ".join(words)


def group_message(group):
    """The log line of a benchmark group: its sweep, repetition and cells, not its file list."""
    cells = GROUPS[group]
    device = "1 GPU" if GPU else f"{config['torch_threads']} torch thread(s)"
    return (f"benchmark_{group} ({PROFILE}, {len(cells)} cells, {device}): "
            + "; ".join(cell_label(c) for c in cells))


def cell_flags(cell_id):
    """`llmserve benchmark` flags of one cell: every column's flag from the column table
    (matrix_columns.column_flag, in FLAG_ORDER; the load as its profile file), with the
    profile-wide settings after the columns named in `settings_after`, where they have always
    been (the flag string is a param of the benchmark jobs: another order reruns every cell),
    and `--trace` last on the runs a timeline figure draws (TRACED_CELLS)."""
    c = _cell_params(cell_id)
    load = EXTRA_LOADS.get(c["load"]) or {}
    requests = load.get("num_requests", config["requests"])
    values = {**c, "load": LOAD_FILES[c["load"]]}
    settings_after = {
        "attn": [f"--model {config['model']}", f"--device {config['device']}", f"--dtype {config['dtype']}"],
        "load": [f"--requests {requests}", f"--seed {config['seed']}",
                 f"--warmup-requests {config['warmup_requests']}", f"--block-size {config['block_size']}",
                 f"--timeout {config['timeout_s']}", "--no-progress"],
    }
    flags = []
    for column in matrix_columns.columns_in_flag_order():
        flag = matrix_columns.column_flag(column, values[column.name])
        if flag is not None:
            flags.append(flag)
        flags += settings_after.get(column.name, [])
    if config.get("max_num_batched_tokens"):
        flags.append(f"--max-num-batched-tokens {config['max_num_batched_tokens']}")
    slo = config.get("slo") or {}
    if slo.get("ttft_ms"):
        flags.append(f"--slo-ttft-ms {slo['ttft_ms']}")
    if slo.get("tpot_ms"):
        flags.append(f"--slo-tpot-ms {slo['tpot_ms']}")
    if cell_id in TRACED_CELLS:
        flags.append(f"--trace {trace_file(cell_id)}")
    return " ".join(flags)


def group_spec(group):
    """JSON `{cell id: flags}` of one benchmark process (a param: a changed flag reruns it)."""
    return json.dumps({cell: cell_flags(cell) for cell in GROUPS[group]}, sort_keys=False)


def recorded_hash_in(path, *keys):
    """The code hash a job recorded in its JSON output (``keys`` lead to it), else None."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, str) else None


def recorded_code_hash(cell):
    """The llmserve code hash a finished cell recorded in its provenance file (None if absent)."""
    return recorded_hash_in(f"{RAW}/{cell}.provenance.json", "code_hash")


def stale_marker(cell):
    """Marker file for a finished cell whose recorded code hash is not the current one, else None.

    Snakemake's params trigger needs .snakemake/metadata, which a fresh clone of committed results
    lacks. The provenance file travels with the results, so comparing its hash with the current
    one finds stale cells there too. The marker (git-ignored, one folder per cell, named after the
    old and new hash) is an input of the stale cell and of the target rule: the target needs it,
    so it is made, and the cell, whose input is now newer than its outputs, reruns.
    """
    recorded = recorded_code_hash(cell)
    if recorded is not None and recorded != CODE_HASH:
        return marker_path(cell, recorded)
    return None


def marker_path(name, old_hash):
    """The marker of job ``name`` (a cell id or a GPU job) measured on code hash ``old_hash``."""
    return f"{LOGS}/code-changed/{name}/{old_hash[:16]}-to-{CODE_HASH[:16]}.stamp"


def change_markers(name, recorded, paths=()):
    """Markers of one job (a cell, or a GPU job named ``name``) for the current code: a new one
    for each recorded code hash (``recorded``; ``None`` where an output records none) that is
    not the current one, plus those that earlier reruns left for the current code, so the set of
    inputs Snakemake recorded for the job does not change after the rerun (which its `input`
    rerun trigger would otherwise take for a change). See `stale_marker`.

    ``paths`` (the files the hashes were read from, in the same order) keep a marker meaningful
    when its job's outputs come back from elsewhere: a marker that exists already (left by a
    run that stopped before the job finished) but is not newer than an output still recording
    the old hash (a restored or copied output) has its time moved past that output's, so the
    job reruns instead of being taken as current by its newer, stale output."""
    folder = Path(f"{LOGS}/code-changed/{name}")
    found = sorted(str(p) for p in folder.glob(f"*-to-{CODE_HASH[:16]}.stamp"))
    for old in sorted({h for h in recorded if h and h != CODE_HASH}):
        marker = marker_path(name, old)
        if marker not in found:
            found.append(marker)
        elif paths:
            _refresh_marker(marker, [p for h, p in zip(recorded, paths) if h == old])
    return found


def _refresh_marker(marker, stale_outputs):
    """Move ``marker``'s modification time past every file of ``stale_outputs`` (see
    `change_markers`)."""
    try:
        newest = max(os.path.getmtime(p) for p in stale_outputs)
        if os.path.getmtime(marker) <= newest:
            os.utime(marker, (newest + 1, newest + 1))
    except (OSError, ValueError):      # a file went away, or none: nothing to order
        pass


def _hash_markers(name, paths, *keys):
    """`change_markers` of job ``name`` from the code hash each of ``paths`` records (``keys``)."""
    return change_markers(name, [recorded_hash_in(p, *keys) for p in paths], paths)


def code_change_markers(cells):
    """Inputs of a benchmark group: its cells' markers for the current code."""
    return [m for cell in cells for m in _hash_markers(cell, [f"{RAW}/{cell}.provenance.json"], "code_hash")]


def raw_files(cells, kinds=("json", "csv", "provenance.json")):
    """Raw result paths of the given cell ids: ``kinds`` of each, and the lifecycle trace of
    each traced cell (TRACED_CELLS)."""
    return [path for cell in cells
            for path in [f"{RAW}/{cell}.{kind}" for kind in kinds]
            + ([trace_file(cell)] if cell in TRACED_CELLS else [])]


def deep_merge(base, overrides):
    """`base` with `overrides` applied as a JSON merge patch (RFC 7386): nested mappings are
    merged, a null value removes the key (e.g. `scale: null` when an output length changes from
    `dataset` to `lognormal`), everything else is replaced."""
    out = dict(base)
    for key, value in (overrides or {}).items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


PLOT_NAMES = ["batch_scaling", "ttft_cdf", "chunked_prefill", "latency_throughput"]
PLOT_FILES = [f"{PLOTS}/{name}.png" for name in PLOT_NAMES]
#: The per-request timelines, one PNG a figure of the config's `timelines`.
TIMELINE_FILES = [f"{PLOTS}/timeline_{name}.png" for name in TIMELINES]
TABLE_NAMES = ["summary", "headline", "chunked_prefill", "rates", "failure_regimes",
               "batch_invariant"]
TABLE_FILES = [f"{OUT}/{name}.{ext}" for name in TABLE_NAMES for ext in ("csv", "md")]
STALE_MARKERS = sorted({m for m in map(stale_marker, ALL_CELLS) if m})
#: The reproduction verdicts and the report's first page (workflow/scripts/verdicts.py).
VERDICT_FILES = [f"{OUT}/verdicts.md", f"{OUT}/verdicts.csv", f"{OUT}/report.rst"]
TRACKED_FILES = (([LOAD_PROFILE] if DERIVE_PROFILE else [])
                 + [LOAD_FILES[name] for name in EXTRA_LOADS] + raw_files(ALL_CELLS)
                 + TABLE_FILES + PLOT_FILES + TIMELINE_FILES + VERDICT_FILES)

wildcard_constraints:
    cell="[a-z]+~[^/]+",


def write_derived_profile(base_path, overrides, output_path, log_path):
    """Write `base_path` with `overrides` applied to `output_path`, validated by the benchmark
    harness's own profile validator (a bad override fails here, before any cell runs)."""
    import yaml
    from llmserve.bench.workload import validate_profile

    derived = yaml.safe_load(Path(base_path).read_text())
    for layer in overrides if isinstance(overrides, list) else [overrides]:
        derived = deep_merge(derived, layer)
    validate_profile(derived, source=output_path)
    header = (f"# Derived load profile: {base_path} with the load overrides of the\n"
              f"# checkpoint-3 config (profile {PROFILE}). Written by the pipeline; edit the\n"
              f"# config instead. Field reference: engine/llmserve/bench/workload.py.\n")
    Path(output_path).write_text(header + yaml.safe_dump(derived, sort_keys=False))
    Path(log_path).write_text(f"derived {output_path} from {base_path} with {overrides}\n")


# ----------------------------------------------------------------------------------------------
# Tables and plots (aggregate.smk): arguments and report() entries
# ----------------------------------------------------------------------------------------------
REPORT = "../report"  # captions, relative to the rule files


def _sweep_args(wildcards=None):
    """`--sweep NAME REPORT...` for every sweep of the matrix."""
    return " ".join(f"--sweep {name} " + " ".join(f"{RAW}/{c}.json" for c in cells)
                    for name, cells in SWEEP_CELLS.items() if cells)


# The report's menu, in this order: the results first (verdicts, headline, every table), then
# the plots, then the prefix-caching sweep. The first page is workflow/report/workflow.rst.
RESULTS, PLOTS_CATEGORY, PREFIX_CATEGORY = "1. Results", "2. Plots", "3. Prefix caching"
_TABLE_ORDER = ["verdicts", "headline", "summary", "chunked_prefill", "rates", "failure_regimes",
                "batch_invariant"]


def _table(name, caption):
    return report(f"{OUT}/{name}.md", caption=f"{REPORT}/{caption}", category=RESULTS,
                  labels={"profile": PROFILE,
                          "table": f"{_TABLE_ORDER.index(name) + 1}. {name.replace('_', ' ')}"})


def _plot(name, caption):
    return report(f"{PLOTS}/{name}.png", caption=f"{REPORT}/{caption}", category=PLOTS_CATEGORY,
                  labels={"profile": PROFILE, "plot": name.replace("_", " ")})


def _timeline_caption(name):
    """The caption of timeline figure ``name``: workflow/report/timeline_<name>.rst, or the
    generic timeline.rst for a figure the report has no words of its own for."""
    own = f"timeline_{name}.rst"
    return own if (REPO / "workflow" / "report" / own).exists() else "timeline.rst"


# ---- the prefix-caching sweep (workflow/rules/prefix.smk; settings: the config's `prefix`) ----
PREFIX_CFG = config.get("prefix")
PREFIX_OUT = f"results/prefix/{PROFILE}"
PREFIX_PROFILE = f"{PREFIX_OUT}/load_profile.yaml"  # the derived load profile every cell runs
#: What the derived load profile is made from (the config's base profile and overrides).
PREFIX_SETTINGS = {k: (PREFIX_CFG or {}).get(k) for k in ("base_profile", "profile_overrides")}


def prefix_settings_digest():
    """16 hex digits of sha256 over the prefix settings and the base profile's text: the derived
    profile records it in its first line, so a profile derived from other settings reruns."""
    h = hashlib.sha256(json.dumps(PREFIX_SETTINGS, sort_keys=True).encode())
    base = PREFIX_SETTINGS.get("base_profile")
    if base and (REPO / base).is_file():
        h.update((REPO / base).read_bytes())
    return h.hexdigest()[:16]


def prefix_profile_markers():
    """Inputs of the prefix sweep's profile job that make it rerun when its settings changed:
    a marker named by the current settings digest, listed while the profile on disk records
    another digest (or none) and kept listed once made (so the recorded input set stays the
    same after the rerun). Snakemake's params trigger needs .snakemake/metadata, which a fresh
    clone or a copied tree lacks; the digest travels with the profile. Like the code-hash
    markers, a marker is made only where a target asks for it: `prefix`, `results/checkpoint3`
    and `results/gpu` do (PREFIX_MARKER_FILES); a bare file target does not. A marker left
    beside a stale profile (a restored file) is removed by the main Snakemake process, so it is
    made again with new contents (Snakemake compares an input's checksum, not only its time);
    a cluster job reading the workflow again leaves it alone (it may be that job's input).
    The digest covers a base profile given as a file; a built-in profile name counts as its
    name."""
    if not PREFIX_CFG:
        return []
    marker = f"{PREFIX_OUT}/logs/settings/{PREFIX_SETTINGS_DIGEST}.stamp"
    try:
        head = Path(PREFIX_PROFILE).read_text().split("\n", 1)[0]
    except OSError:
        head = None                  # no profile yet: the rule runs anyway
    stale = head is not None and f"settings {PREFIX_SETTINGS_DIGEST}" not in head
    if stale and os.path.exists(marker) and workflow.is_main_process:
        os.remove(marker)
    return [marker] if stale or os.path.exists(marker) else []


PREFIX_SETTINGS_DIGEST = prefix_settings_digest() if PREFIX_CFG else ""
PREFIX_PROFILE_MARKERS = prefix_profile_markers()


def prefix_cell_id(workload, caching, rate, rep, invariant=False):
    """A prefix-sweep cell id: ``workload~multi-turn_caching~on_rate~32_rep~0`` (the rate as
    ``{:g}`` formats it); a cell of the batch-invariant check has ``_invariant~on`` before
    ``_rep~``."""
    mode = "_invariant~on" if invariant else ""
    return f"workload~{workload}_caching~{caching}_rate~{float(rate):g}{mode}_rep~{rep}"


def prefix_cell_flags(workload, caching, rate, invariant=False):
    """`llmserve benchmark` flags of one cell of the prefix sweep (without --output/--csv);
    ``invariant``: with ``--batch-invariant``."""
    p = PREFIX_CFG
    return (f"--model {p['model']} --device {p['device']} --dtype {p['dtype']}"
            f" --block-size {p['block_size']} --requests {p['requests']}"
            f" --warmup-requests {p['warmup_requests']} --seed {p['seed']} --timeout {p['timeout_s']}"
            f" --profile {PREFIX_PROFILE} --workload {workload} --arrival-rate {float(rate):g}"
            f" {'--enable-prefix-caching' if caching == 'on' else '--no-prefix-caching'} --no-progress"
            f" --attention-backend {p.get('attention_backend', 'torch')} --code-hash {CODE_HASH}"
            + "".join(f" --{k.replace('_', '-')} {p[k]}" for k in ("max_num_seqs", "max_num_batched_tokens",
                                                                    "prefill_chunk_size", "max_model_len")
                   if k in p)
            + (" --batch-invariant" if invariant else ""))


def prefix_rates(workload):
    """The arrival rates of ``workload`` in the prefix sweep: ``arrival_rates`` itself when it
    is a list, else its entry for the workload (a workload it does not name stops the run)."""
    rates = PREFIX_CFG["arrival_rates"]
    if isinstance(rates, dict):
        if workload not in rates:
            raise ValueError(f"prefix.arrival_rates names no rates for workload {workload!r} "
                             f"(it has {sorted(rates)})")
        return rates[workload]
    return rates


def prefix_cells():
    """``{rep: {cell id: benchmark flags}}`` of the prefix sweep: every workload x caching x
    its arrival rates once per repetition, then the `invariant_check` cells (its workload and
    rate, caching on and off, with --batch-invariant) in its first `repetitions` (default:
    the sweep's) repetitions. The processes that run them: PREFIX_GROUPS."""
    p = PREFIX_CFG
    cells = {rep: {prefix_cell_id(w, c, r, rep): prefix_cell_flags(w, c, r)
                   for w in p["workloads"] for r in prefix_rates(w) for c in p["caching"]}
             for rep in range(int(p["repetitions"]))}
    check = p.get("invariant_check")
    if check:
        w, r = check["workload"], check["rate"]
        runs = int(check.get("repetitions", p["repetitions"]))
        if set(p["caching"]) != {"on", "off"}:
            raise ValueError("prefix.invariant_check compares caching on with off: prefix.caching "
                             f"must hold both (it has {p['caching']})")
        if runs > int(p["repetitions"]):
            raise ValueError(f"prefix.invariant_check.repetitions ({runs}) must not exceed "
                             f"prefix.repetitions ({p['repetitions']})")
        for rep in range(runs):
            cells.setdefault(rep, {}).update(
                {prefix_cell_id(w, c, r, rep, True): prefix_cell_flags(w, c, r, True) for c in p["caching"]})
    return cells


PREFIX_CELLS = prefix_cells() if PREFIX_CFG else {}


def process_groups(cells_by_rep, grouping):
    """``{group: {cell id: flags}}``: the processes a sweep's cells run in. ``grouping``
    `repetition` gives one process a repetition (groups ``rep0``, ``rep1``, ...); `all` one
    process for every repetition (group ``all``, repetition 0's cells first), in which the
    runner (workflow/scripts/run_cells.py) runs the cells that share an engine setting, every
    repetition of them, on one engine, built, captured and warmed once. Names: group_name."""
    groups = {}
    for rep in sorted(cells_by_rep):
        groups.setdefault(group_name(grouping, None, rep), {}).update(cells_by_rep[rep])
    return groups


PREFIX_GROUPS = process_groups(PREFIX_CELLS, PREFIX_CFG.get("group_cells_by", "repetition")) if PREFIX_CFG else {}
PREFIX_TABLES = [f"{PREFIX_OUT}/table.csv", f"{PREFIX_OUT}/table.md",
                 f"{PREFIX_OUT}/plots/ttft_cdf.png", f"{PREFIX_OUT}/plots/hit_rate.png"]
PREFIX_CHECKSUMS = f"{PREFIX_OUT}/checksums.sha256"  # the run's; published to checksums/
PREFIX_RAW = [f"{PREFIX_OUT}/raw/{c}.{ext}" for cells in PREFIX_CELLS.values() for c in cells
              for ext in ("json", "csv", "provenance.json")]
#: Everything the sweep tracks (empty for a profile without a `prefix` section).
PREFIX_FILES = [PREFIX_PROFILE, *PREFIX_TABLES, PREFIX_CHECKSUMS, *PREFIX_RAW] if PREFIX_CFG else []


# ---- the GPU evidence (workflow/rules/gpu.smk) ---------------------------------------------------
STRUCTURED_CFG = config.get("structured")
# the comparison's folder: the GPU profile's name (results/h200 for the default profile's runs)
GPU_OUT = f"results/{PROFILE}" if PROFILE != "cpu" else "results/h200"
STRUCTURED_OUT = f"results/structured/{PROFILE}"
KERNELS_OUT = f"results/kernels/{PROFILE}"
GPU_CHECKSUMS = f"{GPU_OUT}/checksums.sha256"  # this run's sums; `publish_gpu` commits them
GPU_PUBLISHED = f"checksums/gpu-{PROFILE}.sha256"


def structured_cells():
    """``{rep: {cell id: benchmark flags}}`` of the structured-output cost: every max batch size
    with and without the JSON schema, the same seeded workload in each pair."""
    s = STRUCTURED_CFG
    out = {}
    for rep in range(int(s["repetitions"])):
        cells = {}
        for b in s["batches"]:
            batch, requests = b["max_num_seqs"], b["requests"]
            for schema in ("off", "on"):
                flags = [f"--config continuous --max-num-seqs {batch} --requests {requests}",
                         f"--model {config['model']} --device {config['device']} --dtype {config['dtype']}",
                         f"--profile {s['profile']} --seed {config['seed']} --timeout {config['timeout_s']}",
                         "--no-progress"]
                if schema == "on":
                    flags.append(f"--json-schema {s['schema']}")
                cells[f"batch~{batch}_schema~{schema}_rep~{rep}"] = " ".join(flags)
        out[rep] = cells
    return out


STRUCTURED_CELLS = structured_cells() if STRUCTURED_CFG else {}
STRUCTURED_GROUPS = (process_groups(STRUCTURED_CELLS, STRUCTURED_CFG.get("group_cells_by", "repetition"))
                     if STRUCTURED_CFG else {})
STRUCTURED_FILES = (
    [f"{STRUCTURED_OUT}/raw/{c}.{ext}" for cells in STRUCTURED_CELLS.values() for c in cells
     for ext in ("json", "csv")]
    + [f"{STRUCTURED_OUT}/table.md", f"{STRUCTURED_OUT}/table.json"]
    if STRUCTURED_CFG else [])
COMPARE_FILES = [f"{GPU_OUT}/compare.json", f"{GPU_OUT}/compare.md", f"{GPU_OUT}/decode_sweep.png"]
KERNEL_FILES = [f"{KERNELS_OUT}/kernels.json", f"{KERNELS_OUT}/kernels.md"]
GPU_TRACKED = COMPARE_FILES + KERNEL_FILES + STRUCTURED_FILES



def gpu_inputs(wildcards):
    """Inputs of `results/gpu`: every result of a GPU profile (refused on a CPU profile)."""
    if str(config["device"]) == "cpu" or not STRUCTURED_CFG:
        raise WorkflowError(f"results/gpu needs a GPU profile with a `structured` section "
                            f"(e.g. --config profile=h200); profile {PROFILE!r} runs on {config['device']}")
    return [*rules.checkpoint3.input, *GPU_TRACKED, GPU_CHECKSUMS, *GPU_MARKERS]




#: Change markers of the GPU jobs and of the prefix sweep's repetitions (the hash each output
#: recorded; a repetition's cells rerun together when any of their provenance files names another
#: hash). The jobs and the targets take them as inputs: the target needs a marker, so it is made,
#: and the job whose input it is reruns.
COMPARE_MARKERS = _hash_markers("gpu~compare", [f"{GPU_OUT}/compare.json"], "code_hash")
KERNEL_MARKERS = _hash_markers("gpu~kernels", [KERNEL_FILES[0]], "env", "code_hash")
STRUCTURED_MARKERS = {
    group: _hash_markers(f"gpu~structured_{group}",
                         [f"{STRUCTURED_OUT}/raw/{c}.provenance.json" for c in cells], "code_hash")
    for group, cells in STRUCTURED_GROUPS.items()}
PREFIX_MARKERS = {
    group: _hash_markers(f"prefix~{PROFILE}~{group}",
                         [f"{PREFIX_OUT}/raw/{c}.provenance.json" for c in cells], "code_hash")
    for group, cells in PREFIX_GROUPS.items()}
PREFIX_MARKER_FILES = PREFIX_PROFILE_MARKERS + [m for ms in PREFIX_MARKERS.values() for m in ms]
GPU_MARKERS = (COMPARE_MARKERS + KERNEL_MARKERS + [m for ms in STRUCTURED_MARKERS.values() for m in ms]
               + PREFIX_MARKER_FILES)


def slurm_runtime(process_limit_s):
    """A cluster job's time limit in minutes for a process whose own limit is
    ``process_limit_s``: that limit, the 30 s kill grace and `finalize`, plus 10 min for the
    job's start-up; at most 24 h (1,440 min), the longest many partitions allow (the limit
    sums every cell's worst case: a whole GPU matrix in one process would ask for ~26 h)."""
    return min(-(-(int(process_limit_s) + 30) // 60) + 10, 24 * 60)


def run_cells_shell(timed=False):
    """The shell of a job that runs a group of cells in one process (workflow/scripts/run_cells.py)
    and then `finalize`s it, so a cell the process left without a report is a failed row; exit
    status 1 (sources changed) or 2 (a bad flag) fails the job. Params: tool, spec, raw, logs,
    code_hash, device, torch_threads, group; with ``timed``, outer_timeout (seconds) too."""
    limit = "timeout -k 30 {params.outer_timeout} " if timed else ""
    return "".join([
        "rc=0; ", limit, "python {params.tool} run --spec {params.spec:q} --raw {params.raw}"
        " --log-dir {params.logs} --code-hash {params.code_hash} --device {params.device}"
        " --torch-threads {params.torch_threads} --group {params.group} > {log:q} 2>&1 || rc=$?; "
        "if [ $rc -eq 1 ] || [ $rc -eq 2 ]; then exit $rc; fi; "
        "python {params.tool} finalize --spec {params.spec:q} --raw {params.raw}"
        " --log-dir {params.logs} --code-hash {params.code_hash} --device {params.device}"
        " --group {params.group} --exit-status $rc >> {log:q} 2>&1"])
