# Stage 2: the benchmark cells, one process per group (the cells of one sweep and repetition,
# of one repetition, or all of them: `group_cells_by`, GROUPS in common.smk), each cell one
# `llmserve benchmark` run inside it
# (workflow/scripts/run_cells.py). Rules are named benchmark_<sweep>_rep<N>, benchmark_rep<N> or
# benchmark_all.
#
# A failed cell is a result, not a workflow error: the harness writes a `status: failed` report
# and the group goes on; if the process dies (outer timeout, OOM kill, segfault), `finalize`
# writes a failed report for every cell it left without one. Only a broken pipeline (e.g. an
# unknown flag) stops the workflow.
#
# Reruns: `code_hash` changes with any llmserve source file, and Snakemake's params trigger then
# reruns every group; `spec` changes with a cell's settings and reruns that cell's group.
# Without Snakemake's metadata (a fresh clone of committed results), stale_marker (common.smk)
# compares the hash each cell recorded in its provenance file with the current one and reruns
# the stale groups. If the sources change while a group runs, the job fails instead of keeping
# a cell measured on code its recorded hash does not describe.
#
# Repetition 0 of a cell that a figure of the config's `timelines` draws also writes its
# requests' lifecycle trace (raw/<cell>.trace.jsonl.gz, one more output of its group; an empty
# trace when the cell failed before writing one).

# Cluster sizing of a benchmark process, read by cluster executors (workflow/profiles/slurm);
# local runs ignore it. The rule names are generated (one per sweep and repetition), so a
# profile's set-resources cannot list them: the rules carry their own sizing, and
# `--set-resources benchmark_<sweep>_rep<N>:KEY=VALUE` still overrides it for one group.
#   runtime          minutes: the process's own limit (outer_timeout below), the 30 s kill grace
#                    and `finalize`, plus 10 min for the job's start-up; at most 24 h
#                    (slurm_runtime in common.smk: a whole matrix in one process would
#                    otherwise ask for its cells' summed worst cases, over a day)
#   mem_mb           host memory (random weights are built on the device; a tiny-model CPU
#                    group peaks below 1 GB)
#   cpus_per_task    torch_threads + 1: torch keeps `torch_threads` intra-op threads (the
#                    tables record them), the extra core is spare room beside them
#   slurm_partition  LLMSERVE_SLURM_GPU_PARTITION, else LLMSERVE_SLURM_PARTITION, else the
#                    cluster's default (site names come from the environment)
#   slurm_extra      --exclusive: no neighbour on the node disturbs the latency numbers
# The GPU request is the `gpu` resource (1 on CUDA profiles: sbatch --gpus=1; 0: none).
BENCHMARK_MEM_MB = 12000
BENCHMARK_CPUS = int(config["torch_threads"]) + 1
BENCHMARK_PARTITION = (os.environ.get("LLMSERVE_SLURM_GPU_PARTITION")
                       or os.environ.get("LLMSERVE_SLURM_PARTITION", ""))


rule code_changed_marker:
    """A marker that makes a cell measured on other llmserve sources rerun."""
    output:
        f"{LOGS}/code-changed/{{cell}}/{{old}}-to-{{new}}.stamp",
    log:
        f"{LOGS}/code-changed/{{cell}}/{{old}}-to-{{new}}.log",
    message:
        "llmserve sources changed since {wildcards.cell} ran: it reruns"
    conda:
        ENV
    shell:
        "echo 'llmserve sources changed since this cell ran: {wildcards.old} -> {wildcards.new}'"
        " > {output:q} 2> {log:q}"


# One rule per group, named benchmark_<sweep>_rep<N> (e.g. benchmark_main_rep0),
# benchmark_rep<N> with `group_cells_by: repetition`, or benchmark_all with `all` (the list:
# `snakemake --list-rules`): a rule's output must be a fixed list of files, and a group's files
# are its cells'.
for _group, _cells in GROUPS.items():

    rule:
        """The benchmark cells of one group (GROUPS in common.smk), in one process."""
        name:
            f"benchmark_{_group}"
        input:
            profiles=sorted({LOAD_FILES[_cell_params(c)["load"]] for c in _cells}),
            code_changed=code_change_markers(_cells),
        output:
            raw_files(_cells),
        params:
            spec=group_spec(_group),
            group=_group,
            raw=lambda wildcards, output: os.path.dirname(output[0]),
            logs=f"{LOGS}/benchmark",
            device=config["device"],
            torch_threads=config["torch_threads"],
            code_hash=CODE_HASH,
            tool=f"{SCRIPTS}/run_cells.py",
            outer_timeout=len(_cells) * int(config["timeout_s"]) + 300,
        log:
            f"{LOGS}/benchmark/{_group}.log",
        threads: int(config["torch_threads"])
        resources:
            gpu=GPU,
            benchmark_slot=1,
            runtime=slurm_runtime(len(_cells) * int(config["timeout_s"]) + 300),  # minutes
            mem_mb=BENCHMARK_MEM_MB,
            cpus_per_task=BENCHMARK_CPUS,
            slurm_partition=BENCHMARK_PARTITION,
            slurm_extra="--exclusive",
        message:
            group_message(_group)
        conda:
            ENV
        shell:
            run_cells_shell(timed=True)  # sources changed / a bad flag fail the job
