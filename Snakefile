# llmserve experiment pipeline. Reproduce checkpoint 3 (default profile: tiny model, CPU):
#
#     snakemake --cores 1 results/checkpoint3
#
# GPU profile: add `--config profile=h200` (or `--configfile config/checkpoint3-h200.yaml`).
# Stages, one file each under workflow/rules/: workload -> benchmark -> aggregate -> checksums.
# Report with every table and plot: snakemake --report results/checkpoint3/cpu/report.html results/checkpoint3
# Methodology and table columns: docs/benchmarking.md.

import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.utils import min_version, validate

min_version("8.20")


configfile: "config/checkpoint3.yaml"


# Every job runs this checkout's engine (engine/llmserve), never another installed copy: the
# engine is imported through PYTHONPATH (`python -m llmserve.cli`, workflow/scripts/*.py).
ENGINE_DIR = str(Path(workflow.basedir) / "engine")
shell.prefix(f"set -euo pipefail; export PYTHONPATH={ENGINE_DIR}${{{{PYTHONPATH:+:$PYTHONPATH}}}}; ")
sys.path.insert(0, ENGINE_DIR)  # the code hash and the profile validator in this process too


# `--config profile=NAME` selects config/checkpoint3-NAME.yaml (command-line values still win).
# A matrix given whole with `--configfile FILE` needs no such file.
if config.get("profile", "cpu") != "cpu":
    if Path(f"config/checkpoint3-{config['profile']}.yaml").exists():

        configfile: f"config/checkpoint3-{config['profile']}.yaml"

        # Snakemake merges config files key by key; a profile's mappings (load overrides, extra
        # loads, sweeps, ...) replace the default profile's whole, so a GPU matrix inherits no
        # CPU load limit or sweep. Command-line --config values are applied again on top.
        import yaml as _yaml
        from snakemake.utils import update_config as _update_config

        _profile_cfg = _yaml.safe_load(Path(f"config/checkpoint3-{config['profile']}.yaml").read_text())
        for _key, _value in _profile_cfg.items():
            if isinstance(_value, dict):
                config[_key] = _value
        _cli = getattr(getattr(workflow, "config_settings", None), "overwrite_config", None)
        if _cli:
            _update_config(config, _cli)

    elif not workflow.overwrite_configfiles:
        raise WorkflowError(
            f"profile {config['profile']!r}: no config/checkpoint3-{config['profile']}.yaml; "
            "profiles: " + ", ".join(
                sorted(["cpu"] + [p.stem.removeprefix("checkpoint3-")
                                  for p in Path("config").glob("checkpoint3-*.yaml")])))


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/workload.smk"
include: "workflow/rules/benchmark.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/checksums.smk"
include: "workflow/rules/checkpoint4.smk"
include: "workflow/rules/h200.smk"
include: "workflow/rules/prefix.smk"


rule checkpoint3:
    """Every checkpoint-3 result of the selected profile: raw runs, tables, plots, checksums."""
    input:
        TRACKED_FILES,
        CHECKSUM_FILE,
        STALE_MARKERS,  # non-empty only when finished cells ran on other llmserve sources
        PREFIX_FILES,  # the prefix-caching sweep (workflow/rules/prefix.smk)
    default_target: True


# The documented command names the results folder. A folder that other jobs write into cannot
# itself be a job output (Snakemake refuses nested outputs), so the path is registered as the
# *name* of a target rule: Snakemake resolves a target that matches a rule name to that rule.
for _alias in ("results/checkpoint3", "results/checkpoint3/"):

    rule:
        name:
            _alias
        input:
            rules.checkpoint3.input,
