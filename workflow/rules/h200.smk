# llmserve against the hardware and a peer on one GPU (`llmserve bench-compare`): batch-1 decode
# against the weight-bandwidth floor for the Qwen2.5-0.5B/1.5B/7B shapes, the offline
# 256-request workload against HF transformers (generate_batch and static generate), and
# open-loop TTFT/TPOT at several arrival rates. GPU only; not part of the default target:
#
#   snakemake results/h200 --cores 4 --resources gpu=1
#
# The committed result (an H200) is results/h200/compare.{json,md}. Snakemake reruns it when
# the engine sources change after a run it recorded (code_hash); on a fresh clone, or to
# measure again, add `--forcerun h200_compare`. Then refresh the checksums:
#
#   python3 workflow/scripts/checksums.py write --output checksums/h200.sha256 results/h200/compare.*

H200_ARGS = ("--hf-requests 32 --hf-decode-steps 32 --hf-static-batch 32 --rates 4 16 64"
             " --openloop-requests 100")


rule h200_compare:
    output:
        json="results/h200/compare.json",
        md="results/h200/compare.md",
    params:
        llmserve=config["llmserve"],
        args=H200_ARGS,
        code_hash=CODE_HASH,  # engine sources: a change reruns the comparison
    log:
        "results/h200/logs/compare.log",
    resources:
        gpu=1,
    conda:
        ENV
    shell:
        "{params.llmserve} bench-compare {params.args} --out $(dirname {output.json}) > {log} 2>&1"


for _alias in ("results/h200", "results/h200/"):

    rule:
        name:
            _alias
        input:
            rules.h200_compare.output,
