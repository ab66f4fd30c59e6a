# Stage 4: one sha256sum file per profile over every tracked result file of that profile,
# verifiable from the repository root with `sha256sum -c checksums/checkpoint3-<profile>.sha256`.

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
