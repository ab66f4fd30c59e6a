# Prefix-caching sweep: automatic prefix caching on/off x workload (multi-turn ShareGPT,
# shared system prompt) x arrival rate, one `llmserve benchmark` run per cell, then a table
# and plots (TTFT CDF with and without caching, hit rate). Settings: config/prefix.yaml, keyed
# by the main config's `profile`. Outputs under results/prefix/<profile>/:
#   load_profile.yaml, raw/<workload>_<on|off>_r<rate>.{json,csv}, table.{csv,md},
#   plots/ttft_cdf.png, plots/hit_rate.png; checksums in checksums/prefix-<profile>.sha256.

import yaml as _prefix_yaml

_PREFIX_ALL = _prefix_yaml.safe_load(open("config/prefix.yaml"))
_PREFIX_PROFILE = config.get("profile", "cpu")
PREFIX_CFG = _PREFIX_ALL.get(_PREFIX_PROFILE)
PREFIX_OUT = f"results/prefix/{_PREFIX_PROFILE}"
PREFIX_CELLS = ([f"{w}_{c}_r{r:g}" for w in PREFIX_CFG["workloads"] for c in PREFIX_CFG["caching"]
                 for r in PREFIX_CFG["arrival_rates"]] if PREFIX_CFG else [])
PREFIX_TABLES = [f"{PREFIX_OUT}/table.csv", f"{PREFIX_OUT}/table.md",
                 f"{PREFIX_OUT}/plots/ttft_cdf.png", f"{PREFIX_OUT}/plots/hit_rate.png"]
PREFIX_CHECKSUMS = f"checksums/prefix-{_PREFIX_PROFILE}.sha256"
#: Everything the sweep tracks (empty for a profile without a prefix entry).
PREFIX_FILES = ([f"{PREFIX_OUT}/load_profile.yaml", *PREFIX_TABLES, PREFIX_CHECKSUMS]
                + [f"{PREFIX_OUT}/raw/{c}.{ext}" for c in PREFIX_CELLS for ext in ("json", "csv")]
                ) if PREFIX_CFG else []


def _prefix_cell_flags(wildcards):
    w, c, r = wildcards.workload, wildcards.caching, wildcards.rate
    p = PREFIX_CFG
    return (f"--model {p['model']} --device {p['device']} --dtype {p['dtype']}"
            f" --block-size {p['block_size']} --requests {p['requests']}"
            f" --warmup-requests {p['warmup_requests']} --seed {p['seed']} --timeout {p['timeout_s']}"
            f" --workload {w} --arrival-rate {r}"
            f" {'--enable-prefix-caching' if c == 'on' else '--no-prefix-caching'} --no-progress"
            f" --attention-backend {p.get('attention_backend', 'torch')}"
            + "".join(f" --{k.replace('_', '-')} {p[k]}" for k in ("max_num_seqs", "max_num_batched_tokens",
                                                                    "prefill_chunk_size") if k in p))


rule prefix_profile:
    output:
        f"{PREFIX_OUT}/load_profile.yaml",
    params:
        profile=_PREFIX_PROFILE,
    shell:
        "python workflow/scripts/prefix_sweep.py profile --profile {params.profile} --output {output:q}"


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
    resources:
        gpu=1 if PREFIX_CFG and str(PREFIX_CFG["device"]).startswith("cuda") else 0,
    log:
        f"{PREFIX_OUT}/logs/{{workload}}_{{caching}}_r{{rate}}.log",
    shell:
        "rm -f {output.csv:q}; {params.llmserve} benchmark {params.flags} --profile {input.profile:q}"
        " --output {output.json:q} --csv {output.csv:q} > {log:q} 2>&1"


rule prefix_report:
    input:
        [f"{PREFIX_OUT}/raw/{c}.json" for c in PREFIX_CELLS],
    output:
        PREFIX_TABLES,
    shell:
        "python workflow/scripts/prefix_sweep.py report --out-dir {PREFIX_OUT} {input:q}"


rule prefix_checksums:
    input:
        [f"{PREFIX_OUT}/load_profile.yaml", *PREFIX_TABLES]
        + [f"{PREFIX_OUT}/raw/{c}.{ext}" for c in PREFIX_CELLS for ext in ("json", "csv")],
    output:
        PREFIX_CHECKSUMS,
    shell:
        "sha256sum {input:q} > {output:q}"


rule prefix:
    """The prefix-caching sweep of the selected profile."""
    input:
        PREFIX_FILES,
