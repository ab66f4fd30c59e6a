# Prefix-caching sweep: automatic prefix caching on/off x workload (multi-turn ShareGPT,
# shared system prompt) x arrival rate, each cell one `llmserve benchmark` run, repeated
# `repetitions` times; the cells of one repetition, or of all of them (the section's
# `group_cells_by`), run in one process (workflow/scripts/run_cells.py: torch, the model and the
# prompts load once a process; cells of one engine setting share its built engine), then a table (median [min–max] over
# the repetitions, the coefficient of variation of p50 TTFT) and plots (TTFT CDF with and without
# caching, hit rate). Settings: the `prefix` section of the profile's config (config/config.yaml,
# config/<profile>.yaml). Outputs under results/prefix/<profile>/:
#   load_profile.yaml, raw/workload~<w>_caching~<on|off>_rate~<r>_rep~<n>.{json,csv,provenance.json},
#   table.{csv,md}, plots/ttft_cdf.png, plots/hit_rate.png; checksums in checksums/prefix-<profile>.sha256.
# A process group whose provenance files record another engine code hash reruns (PREFIX_MARKERS).

# Settings, cell ids and flags: workflow/rules/common.smk (PREFIX_*).


rule prefix_settings_marker:
    """A marker that makes the prefix sweep's load profile be derived again (settings changed)."""
    output:
        f"{PREFIX_OUT}/logs/settings/{{digest}}.stamp",
    wildcard_constraints:
        digest=r"[0-9a-f]{16}",
    log:
        f"{PREFIX_OUT}/logs/settings/{{digest}}.log",
    message:
        "prefix sweep ({PROFILE}): settings changed, the load profile is derived again"
    conda:
        ENV
    shell:
        "echo \"prefix settings {wildcards.digest}, $(date -u +%FT%T.%NZ)\" > {output:q} 2> {log:q}"


rule prefix_profile:
    """The prefix sweep's load profile: the base profile with the config's overrides."""
    input:
        # settings changed since the profile on disk was derived (its first line names them)
        settings_changed=PREFIX_PROFILE_MARKERS,
    output:
        PREFIX_PROFILE,
    params:
        script=f"{SCRIPTS}/prefix_sweep.py",
        profile=PROFILE,
        settings=json.dumps(PREFIX_SETTINGS),
        digest=PREFIX_SETTINGS_DIGEST,
    log:
        f"{PREFIX_OUT}/logs/profile.log",
    message:
        "prefix sweep ({params.profile}): load profile"
    conda:
        ENV
    shell:
        "python {params.script} profile --profile {params.profile}"
        " --settings {params.settings:q} --settings-digest {params.digest}"
        " --output {output:q} > {log:q} 2>&1"


# One rule per process group (PREFIX_GROUPS in common.smk), named prefix_cells_rep<N> (one
# process a repetition) or prefix_cells_all (the section's `group_cells_by: all`: every
# repetition in one process).
for _group, _cells in PREFIX_GROUPS.items():
    _timeout = len(_cells) * int(PREFIX_CFG["timeout_s"]) + 300  # the process's limit, s

    rule:
        """The prefix sweep's cells of one process group (every workload x caching x arrival
        rate of its repetitions), in one process: the model and the prompts load once."""
        name:
            f"prefix_cells_{_group}"
        input:
            profile=PREFIX_PROFILE,
            # a group measured on other llmserve sources (the hash its cells recorded) reruns
            code_changed=PREFIX_MARKERS[_group],
        output:
            [f"{PREFIX_OUT}/raw/{c}.{ext}" for c in _cells for ext in ("json", "csv", "provenance.json")],
        params:
            spec=json.dumps(_cells),  # a changed flag reruns the group (where .snakemake/metadata holds the old one)
            group=f"prefix_{_group}",
            raw=lambda w, output: os.path.dirname(output[0]),
            logs=lambda w, output: os.path.join(os.path.dirname(os.path.dirname(output[0])), "logs"),
            device=PREFIX_CFG["device"],
            torch_threads=config["torch_threads"],
            code_hash=CODE_HASH,  # any engine source change reruns the cells
            tool=f"{SCRIPTS}/run_cells.py",
            outer_timeout=_timeout,
        log:
            f"{PREFIX_OUT}/logs/{_group}.log",
        threads: int(config["torch_threads"])
        resources:
            gpu=1 if str(PREFIX_CFG["device"]).startswith("cuda") else 0,
            benchmark_slot=1,  # it measures latency: never beside another measuring job
            # cluster sizing as for the benchmark processes (workflow/rules/benchmark.smk)
            runtime=slurm_runtime(_timeout),  # minutes
            mem_mb=BENCHMARK_MEM_MB,
            cpus_per_task=BENCHMARK_CPUS,
            slurm_partition=BENCHMARK_PARTITION,
            slurm_extra="--exclusive",
        message:
            f"prefix sweep ({PROFILE}): process {_group}, {len(_cells)} cells"
        conda:
            ENV
        shell:
            run_cells_shell(timed=True)  # sources changed / a bad flag fail the job


rule prefix_report:
    """The prefix sweep's table and plots over the repetitions (the script and its helpers are
    inputs: editing them redraws)."""
    input:
        script=f"{SCRIPTS}/prefix_sweep.py",
        # the formatting helpers it imports (median [min–max], CV and the noisy mark)
        helpers=[f"{SCRIPTS}/aggregate_checkpoint3.py", f"{SCRIPTS}/structured_table.py"],
        reports=[f"{PREFIX_OUT}/raw/{c}.json" for cells in PREFIX_CELLS.values() for c in cells],
    output:
        csv=PREFIX_TABLES[0],
        md=report(PREFIX_TABLES[1], caption="../report/prefix_table.rst", category=PREFIX_CATEGORY,
                  labels={"profile": PROFILE, "item": "1. table"}),
        ttft_cdf=report(PREFIX_TABLES[2], caption="../report/prefix_ttft_cdf.rst",
                        category=PREFIX_CATEGORY, labels={"profile": PROFILE, "item": "2. TTFT CDF"}),
        hit_rate=report(PREFIX_TABLES[3], caption="../report/prefix_hit_rate.rst",
                        category=PREFIX_CATEGORY, labels={"profile": PROFILE, "item": "3. hit rate"}),
    params:
        out_dir=lambda w, output: os.path.dirname(output[0]),
        contention=json.dumps(config["contention"]),  # when a run counts as contended
    log:
        f"{PREFIX_OUT}/logs/report.log",
    message:
        f"prefix sweep ({PROFILE}): table and plots of {sum(map(len, PREFIX_CELLS.values()))} runs"
    conda:
        ENV
    shell:
        "python {input.script} report --out-dir {params.out_dir:q} --contention {params.contention:q}"
        " {input.reports:q} > {log:q} 2>&1"


rule prefix_checksums:
    """sha256 sums of the prefix sweep's tracked files."""
    input:
        [PREFIX_PROFILE, *PREFIX_TABLES, *PREFIX_RAW],
    output:
        PREFIX_CHECKSUMS,
    log:
        f"{PREFIX_OUT}/logs/checksums.log",
    message:
        f"prefix sweep ({PROFILE}): checksums"
    conda:
        ENV
    shell:
        "sha256sum {input:q} > {output:q} 2> {log:q}"


rule prefix:
    """The prefix-caching sweep of the selected profile."""
    input:
        PREFIX_FILES,
        PREFIX_MARKER_FILES,
    message:
        f"prefix sweep ({PROFILE}): every result present and current"
