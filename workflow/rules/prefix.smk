# Prefix-caching sweep: automatic prefix caching on/off x workload (multi-turn ShareGPT,
# shared system prompt) x arrival rate, one `llmserve benchmark` run per cell, then a table
# and plots (TTFT CDF with and without caching, hit rate). Settings: config/prefix.yaml, keyed
# by the main config's `profile`. Outputs under results/prefix/<profile>/:
#   load_profile.yaml, raw/<workload>_<on|off>_r<rate>.{json,csv}, table.{csv,md},
#   plots/ttft_cdf.png, plots/hit_rate.png; checksums in checksums/prefix-<profile>.sha256.

# Settings, cell names and flags: workflow/rules/common.smk (PREFIX_*).


rule prefix_profile:
    output:
        f"{PREFIX_OUT}/load_profile.yaml",
    params:
        profile=_PREFIX_PROFILE,
    log:
        f"{PREFIX_OUT}/logs/profile.log",
    conda:
        ENV
    shell:
        "python workflow/scripts/prefix_sweep.py profile --profile {params.profile} --output {output:q} > {log:q} 2>&1"


rule prefix_cell:
    input:
        profile=f"{PREFIX_OUT}/load_profile.yaml",
    output:
        json=f"{PREFIX_OUT}/raw/{{workload}}_{{caching}}_r{{rate}}.json",
        csv=f"{PREFIX_OUT}/raw/{{workload}}_{{caching}}_r{{rate}}.csv",
    wildcard_constraints:
        workload="multi-turn|shared-prefix|single-turn",
        caching="on|off",
    params:
        flags=_prefix_cell_flags,
        llmserve=config["llmserve"],
        code=CODE_HASH,  # any engine source change reruns the cells
    resources:
        gpu=1 if PREFIX_CFG and str(PREFIX_CFG["device"]).startswith("cuda") else 0,
    log:
        f"{PREFIX_OUT}/logs/{{workload}}_{{caching}}_r{{rate}}.log",
    conda:
        ENV
    shell:
        "rm -f {output.csv:q}; {params.llmserve} benchmark {params.flags} --profile {input.profile:q}"
        " --output {output.json:q} --csv {output.csv:q} > {log:q} 2>&1"


rule prefix_report:
    input:
        [f"{PREFIX_OUT}/raw/{c}.json" for c in PREFIX_CELLS],
    output:
        PREFIX_TABLES,
    params:
        out_dir=lambda w, output: os.path.dirname(output[0]),
    log:
        f"{PREFIX_OUT}/logs/report.log",
    conda:
        ENV
    shell:
        "python workflow/scripts/prefix_sweep.py report --out-dir {params.out_dir:q} {input:q} > {log:q} 2>&1"


rule prefix_checksums:
    input:
        [f"{PREFIX_OUT}/load_profile.yaml", *PREFIX_TABLES]
        + [f"{PREFIX_OUT}/raw/{c}.{ext}" for c in PREFIX_CELLS for ext in ("json", "csv")],
    output:
        PREFIX_CHECKSUMS,
    log:
        f"{PREFIX_OUT}/logs/checksums.log",
    conda:
        ENV
    shell:
        "sha256sum {input:q} > {output:q} 2> {log:q}"


rule prefix:
    """The prefix-caching sweep of the selected profile."""
    input:
        PREFIX_FILES,
