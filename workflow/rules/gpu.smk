# All the GPU evidence of one profile in one target (a GPU profile only, e.g. h200):
#
#   snakemake results/gpu --cores 8 --resources gpu=1 --config profile=h200
#
# runs the checkpoint-3 matrix (results/checkpoint3/<profile>/), the prefix-caching sweep
# (results/prefix/<profile>/), the comparison with the hardware floor and HF transformers, the
# decode sweep and the default-flags rows (results/<profile>/compare.*), the structured-output
# cost (results/structured/<profile>/) and the kernel benchmarks (results/kernels/<profile>/).
# Every job records the engine's code hash: an engine edit reruns the measuring jobs, an edit
# of one script only its stage, and `snakemake -n results/gpu ...` after a complete run is idle.
# `snakemake publish publish_gpu --cores 1 --config profile=h200` then makes the run the tracked
# results (the committed sums in checksums/).

# One rule per process group (STRUCTURED_GROUPS in common.smk), named structured_rep<N> (one
# process a repetition) or structured_all (`group_cells_by: all`: every repetition in one process).
for _group, _cells in STRUCTURED_GROUPS.items():

    rule:
        """The structured-output cost cells of one process group, in one process."""
        name:
            f"structured_{_group}"
        input:
            profile=STRUCTURED_CFG["profile"],
            schema=STRUCTURED_CFG["schema"],
            code_changed=STRUCTURED_MARKERS[_group],
        output:
            [f"{STRUCTURED_OUT}/raw/{c}.{ext}" for c in _cells for ext in ("json", "csv", "provenance.json")],
        params:
            spec=json.dumps(_cells),
            raw=lambda wildcards, output: os.path.dirname(output[0]),
            logs=lambda wildcards, output: os.path.join(os.path.dirname(os.path.dirname(output[0])), "logs"),
            code_hash=CODE_HASH,  # engine sources: a change reruns the cells
            tool=f"{SCRIPTS}/run_cells.py",
            device=config["device"],
            torch_threads=config["torch_threads"],
            group=f"structured_{_group}",
        log:
            f"{STRUCTURED_OUT}/logs/{_group}.log",
        resources:
            gpu=GPU,
            benchmark_slot=1,
            # cluster sizing as for the benchmark processes (workflow/rules/benchmark.smk)
            runtime=slurm_runtime(len(_cells) * int(config["timeout_s"]) + 300),  # minutes
            mem_mb=BENCHMARK_MEM_MB,
            cpus_per_task=BENCHMARK_CPUS,
            slurm_partition=BENCHMARK_PARTITION,
            slurm_extra="--exclusive",
        message:
            f"structured-output cost ({PROFILE}): process {_group}, {len(_cells)} cells"
        conda:
            ENV
        shell:
            run_cells_shell()


rule structured_table:
    """The structured-output cost table: constrained against free output throughput per batch."""
    input:
        script=f"{SCRIPTS}/structured_table.py",
        reports=[f"{STRUCTURED_OUT}/raw/{c}.json" for cells in STRUCTURED_CELLS.values() for c in cells],
    output:
        md=f"{STRUCTURED_OUT}/table.md",
        json=f"{STRUCTURED_OUT}/table.json",
    params:
        code_hash=CODE_HASH,
    log:
        f"{STRUCTURED_OUT}/logs/table.log",
    message:
        f"structured-output cost ({PROFILE}): table"
    conda:
        ENV
    shell:
        "python {input.script} --code-hash {params.code_hash} --md {output.md:q} --json {output.json:q}"
        " {input.reports:q} > {log:q} 2>&1"


rule gpu_kernels:
    """`llmserve bench-kernels`: every Triton kernel against its PyTorch reference and cuBLAS."""
    input:
        code_changed=KERNEL_MARKERS,
    output:
        KERNEL_FILES,
    params:
        llmserve=config["llmserve"],
        flags=(config.get("kernels") or {}).get("flags", ""),
        code_hash=CODE_HASH,
        out_dir=lambda wildcards, output: os.path.dirname(output[0]),
    log:
        f"{KERNELS_OUT}/logs/kernels.log",
    resources:
        gpu=GPU,
        benchmark_slot=1,
    message:
        f"kernel benchmarks ({PROFILE})"
    conda:
        ENV
    shell:
        "{params.llmserve} bench-kernels {params.flags} --code-hash {params.code_hash}"
        " --output {params.out_dir} > {log:q} 2>&1"


rule gpu_checksums:
    """sha256 sums of the comparison, kernel and structured-output files of this run."""
    input:
        script=f"{SCRIPTS}/checksums.py",
        files=GPU_TRACKED,
    output:
        GPU_CHECKSUMS,
    log:
        f"{GPU_OUT}/logs/checksums.log",
    message:
        f"GPU evidence ({PROFILE}): checksums"
    conda:
        ENV
    shell:
        "python {input.script} write --output {output} {input.files} > {log} 2>&1"


rule publish_gpu:
    """Make this run's comparison, kernel and structured-output files the tracked ones: their
    run checksums become checksums/gpu-<profile>.sha256 (`publish` does the same for the
    matrix and the prefix sweep)."""
    input:
        GPU_CHECKSUMS,
    output:
        GPU_PUBLISHED,
    log:
        f"{GPU_OUT}/logs/publish.log",
    message:
        f"GPU evidence ({PROFILE}): publish the run's checksums to checksums/"
    conda:
        ENV
    shell:
        "cp {input:q} {output:q} && sha256sum -c --quiet {output:q} > {log:q} 2>&1"


rule gpu:
    """All GPU evidence of the profile (see the top of workflow/rules/gpu.smk)."""
    input:
        gpu_inputs,
    message:
        f"GPU evidence ({PROFILE}): every result present and current"


for _alias in ("results/gpu", "results/gpu/"):

    rule:
        """The GPU evidence as a target: the same as rule gpu."""
        name:
            _alias
        input:
            gpu_inputs,
        message:
            f"GPU evidence ({PROFILE}): every result present and current"
