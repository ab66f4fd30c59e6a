"""ModelRunner: one step's scheduled sequences in, logits out.

Typed in: the scheduler's :class:`~llmserve.core.scheduler.ScheduledSequence` items (or any
:class:`~llmserve.worker.input_builder.ScheduledItem`: a sequence, the position its new tokens
start at and how many there are) and, with asynchronous scheduling, the in-flight step's
device token ids (:class:`~llmserve.worker.input_builder.PendingTokens`). Typed out:
:class:`ModelRunnerOutput`. The tensors are built by THE input builder
(:mod:`llmserve.worker.input_builder`), for eager steps and CUDA-graph replays alike. Logits
are computed only for the rows that are sampled: by default the last row of each sequence that
catches up this step.
"""

from __future__ import annotations

from collections.abc import Sequence as _Seq
from dataclasses import dataclass

import numpy as np
import torch

from .input_builder import InputBuilder, ModelInput, PendingTokens

__all__ = ["ModelInput", "ModelRunner", "ModelRunnerOutput", "PendingTokens"]


@dataclass(slots=True)
class ModelRunnerOutput:
    """What one forward pass produced.

    Attributes:
        logits: ``[R, V]`` float32, one row per computed logits row (``[0, 0]`` when none);
            after a CUDA-graph replay a view of the graph's static output (consume it before the
            next replay).
        sample_indices: length ``R``: the index into the scheduled list of each logits row.
        device_argmax: ``[R]`` int64 argmax of ``logits`` when a decode graph computed it on the
            device (valid until the replay after next), else None.
        cuda_graph: whether the step replayed a captured CUDA graph.
    """

    logits: torch.Tensor
    sample_indices: list[int]
    device_argmax: torch.Tensor | None = None
    cuda_graph: bool = False


class ModelRunner:
    """Builds inputs and runs the model's paged forward pass.

    Args:
        model: a ``Qwen2ForCausalLM`` (``forward(input_ids, positions, kv_caches, meta)`` and
            ``compute_logits(hidden)``).
        kv_caches: per layer ``(k_cache, v_cache)``, each ``[num_blocks + 1, block_size, Hkv, D]``.
        block_size: tokens per block.
        device: the model's device.
        forward: the fused forward (``models/fused_forward.py``) when enabled, else the model.
        cuda_graphs: a ``CUDAGraphDecodeRunner`` replaying decode-only steps, or None.
        mixed_graphs: a :class:`~llmserve.worker.mixed_graph.CUDAGraphMixedRunner` replaying
            the other steps up to its token count, or None (they run eagerly).
        channel: tensor parallelism on rank 0: the
            :class:`~llmserve.worker.step_channel.StepChannel` every eager step's packed inputs
            are broadcast through before the forward (the other ranks run
            :meth:`execute_received`); None with one rank.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, device: torch.device | str, forward=None, cuda_graphs=None,
                 channel=None, mixed_graphs=None) -> None:
        if channel is not None and (cuda_graphs is not None or mixed_graphs is not None):
            raise ValueError("CUDA graphs are not supported with tensor parallelism")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self.forward = forward or model
        self.cuda_graphs = cuda_graphs
        self.mixed_graphs = mixed_graphs
        self.channel = channel
        self.inputs = InputBuilder(block_size, self.device)
        self.num_graph_steps = 0          # decode-only steps replayed
        self.num_mixed_graph_steps = 0    # steps with prefill chunks replayed
        self.num_eager_steps = 0

    def reset_stats(self) -> None:
        """Zero the step counters (and the graph runner's short-context replay count)."""
        self.num_graph_steps = self.num_eager_steps = self.num_mixed_graph_steps = 0
        if self.cuda_graphs is not None:
            self.cuda_graphs.num_short_replays = 0

    def _to_device(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(array).to(dtype)
        if self._pin:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def _fill_graph_ids(self, input_ids: torch.Tensor, rows: list[int], src: list[int],
                        pending: PendingTokens) -> None:
        """``input_ids[rows] = pending.token_ids[src]`` on the device (the graph's buffer)."""
        tok = pending.token_ids
        if rows == src == list(range(len(rows))):
            input_ids[:len(rows)].copy_(tok[:len(rows)])
            return
        r = self._to_device(np.asarray(rows, dtype=np.int64), torch.int64)
        s = self._to_device(np.asarray(src, dtype=np.int64), torch.int64)
        input_ids.index_copy_(0, r, tok.index_select(0, s))

    def prepare(self, scheduled: _Seq, pending: PendingTokens | None = None,
                num_logits: _Seq[int] | None = None) -> ModelInput:
        """The step's device tensors (see :meth:`InputBuilder.build`)."""
        return self.inputs.build(scheduled, pending, num_logits)

    def _graph_eligible(self, scheduled: _Seq, num_logits: _Seq[int] | None) -> bool:
        """Every item decodes exactly one token and samples it; the batch and its block tables
        fit the captured graphs."""
        g = self.cuda_graphs
        if g is None or len(scheduled) > g.max_batch:
            return False
        if num_logits is not None and any(m != 1 for m in num_logits):
            return False
        width = 0
        for item in scheduled:
            if item.num_new_tokens != 1 or not item.will_sample:
                return False
            width = max(width, len(item.seq.block_ids))
        return width <= g.max_blocks

    def _run_graph(self, scheduled: _Seq, pending: PendingTokens | None) -> ModelRunnerOutput:
        g = self.cuda_graphs
        h = self.inputs.build_host(scheduled, pending)
        fill = None
        if len(h.fill_rows):
            rows, src = h.fill_rows.tolist(), h.fill_src.tolist()
            fill = lambda input_ids: self._fill_graph_ids(input_ids, rows, src, pending)  # noqa: E731
        logits = g.run(h.input_ids, h.positions, h.slot_mapping, h.context_lens, h.block_tables, fill=fill)
        self.num_graph_steps += 1
        return ModelRunnerOutput(logits, list(range(len(scheduled))), g.last_argmax, cuda_graph=True)

    @torch.inference_mode()
    def execute(self, scheduled: _Seq, pending: PendingTokens | None = None,
                num_logits: _Seq[int] | None = None) -> ModelRunnerOutput:
        """Run one forward pass (a CUDA-graph replay for decode-only steps, and for steps with
        prefill chunks up to the mixed runner's token count, when available).

        Args:
            scheduled: the step's :class:`~llmserve.worker.input_builder.ScheduledItem` s.
            pending: the in-flight step's sampled ids (asynchronous scheduling), or None.
            num_logits: logits rows per item, the item's last ones (default: 1 for items that
                catch up, else 0); speculative verification asks for all ``k + 1`` rows.

        Returns:
            :class:`ModelRunnerOutput`.

        Raises:
            ValueError/RuntimeError: malformed items or a pending token nobody holds (see
                :func:`~llmserve.worker.input_builder.write_host_inputs`).
        """
        if self._graph_eligible(scheduled, num_logits):
            return self._run_graph(scheduled, pending)
        if self.mixed_graphs is not None and self.mixed_graphs.eligible(scheduled, num_logits):
            logits, rows = self.mixed_graphs.run(scheduled, pending)
            self.num_mixed_graph_steps += 1
            return ModelRunnerOutput(logits, rows, cuda_graph=True)
        self.num_eager_steps += 1
        packed = self.inputs.pack(scheduled, pending, num_logits)
        if self.channel is not None:               # tensor parallel: the same step on every rank
            self.channel.send_step(packed, pending)
        inp = self.inputs.upload(packed, pending)
        hidden = self.forward(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)  # [N, H]
        if not inp.sample_seq_indices:
            return ModelRunnerOutput(hidden.new_empty((0, 0), dtype=torch.float32), [])
        logits = self.model.compute_logits(hidden[inp.sample_rows])                            # [R, V]
        return ModelRunnerOutput(logits, inp.sample_seq_indices)

    @torch.inference_mode()
    def execute_received(self, packed, pending: PendingTokens | None = None) -> None:
        """A non-zero tensor-parallel rank's step: the forward (and, when the step has logits
        rows, this rank's share of the LM head and the gather on rank 0) of a step received
        from rank 0 (:meth:`~llmserve.worker.step_channel.StepChannel.recv`). Returns nothing:
        rank 0 samples."""
        self.num_eager_steps += 1
        inp = self.inputs.upload(packed, pending)
        hidden = self.forward(inp.input_ids, inp.positions, self.kv_caches, inp.attn_metadata)  # [N, H]
        if packed.dims[3]:
            self.model.compute_logits(hidden[inp.sample_rows])                                 # [R, V/N]
