"""Tensor parallelism on CPU: gloo, spawned ranks, transformers-written checkpoints.

* the shard plan (heads, K/V replication, vocabulary padding) and the bad sizes it refuses;
* 2 ranks against 1 through the LLMEngine: logits rows within 1e-5 (fp32; absolute plus
  relative, the logits reach about 33) and identical greedy tokens, for GQA ratio 1, ratio 2 with tied embeddings, and one K/V head (replicated)
  with a vocabulary that 2 does not divide; asynchronous scheduling, chunked prefill, prefix
  caching, prompt logprobs and int8 weights along the way;
* failure: a killed rank and a rank that raises give a clear error within the timeout; workers
  exit after shutdown and when rank 0's process is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import make_hf_qwen2
from llmserve.config import CacheConfig, EngineConfig, FastPathConfig, ModelConfig, SchedulerConfig
from llmserve.core.sampling_params import SamplingParams
from llmserve.engine.llm_engine import LLMEngine
from llmserve.engine.tensor_parallel import TensorParallelError
from llmserve.models.parallel import plan_tensor_parallel
from llmserve.models.presets import preset_config

TIMEOUT_S = 30.0

VARIANTS = {
    # name: make_hf_qwen2 overrides
    "mha": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_tied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "kv1_vocab1001": dict(num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                          tie_word_embeddings=False, vocab_size=1001),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            path = tmp_path_factory.mktemp(f"tp-{name}")
            make_hf_qwen2(path, seed=3, **VARIANTS[name])
            made[name] = path
        return made[name]

    return get


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _record_logits(engine: LLMEngine) -> dict:
    """Wrap ``engine.runner.execute`` to keep every logits row by (request, position)."""
    rows: dict[tuple[str, int], torch.Tensor] = {}
    inner = engine.runner.execute

    def execute(scheduled, pending=None, num_logits=None):
        res = inner(scheduled, pending, num_logits)
        if num_logits is None:
            for r, i in enumerate(res.sample_indices):
                item = scheduled[i]
                rows[(item.seq.request_id, item.end_position)] = res.logits[r].detach().clone()
        return res

    engine.runner.execute = execute
    return rows


def _run(engine: LLMEngine, prompts, sp):
    rows = _record_logits(engine)
    for i, p in enumerate(prompts):
        engine.add_request(p, sp, request_id=f"r{i}")
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return [outs[f"r{i}"] for i in range(len(prompts))], rows


def _prompts(vocab: int, long: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, vocab, (19,), generator=g).tolist()
    out = [shared + [5, 6], torch.randint(0, vocab, (3,), generator=g).tolist(), [vocab - 1],
           shared + torch.randint(0, vocab, (30,), generator=g).tolist(), [vocab - 2, 0, vocab - 1]]
    if long:
        out.append(torch.randint(0, vocab, (long,), generator=g).tolist())
    return out


def _compare(cfg1: EngineConfig, cfg2: EngineConfig, sp: SamplingParams, vocab: int, tol: float = 1e-5,
             long: int = 0):
    prompts = _prompts(vocab, long)
    e1 = LLMEngine(cfg1)
    out1, rows1 = _run(e1, prompts, sp)
    e2 = LLMEngine(cfg2)
    try:
        assert len(e2.tp_runtime.worker_pids) == cfg2.tensor_parallel_size - 1
        out2, rows2 = _run(e2, prompts, sp)
        stats = e2.stats()["tensor_parallel"]
    finally:
        e2.shutdown()
    assert [o.output_token_ids for o in out2] == [o.output_token_ids for o in out1]
    assert rows1.keys() == rows2.keys() and rows1
    assert all(rows2[k].shape == (vocab,) for k in rows2)
    for k in rows1:      # fp32: only the order of the row-parallel sums differs
        torch.testing.assert_close(rows2[k], rows1[k], atol=tol, rtol=tol)
    assert stats["size"] == 2 and stats["broadcast_steps"] > 0 and stats["collectives"] > 0
    return out1, out2


# ---- the plan ----------------------------------------------------------------------------------
def test_plan_qwen25_1p5b_shapes():
    cfg = preset_config("random:qwen2.5-1.5b")            # 12 query heads, 2 K/V heads
    two = plan_tensor_parallel(cfg, 2)
    assert [(p.q_start, p.q_count, p.kv_start, p.kv_count) for p in two] == [(0, 6, 0, 1), (6, 6, 1, 1)]
    four = plan_tensor_parallel(cfg, 4)                    # more ranks than K/V heads: replicated
    assert [(p.q_start, p.kv_start, p.kv_count) for p in four] == [(0, 0, 1), (3, 0, 1), (6, 1, 1), (9, 1, 1)]
    assert all(p.inter_count == 8960 // 4 for p in four)
    assert sum(p.vocab_count for p in four) == cfg.vocab_size
    with pytest.raises(ValueError, match=r"intermediate_size=8960.*valid sizes: \[1, 2, 4\]"):
        plan_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match="num_attention_heads=12"):
        plan_tensor_parallel(cfg, 5)


def test_plan_uneven_kv_heads_and_vocabulary():
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, head_dim=16)
    # 12 query heads over 3 ranks with 2 K/V heads: the middle rank uses both K/V heads
    three = plan_tensor_parallel(ModelConfig(vocab_size=10, num_attention_heads=12,
                                             num_key_value_heads=2, **base), 3)
    assert [(p.kv_start, p.kv_count) for p in three] == [(0, 1), (0, 2), (1, 1)]
    assert [(p.vocab_start, p.vocab_count, p.vocab_per_rank) for p in three] == [(0, 4, 4), (4, 4, 4), (8, 2, 4)]
    # 6 query heads, 3 K/V heads, 2 ranks: rank 0 would serve K/V heads 0, 0, 1 unevenly
    with pytest.raises(ValueError, match="unevenly"):
        plan_tensor_parallel(ModelConfig(vocab_size=10, num_attention_heads=6, num_key_value_heads=3,
                                         **base), 2)
    with pytest.raises(ValueError, match="integer >= 1"):
        plan_tensor_parallel(ModelConfig(vocab_size=10, num_attention_heads=6, num_key_value_heads=3,
                                         **base), 0)


def test_bad_configs_are_refused_before_any_process_starts(checkpoints):
    path = str(checkpoints("mha"))
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        EngineConfig(distributed_timeout_s=0)
    with pytest.raises(ValueError, match="use_cuda_graph=False"):
        EngineConfig(device="cuda", attention_backend="triton", tensor_parallel_size=2)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4.*valid sizes: \[1, 2, 4\]"):
        LLMEngine(EngineConfig(model=path, tensor_parallel_size=3))
    from llmserve.engine.naive import NaiveEngine
    with pytest.raises(ValueError, match="NaiveEngine does not support tensor_parallel_size"):
        NaiveEngine(EngineConfig(model=path, tensor_parallel_size=2))
    from llmserve.engine.speculative import SpeculativeEngine
    with pytest.raises(ValueError, match="speculative decoding does not support tensor_parallel_size"):
        SpeculativeEngine(EngineConfig(model=path, tensor_parallel_size=2), draft_model="target")
    assert time.perf_counter() - t0 < 20
    import torch.distributed as dist
    assert not dist.is_initialized()


# ---- parity ------------------------------------------------------------------------------------
def _cfgs(path, size=2, **kw):
    base = dict(model=str(path), cache=CacheConfig(block_size=8, num_blocks=96), distributed_timeout_s=TIMEOUT_S)
    base.update(kw)
    return EngineConfig(**base), EngineConfig(**{**base, "tensor_parallel_size": size})


def test_parity_mha_prompt_logprobs(checkpoints):
    """GQA ratio 1: 2 K/V heads a rank; prompt logprobs from the gathered logits; a 400-token
    prompt's step is larger than the header message (:data:`INLINE_WORDS`) and takes a second
    broadcast."""
    from llmserve.worker.step_channel import INLINE_WORDS

    assert 3 * 400 > INLINE_WORDS
    cfg1, cfg2 = _cfgs(checkpoints("mha"))
    sp = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    out1, out2 = _compare(cfg1, cfg2, sp, 1000, long=400)
    for a, b in zip(out1, out2):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert abs(x["token_logprob"] - y["token_logprob"]) <= 1e-5 * (1 + abs(x["token_logprob"]))
            assert [t for t, _ in x["top"]] == [t for t, _ in y["top"]]


def test_parity_gqa_tied_async_chunked(checkpoints):
    """GQA ratio 2, tied embeddings, asynchronous scheduling (the in-flight step's token ids
    are broadcast on the device group) and chunked prefill with prefix caching."""
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=24, prefill_chunk_size=8)
    cfg1, cfg2 = _cfgs(checkpoints("gqa_tied"), scheduler=sched, async_scheduling=True)
    _compare(cfg1, cfg2, SamplingParams(max_tokens=7, ignore_eos=True), 1000)


def test_parity_one_kv_head_replicated_odd_vocabulary(checkpoints):
    """One K/V head replicated on both ranks; vocabulary 1001 padded to 2 x 501 rows."""
    cfg1, cfg2 = _cfgs(checkpoints("kv1_vocab1001"))
    _compare(cfg1, cfg2, SamplingParams(max_tokens=6, ignore_eos=True), 1001)


@pytest.mark.parametrize("backend", ["int8", "int4", pytest.param("triton-int8", marks=pytest.mark.slow)])
def test_parity_quantized_weights(checkpoints, backend):
    """Row-parallel shards quantize with their whole row's scale: the quantized weights are
    the one-rank model's (triton-int8 in the Triton interpreter)."""
    if backend == "triton-int8":
        from llmserve.envs import triton_interpret
        if not triton_interpret():
            pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    cfg1, cfg2 = _cfgs(checkpoints("kv1_vocab1001"), linear_backend=backend)
    _compare(cfg1, cfg2, SamplingParams(max_tokens=4, ignore_eos=True), 1001)


def test_row_parallel_quantization_uses_the_whole_rows_scale():
    """The hook the sharded model passes: per-row maxima over the shards for o_proj/down_proj,
    the shard's own for column-parallel projections (full rows)."""
    from llmserve.models.parallel import ROW_PARALLEL
    from llmserve.quant.schemes import quantize_int8, weight_absmax

    w = torch.randn(6, 8)
    whole_q, whole_s = quantize_int8(w)
    for half in (w[:, :4], w[:, 4:]):
        q, s = quantize_int8(half, absmax=weight_absmax(w, "int8"))
        assert torch.equal(s, whole_s) and torch.equal(q, whole_q[:, :4] if half.data_ptr() == w.data_ptr()
                                                        else whole_q[:, 4:])
    assert ROW_PARALLEL.fullmatch("model.layers.3.mlp.down_proj")
    assert ROW_PARALLEL.fullmatch("model.layers.0.self_attn.o_proj")
    assert not ROW_PARALLEL.fullmatch("model.layers.0.self_attn.q_proj")


@pytest.mark.slow
def test_parity_fused_forward_triton_interpreter(checkpoints):
    """The fused forward (Triton kernels in the interpreter) and the Triton attention backend,
    sharded."""
    from llmserve.envs import triton_interpret
    if not triton_interpret():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without CUDA)")
    cfg1, cfg2 = _cfgs(checkpoints("kv1_vocab1001"), attention_backend="triton",
                       fast_path=FastPathConfig(fused_forward=True))
    _compare(cfg1, cfg2, SamplingParams(max_tokens=3, ignore_eos=True), 1001)


# ---- failure -----------------------------------------------------------------------------------
def _load_and_fail_on_rank1(name, device="cpu", dtype="float32", attention_backend=None, tp=None):
    """A loader whose rank-1 model raises inside its second layer's MLP (after that rank's
    first collectives of the step: rank 0 is then waiting in one)."""
    from llmserve.models.loader import load_model

    model, cfg, path = load_model(name, device=device, dtype=dtype, attention_backend=attention_backend, tp=tp)
    if tp is not None and tp.rank == 1:
        def boom(x):
            raise RuntimeError("injected failure in rank 1's MLP")
        model.model.layers[1].mlp.forward = boom
    return model, cfg, path


def test_worker_exception_gives_clear_error(checkpoints):
    _, cfg = _cfgs(checkpoints("gqa_tied"), distributed_timeout_s=20.0)
    engine = LLMEngine(cfg, load_model_fn=_load_and_fail_on_rank1)
    pids = engine.tp_runtime.worker_pids
    t0 = time.perf_counter()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code 1(.|\n)*"
                                                  r"injected failure in rank 1's MLP"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert time.perf_counter() - t0 < cfg.distributed_timeout_s
    with pytest.raises(TensorParallelError, match="rank 1"):         # the engine stays failed
        engine.step()
    engine.shutdown()
    assert _wait_gone(pids, 5) == []


def test_killed_rank_gives_clear_error_and_no_hang(checkpoints):
    _, cfg = _cfgs(checkpoints("mha"), distributed_timeout_s=20.0)
    engine = LLMEngine(cfg)
    engine.add_request([4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    engine.step()
    (pid,) = engine.tp_runtime.worker_pids
    os.kill(pid, signal.SIGKILL)
    t0 = time.perf_counter()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by signal 9"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.perf_counter() - t0 < cfg.distributed_timeout_s
    engine.shutdown()
    import torch.distributed as dist
    assert not dist.is_initialized()


def test_shutdown_leaves_no_worker_and_a_new_engine_starts(checkpoints):
    _, cfg = _cfgs(checkpoints("mha"))
    for _ in range(2):       # the process groups are torn down and built again
        engine = LLMEngine(cfg)
        pids = engine.tp_runtime.worker_pids
        assert all(_alive(p) for p in pids)
        assert engine.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))[0].finished
        engine.shutdown()
        engine.shutdown()    # idempotent
        assert _wait_gone(pids, 5) == []
        with pytest.raises(TensorParallelError, match="shut down"):
            engine.step()


_RANK0_SCRIPT = """
import os, signal, sys
from llmserve.config import CacheConfig, EngineConfig
from llmserve.engine.llm_engine import LLMEngine
if __name__ == "__main__":
    e = LLMEngine(EngineConfig(model=sys.argv[1], tensor_parallel_size=2,
                               cache=CacheConfig(num_blocks=16), distributed_timeout_s=30))
    print(" ".join(map(str, e.tp_runtime.worker_pids)), flush=True)
    e.generate([[1, 2, 3]])
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)          # without shutdown(): the exit hook stops the workers
"""


@pytest.mark.parametrize("how", ["kill", "exit"])
def test_workers_exit_with_rank0_process(checkpoints, tmp_path, how):
    script = tmp_path / "rank0.py"
    script.write_text(_RANK0_SCRIPT)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "engine"),
                                         env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script), str(checkpoints("mha")), how], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == (-signal.SIGKILL if how == "kill" else 0), r.stderr[-3000:]
    pids = [int(p) for p in r.stdout.split()]
    assert len(pids) == 1
    assert _wait_gone(pids, 10) == [], "a worker outlived rank 0's process"


# ---- flags, environment, torchrun --------------------------------------------------------------
def test_flags_reach_the_engine_config():
    from llmserve.bench.runner import make_engine_config, options_from_args
    from llmserve.cli import build_parser
    from llmserve.serve.server import build_engine_config

    parser = build_parser()
    g = parser.parse_args(["generate", "--prompt", "x", "--tensor-parallel-size", "2"])
    assert (g.tensor_parallel_size, g.distributed_timeout_s) == (2, 300.0)
    b = parser.parse_args(["benchmark", "-tp", "4", "--distributed-timeout", "12.5"])
    cfg = make_engine_config(options_from_args(b), seed=0)
    assert (cfg.tensor_parallel_size, cfg.distributed_timeout_s) == (4, 12.5)
    s = parser.parse_args(["serve", "--tensor-parallel-size", "2"])
    assert build_engine_config(s).tensor_parallel_size == 2
    with pytest.raises(SystemExit):      # refused by the flag's type, before any engine is built
        parser.parse_args(["serve", "--tensor-parallel-size", "0"])


def test_envs_torchrun_and_multicast(monkeypatch):
    from llmserve import envs

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert envs.torchrun_rank() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert envs.torchrun_rank() == (1, 2, 1)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert envs.torchrun_rank() == (1, 2, 0)
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK must be in"):
        envs.torchrun_rank()
    for k in envs.NCCL_MULTICAST_OFF:
        monkeypatch.setenv(k, "unset-by-test")      # restored by monkeypatch afterwards
    envs.set_nccl_multicast_off()
    assert {k: os.environ[k] for k in envs.NCCL_MULTICAST_OFF} == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@pytest.mark.slow
def test_torchrun_ranks_run_the_same_script(tmp_path):
    """``torchrun --nproc-per-node 2 -m llmserve.cli generate --tensor-parallel-size 2``: rank 1's
    constructor serves as the worker and exits with rank 0; the tokens are the one-rank ones."""
    engine = LLMEngine(EngineConfig(model="tiny"))
    want = engine.generate([[9707, 1879]], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_token_ids
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "engine"),
                                         env.get("PYTHONPATH", "")])
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "llmserve.cli",
                        "generate", "--model", "tiny", "--prompt", "Hello world", "--max-tokens", "6",
                        "--ignore-eos", "--show-ids", "--tensor-parallel-size", "2"],
                       env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("output ids:")]
    assert len(lines) == 1, r.stderr[-3000:]                # printed by rank 0 only
    assert lines[0] == f"output ids: {want}"
