# Stage 3: tables and plots. The scripts are inputs, so editing one reruns only its stage and
# what follows (never the benchmark cells).

rule aggregate:
    input:
        script=f"{SCRIPTS}/aggregate_checkpoint3.py",
        cell_ids=f"{SCRIPTS}/code_hash.py",  # parse_cell_id
        main=expand(f"{RAW}/{{cell}}.json", cell=SWEEP_CELLS["main"]),
        failure_regimes=expand(f"{RAW}/{{cell}}.json", cell=SWEEP_CELLS["failure_regimes"]),
        provenance=expand(f"{RAW}/{{cell}}.provenance.json", cell=ALL_CELLS),
    output:
        summary_csv=f"{OUT}/summary.csv",
        summary_md=f"{OUT}/summary.md",
        failure_csv=f"{OUT}/failure_regimes.csv",
        failure_md=f"{OUT}/failure_regimes.md",
    params:
        profile=PROFILE,
        default_rate=_fmt(config["defaults"]["rate"]),
        default_blocks=_fmt(config["defaults"]["blocks"]),
    log:
        f"{LOGS}/aggregate.log",
    conda:
        ENV
    shell:
        "python {input.script} --profile {params.profile} --default-rate {params.default_rate}"
        " --default-blocks {params.default_blocks}"
        " --main {input.main} --failure-regimes {input.failure_regimes}"
        " --summary-csv {output.summary_csv} --summary-md {output.summary_md}"
        " --failure-csv {output.failure_csv} --failure-md {output.failure_md} > {log} 2>&1"


rule plots:
    input:
        script=f"{SCRIPTS}/plot_checkpoint3.py",
        summary=f"{OUT}/summary.csv",
        main=expand(f"{RAW}/{{cell}}.json", cell=SWEEP_CELLS["main"]),
    output:
        batch_scaling=f"{PLOTS}/batch_scaling.png",
        ttft_cdf=f"{PLOTS}/ttft_cdf.png",
    params:
        profile=PROFILE,
    log:
        f"{LOGS}/plots.log",
    conda:
        ENV
    shell:
        "python {input.script} --profile {params.profile} --summary {input.summary}"
        " --reports {input.main} --batch-scaling {output.batch_scaling}"
        " --ttft-cdf {output.ttft_cdf} > {log} 2>&1"
