# llmserve against the hardware and a peer on one GPU (`llmserve bench-compare`): batch-1 decode
# against the weight-bandwidth floor, the decode sweep (batch 1..256), the offline 256-request
# workload against HF transformers (generate_batch and static generate), open-loop TTFT/TPOT at
# several rates with repetitions (the config's `offline_flags` and `openloop_flags` say whether
# llmserve runs with hand-tuned flags, every flag at its default, or both), and one `serve`
# completion with and without tuning flags. GPU only; part
# of `results/gpu` (workflow/rules/gpu.smk), or alone:
#
#   snakemake results/h200 --cores 4 --resources gpu=1
#
# Snakemake reruns it when the engine sources change after a run it recorded (code_hash); on a
# fresh clone, or to measure again, add `--forcerun h200_compare`. Its checksums are the GPU
# evidence's (results/h200/checksums.sha256, published by `publish_gpu`).

# Settings: the config's `compare` section.
_CMP = config["compare"]
H200_ARGS = (f"--presets {' '.join(_CMP['decode_presets'])} --hf-requests {_CMP['hf_requests']} --hf-decode-steps {_CMP['hf_decode_steps']}"
             f" --hf-decode-presets {' '.join(_CMP['hf_decode_presets'])}"
             f" --hf-static-batch {_CMP['hf_static_batch']} --hf-static-requests {_CMP['hf_static_requests']}"
             f" --hf-max-new-tokens {_CMP['hf_max_new_tokens']} --offline-repetitions {_CMP['offline_repetitions']}"
             f" --offline-flags {' '.join(_CMP['offline_flags'])}"
             f" --rates {' '.join(f'{r:g}' for r in _CMP['rates'])}"
             f" --openloop-requests {_CMP['openloop_requests']}"
             f" --openloop-repetitions {_CMP['openloop_repetitions']}"
             f" --openloop-flags {' '.join(_CMP['openloop_flags'])}")


rule h200_compare:
    """llmserve against the weight-bandwidth floor and HF transformers on one GPU."""
    input:
        code_changed=COMPARE_MARKERS,
    output:
        json=f"{GPU_OUT}/compare.json",
        md=f"{GPU_OUT}/compare.md",
        plot=f"{GPU_OUT}/decode_sweep.png",
    params:
        llmserve=config["llmserve"],
        args=H200_ARGS,
        code_hash=CODE_HASH,  # engine sources: a change reruns the comparison
    log:
        f"{GPU_OUT}/logs/compare.log",
    resources:
        gpu=1,
        benchmark_slot=1,
    message:
        "bench-compare on the GPU: decode vs floor, offline vs HF transformers, open loop"
    conda:
        ENV
    shell:
        "{params.llmserve} bench-compare {params.args} --code-hash {params.code_hash}"
        " --out $(dirname {output.json}) > {log} 2>&1"


for _alias in ("results/h200", "results/h200/"):

    rule:
        """The comparison's results folder as a target."""
        name:
            _alias
        input:
            rules.h200_compare.output,
            COMPARE_MARKERS,
        message:
            "results/h200: present and current"
