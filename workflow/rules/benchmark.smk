# Stage 2: one `llmserve benchmark` run per matrix cell (x repetition).
#
# A failed cell is a result, not a workflow error: the harness writes a `status: failed` report
# and exits 0, and if the process dies without a report (outer timeout, OOM kill, segfault) the
# provenance step writes a failed report in its place. Only a broken pipeline (e.g. an unknown
# flag) stops the workflow.
#
# Reruns: `code_hash` changes with any llmserve source file, and Snakemake's params trigger then
# reruns every cell; `flags` changes with the cell's settings. Without Snakemake's metadata (a
# fresh clone of committed results), stale_marker (common.smk) compares the hash each cell
# recorded in its provenance file with the current one and reruns the stale cells. If the
# sources change while the workflow runs, the job fails (before or after measuring) instead of
# keeping a cell measured on code its recorded hash does not describe.

rule code_changed_marker:
    output:
        f"{LOGS}/code-changed/{{cell}}/{{old}}-to-{{new}}.stamp",
    log:
        f"{LOGS}/code-changed/{{cell}}/{{old}}-to-{{new}}.log",
    conda:
        ENV
    shell:
        "echo 'llmserve sources changed since this cell ran: {wildcards.old} -> {wildcards.new}'"
        " > {output:q} 2> {log:q}"


rule benchmark_cell:
    input:
        profile=LOAD_PROFILE,
        code_changed=code_change_marker,
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
        "python {params.tool} check --expected {params.code_hash} > {log:q} 2>&1; "
        "rc=0; timeout -k 30 {params.outer_timeout} {params.llmserve} benchmark {params.flags}"
        " --profile {input.profile:q} --output {output.json:q} --csv {output.csv:q} >> {log:q} 2>&1"
        " || rc=$?; "
        "python {params.tool} provenance --json {output.json:q} --csv {output.csv:q}"
        " --output {output.provenance:q} --cell {wildcards.cell:q} --exit-status $rc"
        " --expected-code-hash {params.code_hash} --device {params.device} --log {log:q} >> {log:q} 2>&1"
