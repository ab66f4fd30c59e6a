# Checkpoint 4: the quantization and linear-backend experiment (`llmserve quantize-eval`):
# stored bytes, quality against the 16-bit model (KL, top-1 agreement, perplexity) and matched
# decode throughput for fp16, reference INT8, reference INT4 and fused INT8. A mode that fails
# (triton-int8 without a GPU) stays in the table as a failed row.
#
#   snakemake --cores 1 results/checkpoint4                     # tiny model on the CPU
#
# The GPU result (Qwen2.5-1.5B shapes on an H200) is tracked in results/checkpoint4/h200/.

# Settings: the config's `quantization` section (modes, eval_tokens) on the profile's model.
Q4 = {
    "profile": PROFILE,
    "model": config["model"],
    "device": config["device"],
    "dtype": config["dtype"],
    "modes": ",".join(config["quantization"]["modes"]),
    "eval_tokens": int(config["quantization"]["eval_tokens"]),
}
Q4_OUT = f"results/checkpoint4/{Q4['profile']}"


rule quantize_eval:
    """Checkpoint 4: bytes, quality against 16-bit and decode speed of each quantization mode."""
    output:
        json=f"{Q4_OUT}/quantization.json",
        csv=f"{Q4_OUT}/quantization.csv",
    params:
        llmserve=config["llmserve"],
        code_hash=CODE_HASH,  # engine sources: a change reruns the evaluation
        q=Q4,
    log:
        f"{Q4_OUT}/logs/quantize_eval.log",
    resources:
        gpu=1 if str(config["device"]).startswith("cuda") else 0,
        benchmark_slot=1,  # it times decoding: never beside another measuring job
    message:
        f"checkpoint 4 ({PROFILE}): quantize-eval {Q4['modes']}"
    conda:
        ENV
    shell:
        "{params.llmserve} quantize-eval --model {params.q[model]} --device {params.q[device]}"
        " --dtype {params.q[dtype]} --modes {params.q[modes]} --eval-tokens {params.q[eval_tokens]}"
        " --output {output.json} --csv {output.csv} > {log} 2>&1"


# The plot script is an input of the plot only: editing it redraws, never re-measures.
rule quantize_plot:
    """Checkpoint 4's plot: quality against stored bytes and speed, one bubble per mode."""
    input:
        script=f"{SCRIPTS}/plot_quantization.py",
        json=f"{Q4_OUT}/quantization.json",
    output:
        png=f"{Q4_OUT}/quantization.png",
    log:
        f"{Q4_OUT}/logs/quantize_plot.log",
    message:
        f"checkpoint 4 ({PROFILE}): plot"
    conda:
        ENV
    shell:
        "python {input.script} {input.json} --output {output.png} > {log} 2>&1"


rule checkpoint4_checksums:
    """sha256 sums of checkpoint 4's tracked files."""
    input:
        script=f"{SCRIPTS}/checksums.py",
        files=[*rules.quantize_eval.output, *rules.quantize_plot.output],
    output:
        f"{Q4_OUT}/checksums.sha256",  # the run's; `publish_checkpoint4` copies it to checksums/
    log:
        f"{Q4_OUT}/logs/checksums.log",
    message:
        f"checkpoint 4 ({PROFILE}): checksums"
    conda:
        ENV
    shell:
        "python {input.script} write --output {output} {input.files} > {log} 2>&1"


rule publish_checkpoint4:
    """Make checkpoint 4's run the tracked one: its checksums become checksums/checkpoint4-<profile>.sha256."""
    input:
        rules.checkpoint4_checksums.output,
    output:
        f"checksums/checkpoint4-{Q4['profile']}.sha256",
    log:
        f"{Q4_OUT}/logs/publish.log",
    message:
        f"checkpoint 4 ({PROFILE}): publish the run's checksums to checksums/"
    conda:
        ENV
    shell:
        "cp {input:q} {output:q} && sha256sum -c --quiet {output:q} > {log:q} 2>&1"


for _alias in ("results/checkpoint4", "results/checkpoint4/"):

    rule:
        """Checkpoint 4's results folder as a target."""
        name:
            _alias
        input:
            rules.quantize_eval.output,
            rules.quantize_plot.output,
            rules.checkpoint4_checksums.output,
        message:
            f"checkpoint 4 ({PROFILE}): every result present and current"
