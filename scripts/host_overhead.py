#!/usr/bin/env python
"""Host (Python) time of LLMEngine decode steps, with the device work taken out.

The engine runs the tiny CPU model; its CUDA-graph runner is replaced by a stand-in whose
``run`` does the same host-side buffer filling as ``CUDAGraphDecodeRunner.run`` and returns
ready logits at once, so what is timed is scheduling, input preparation, sampling and output
bookkeeping: the work a GPU waits for between decode steps when it is not overlapped.

Usage: ``python3 scripts/host_overhead.py --batch 1 64 256`` (prints us per step and the
``LLMEngine.step_seconds`` split). Results depend on the CPU: name it when you quote them.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
from llmserve.engine.llm_engine import LLMEngine
from llmserve.core.sampling_params import SamplingParams


class InstantGraphs:
    """Stand-in for ``CUDAGraphDecodeRunner``: fills a host staging buffer like ``run`` does
    (ids, positions, slots as int64; context lengths and the block table as int32 views of the
    same words) and returns fixed logits (a tiny vocabulary, so the argmax costs nothing) and
    its argmax as ``last_argmax``, as the graph does."""

    def __init__(self, max_batch: int, max_blocks: int) -> None:
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.logits = torch.zeros(max_batch, 8)
        self.argmax = torch.zeros(max_batch, dtype=torch.int64)
        self.last_argmax = None
        self.host = np.zeros(4 * max_batch + max_batch * max_blocks, dtype=np.int64)
        self.host32 = self.host[3 * max_batch:].view(np.int32)

    def run(self, ids, pos, slots, ctx, table, fill=None):
        b, mb, h = len(ids), self.max_batch, self.host
        h[:b], h[mb:mb + b], h[2 * mb:2 * mb + b] = ids, pos, slots
        self.host32[:b] = ctx
        t = self.host32[2 * mb:2 * mb + mb * self.max_blocks].reshape(mb, self.max_blocks)
        t[:b] = 0
        t[:b, :table.shape[1]] = table
        self.last_argmax = self.argmax[:b]
        return self.logits[:b]


PROMPT_LEN = 32


def measure(batch: int, steps: int) -> dict:
    # a KV cache that holds every sequence to its last token: a preemption would put eager
    # recompute prefills (the CPU model) into the timed steps
    block = CacheConfig().block_size
    blocks = batch * (-(-(PROMPT_LEN + steps + 8) // block) + 1)
    eng = LLMEngine(EngineConfig(scheduler=SchedulerConfig(max_num_seqs=max(batch, 8)),
                                 cache=CacheConfig(num_blocks=blocks)))
    eng.runner.cuda_graphs = InstantGraphs(max(batch, 8), eng.max_model_len // eng.block_size + 1)
    for _ in range(batch):
        eng.add_request(list(range(10, 10 + PROMPT_LEN)),
                        SamplingParams(max_tokens=steps + 8, ignore_eos=True))
    while eng.runner.num_graph_steps == 0:      # prefill (eager, the CPU model) is not timed
        eng.step()
    eng.reset_stats()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = time.perf_counter() - t
    paths = eng.stats()["steps_by_path"]
    if eng.scheduler.num_preemptions or paths != {"decode_graph": steps, "mixed_graph": 0, "eager": 0}:
        raise RuntimeError(f"batch {batch}: {eng.scheduler.num_preemptions} preemptions, steps "
                           f"{paths} of {steps}: not a decode-only run")
    return {"batch": batch, "steps": steps, "host_us_per_step": dt / steps * 1e6,
            **{f"{k}_us": v / steps * 1e6 for k, v in eng.step_seconds.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=500)
    a = p.parse_args()
    print(f"cpu: {platform.processor() or platform.machine()}, threads {torch.get_num_threads()}, "
          f"python {platform.python_version()}, torch {torch.__version__}")
    measure(min(a.batch), min(a.steps, 50))      # warm-up: the first engine of a process pays imports
    for b in a.batch:
        r = measure(b, a.steps)
        print(f"batch {b:4d}: {r['host_us_per_step']:8.1f} us/step  (schedule {r['schedule_us']:.1f}, "
              f"execute {r['execute_us']:.1f}, sample {r['sample_us']:.1f}, "
              f"device_wait {r['device_wait_us']:.1f}, postprocess {r['postprocess_us']:.1f})")


if __name__ == "__main__":
    main()
