# Stage 3: tables and plots. The scripts are inputs, so editing one reruns only its stage and
# what follows (never the benchmark cells). Every table and plot is a `report()` output:
#
#   snakemake --report results/checkpoint3/<profile>/report.html results/checkpoint3

rule aggregate:
    """The checkpoint-3 tables (CSV + Markdown) from every cell's raw report."""
    input:
        script=f"{SCRIPTS}/aggregate_checkpoint3.py",
        columns=f"{SCRIPTS}/matrix_columns.py",  # the column table, parse_cell_id
        reports=expand(f"{RAW}/{{cell}}.json", cell=ALL_CELLS),
        provenance=expand(f"{RAW}/{{cell}}.provenance.json", cell=ALL_CELLS),
    output:
        summary_csv=f"{OUT}/summary.csv",
        summary_md=_table("summary", "summary.rst"),
        headline_csv=f"{OUT}/headline.csv",
        headline_md=_table("headline", "headline.rst"),
        chunked_csv=f"{OUT}/chunked_prefill.csv",
        chunked_md=_table("chunked_prefill", "chunked_prefill.rst"),
        rates_csv=f"{OUT}/rates.csv",
        rates_md=_table("rates", "rates.rst"),
        failure_csv=f"{OUT}/failure_regimes.csv",
        failure_md=_table("failure_regimes", "failure_regimes.rst"),
        invariant_csv=f"{OUT}/batch_invariant.csv",
        invariant_md=_table("batch_invariant", "batch_invariant.rst"),
    params:
        profile=PROFILE,
        sweeps=_sweep_args(),
        defaults=json.dumps({k: _fmt(v) for k, v in DEFAULTS.items()}),
        headline_batch=config.get("headline_batch", 8),
        contention=json.dumps(config["contention"]),
        out=lambda wildcards, output: os.path.dirname(output.summary_csv),
    log:
        f"{LOGS}/aggregate.log",
    message:
        f"checkpoint 3 ({PROFILE}): tables from {len(ALL_CELLS)} runs"
    conda:
        ENV
    shell:
        "python {input.script} --profile {params.profile} {params.sweeps}"
        " --defaults {params.defaults:q} --headline-batch {params.headline_batch}"
        " --contention {params.contention:q} --out-dir {params.out} > {log} 2>&1"


rule verdicts:
    """Whether this run reproduced the tracked results: headline numbers against git's committed
    copy, the config's claims judged on this run; also the report's first page."""
    input:
        script=f"{SCRIPTS}/verdicts.py",
        columns=f"{SCRIPTS}/matrix_columns.py",  # the column table
        tables=[f"{OUT}/{name}.csv" for name in TABLE_NAMES],
    output:
        md=_table("verdicts", "verdicts.rst"),
        csv=f"{OUT}/verdicts.csv",
        front=f"{OUT}/report.rst",
    params:
        profile=PROFILE,
        claims=json.dumps(config["claims"]),
        tolerance=config["reproduce_tolerance"],
        out=lambda wildcards, output: os.path.dirname(output.md),
    log:
        f"{LOGS}/verdicts.log",
    message:
        f"checkpoint 3 ({PROFILE}): verdicts against the tracked results"
    conda:
        ENV
    shell:
        "python {input.script} --profile {params.profile} --tables {params.out}"
        " --claims {params.claims:q} --tolerance {params.tolerance}"
        " --out-dir {params.out} > {log} 2>&1"


rule plots:
    """The checkpoint-3 plots from the tables (and the main sweep's raw reports)."""
    input:
        script=f"{SCRIPTS}/plot_checkpoint3.py",
        columns=f"{SCRIPTS}/matrix_columns.py",
        summary=f"{OUT}/summary.csv",
        chunked=f"{OUT}/chunked_prefill.csv",
        rates=f"{OUT}/rates.csv",
        main=expand(f"{RAW}/{{cell}}.json", cell=SWEEP_CELLS["main"]),
    output:
        batch_scaling=_plot("batch_scaling", "batch_scaling.rst"),
        ttft_cdf=_plot("ttft_cdf", "ttft_cdf.rst"),
        chunked_prefill=_plot("chunked_prefill", "chunked_prefill_plot.rst"),
        latency_throughput=_plot("latency_throughput", "latency_throughput.rst"),
    params:
        profile=PROFILE,
        defaults=json.dumps({k: _fmt(v) for k, v in DEFAULTS.items()}),
    log:
        f"{LOGS}/plots.log",
    message:
        f"checkpoint 3 ({PROFILE}): plots"
    conda:
        ENV
    shell:
        "python {input.script} --profile {params.profile} --defaults {params.defaults:q}"
        " --summary {input.summary} --chunked {input.chunked} --rates {input.rates}"
        " --reports {input.main} --batch-scaling {output.batch_scaling}"
        " --ttft-cdf {output.ttft_cdf} --chunked-plot {output.chunked_prefill}"
        " --latency-throughput {output.latency_throughput} > {log} 2>&1"


# The per-request timelines: one rule per figure of the config's `timelines`, named
# timeline_<name> (e.g. timeline_batching), each drawing the lifecycle traces that repetition 0
# of its cells wrote (TIMELINES in common.smk). A figure's caption is
# workflow/report/timeline_<name>.rst, or the generic timeline.rst for a name without one.
for _name, _cells in TIMELINES.items():

    rule:
        """One per-request timeline figure: a panel per cell, a row per request, its spans."""
        name:
            f"timeline_{_name}"
        input:
            script=f"{SCRIPTS}/plot_timeline.py",
            columns=f"{SCRIPTS}/matrix_columns.py",  # cell ids, the cells' words
            traces=[trace_file(c) for c in _cells],
            reports=[f"{RAW}/{c}.json" for c in _cells],
            provenance=[f"{RAW}/{c}.provenance.json" for c in _cells],
        output:
            png=_plot(f"timeline_{_name}", _timeline_caption(_name)),
        params:
            profile=PROFILE,
            figure=_name,
            cells=" ".join(_cells),
            raw=lambda wildcards, input: os.path.dirname(input.reports[0]),
            defaults=json.dumps({k: _fmt(v) for k, v in DEFAULTS.items()}),
        log:
            f"{LOGS}/timeline_{_name}.log",
        message:
            f"checkpoint 3 ({PROFILE}): timeline {_name} ({len(_cells)} cells)"
        conda:
            ENV
        shell:
            "python {input.script} --profile {params.profile} --figure {params.figure}"
            " --defaults {params.defaults:q} --raw {params.raw} --cells {params.cells}"
            " --output {output.png} > {log} 2>&1"
