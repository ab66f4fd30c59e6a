# Stage 4: the run's sha256sum file over every tracked result file of the profile, beside the
# results (results/checkpoint3/<profile>/checksums.sha256), verifiable from the repository root
# with `sha256sum -c`. The committed sums in checksums/ are written only by `publish`, so after a
# rerun `sha256sum -c checksums/*.sha256` still checks the tracked results (and names the files
# the rerun changed), while the run's own sums check the new files.

rule checksums:
    """sha256 sums of every tracked checkpoint-3 file of the profile."""
    input:
        script=f"{SCRIPTS}/checksums.py",
        files=TRACKED_FILES,
    output:
        CHECKSUM_FILE,
    log:
        f"{LOGS}/checksums.log",
    message:
        f"checkpoint 3 ({PROFILE}): checksums of {len(TRACKED_FILES)} files"
    conda:
        ENV
    shell:
        "python {input.script} write --output {output} {input.files} > {log} 2>&1"
        " && sha256sum -c --quiet {output} >> {log} 2>&1"


rule publish:
    """Make this run's results the tracked ones: its checksum files become the committed sums
    in checksums/ (then commit them with the results; the verdicts of the next rerun compare
    with the committed tables)."""
    input:
        sums=[CHECKSUM_FILE] + ([PREFIX_CHECKSUMS] if PREFIX_CFG else []),
    output:
        published=[PUBLISHED_CHECKSUM_FILE]
        + ([f"checksums/prefix-{PROFILE}.sha256"] if PREFIX_CFG else []),
    log:
        f"{LOGS}/publish.log",
    message:
        f"checkpoint 3 ({PROFILE}): publish the run's checksums to checksums/"
    params:
        pairs=lambda wildcards, input, output: " ".join(
            f"{src}:{dst}" for src, dst in zip(input.sums, output.published)),
    conda:
        ENV
    shell:
        "for pair in {params.pairs}; do cp \"${{pair%%:*}}\" \"${{pair#*:}}\""
        " && sha256sum -c --quiet \"${{pair#*:}}\" && echo \"published ${{pair#*:}}\"; done > {log:q} 2>&1"
