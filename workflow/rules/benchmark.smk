# Stage 2: one `llmserve benchmark` run per matrix cell (x repetition).
#
# A failed cell is a result, not a workflow error: the harness writes a `status: failed` report
# and exits 0, and if the process dies without a report (outer timeout, OOM kill, segfault) the
# provenance step writes a failed report in its place. Only a broken pipeline (e.g. an unknown
# flag) stops the workflow.
#
# Reruns: `code_hash` changes with any llmserve source file, and Snakemake's params trigger then
# reruns every cell; `flags` changes with the cell's settings.

rule benchmark_cell:
    input:
        profile=LOAD_PROFILE,
    output:
        json=f"{RAW}/{{cell}}.json",
        csv=f"{RAW}/{{cell}}.csv",
        provenance=f"{RAW}/{{cell}}.provenance.json",
    params:
        llmserve=config["llmserve"],
        flags=benchmark_flags,
        device=config["device"],
        code_hash=CODE_HASH,
        tool=f"{SCRIPTS}/code_hash.py",
        outer_timeout=int(config["timeout_s"]) + 300,
    log:
        f"{LOGS}/benchmark/{{cell}}.log",
    resources:
        gpu=GPU,
        benchmark_slot=1,
    conda:
        ENV
    shell:
        "rc=0; timeout -k 30 {params.outer_timeout} {params.llmserve} benchmark {params.flags}"
        " --profile {input.profile:q} --output {output.json:q} --csv {output.csv:q} > {log:q} 2>&1"
        " || rc=$?; "
        "python {params.tool} provenance --json {output.json:q} --csv {output.csv:q}"
        " --output {output.provenance:q} --cell {wildcards.cell:q} --exit-status $rc"
        " --expected-code-hash {params.code_hash} --device {params.device} --log {log:q} >> {log:q} 2>&1"
