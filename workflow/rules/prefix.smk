# Prefix-caching sweep: automatic prefix caching on/off x workload (multi-turn ShareGPT,
# shared system prompt) x arrival rate, one `llmserve benchmark` run per cell, then a table
# and plots (TTFT CDF with and without caching, hit rate). Settings: the `prefix` section of
# the profile's config (config/config.yaml, config/<profile>.yaml). Outputs under results/prefix/<profile>/:
#   load_profile.yaml, raw/<workload>_<on|off>_r<rate>.{json,csv}, table.{csv,md},
#   plots/ttft_cdf.png, plots/hit_rate.png; checksums in checksums/prefix-<profile>.sha256.

# Settings, cell names and flags: workflow/rules/common.smk (PREFIX_*).


rule prefix_profile:
    """The prefix sweep's load profile: the base profile with the config's overrides."""
    output:
        f"{PREFIX_OUT}/load_profile.yaml",
    params:
        script=f"{SCRIPTS}/prefix_sweep.py",
        profile=PROFILE,
        settings=json.dumps({k: (PREFIX_CFG or {}).get(k) for k in ("base_profile", "profile_overrides")}),
    log:
        f"{PREFIX_OUT}/logs/profile.log",
    message:
        "prefix sweep ({params.profile}): load profile"
    conda:
        ENV
    shell:
        "python {params.script} profile --profile {params.profile}"
        " --settings {params.settings:q} --output {output:q} > {log:q} 2>&1"


rule prefix_cell:
    """One cell of the prefix sweep: a workload, caching on or off, an arrival rate."""
    input:
        profile=f"{PREFIX_OUT}/load_profile.yaml",
        # a cell measured on other llmserve sources (the hash its report records) reruns
        code_changed=lambda w: PREFIX_MARKERS[f"{w.workload}_{w.caching}_r{w.rate}"],
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
        benchmark_slot=1,  # it measures latency: never beside another measuring job
    log:
        f"{PREFIX_OUT}/logs/{{workload}}_{{caching}}_r{{rate}}.log",
    message:
        f"prefix sweep ({PROFILE}): {{wildcards.workload}}, caching {{wildcards.caching}}, {{wildcards.rate}} req/s"
    conda:
        ENV
    shell:
        "rm -f {output.csv:q}; {params.llmserve} benchmark {params.flags} --profile {input.profile:q}"
        " --code-hash {params.code} --output {output.json:q} --csv {output.csv:q} > {log:q} 2>&1"


rule prefix_report:
    """The prefix sweep's table and plots (the script is an input: editing it redraws)."""
    input:
        script=f"{SCRIPTS}/prefix_sweep.py",
        reports=[f"{PREFIX_OUT}/raw/{c}.json" for c in PREFIX_CELLS],
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
    log:
        f"{PREFIX_OUT}/logs/report.log",
    message:
        f"prefix sweep ({PROFILE}): table and plots of {len(PREFIX_CELLS)} cells"
    conda:
        ENV
    shell:
        "python {input.script} report --out-dir {params.out_dir:q} {input.reports:q} > {log:q} 2>&1"


rule prefix_checksums:
    """sha256 sums of the prefix sweep's tracked files."""
    input:
        [f"{PREFIX_OUT}/load_profile.yaml", *PREFIX_TABLES]
        + [f"{PREFIX_OUT}/raw/{c}.{ext}" for c in PREFIX_CELLS for ext in ("json", "csv")],
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
