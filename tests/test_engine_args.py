"""Engine flags are defined once and resolve per device: the fast path on CUDA, the readable
path on a CPU, explicit flags winning (engine/llmserve/engine_args.py)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from llmserve.cli import build_parser
from llmserve.config import ModelConfig
from llmserve.engine_args import EngineArgs, add_engine_args, describe_config, device_defaults

PKG = Path(__file__).resolve().parents[1] / "engine" / "llmserve"
ENGINE_COMMANDS = ("generate", "benchmark", "serve")


def _parse(command: str, *flags: str) -> argparse.Namespace:
    argv = [command, *flags] + (["--prompt", "x"] if command == "generate" else [])
    return build_parser().parse_args(argv)


def _config(command: str, *flags: str):
    args = _parse(command, *flags)
    if command == "serve":
        from llmserve.serve.server import build_engine_config
        return build_engine_config(args)
    if command == "benchmark":
        from llmserve.bench.runner import make_engine_config, options_from_args
        return make_engine_config(options_from_args(args), seed=0)
    return EngineArgs.from_namespace(args).create_engine_config("offline")


def _model() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=1536, intermediate_size=8960, num_hidden_layers=2,
                       num_attention_heads=12, num_key_value_heads=2, head_dim=128)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_cuda_without_flags_is_the_fast_path(command):
    """No tuning flag on a (named, not present) CUDA device: bf16, Triton attention, CUDA graphs,
    the fused forward, asynchronous scheduling, chunked prefill, 256 sequences, the KV pool from
    free memory."""
    cfg = _config(command, "--device", "cuda")
    assert cfg.dtype == "bfloat16" and cfg.attention_backend == "triton"
    assert cfg.use_cuda_graph is True and cfg.async_scheduling is None   # None: on for CUDA
    assert cfg.fast_path.resolve(_model(), "cuda").fused_forward is True
    assert cfg.cache.num_blocks is None and cfg.cache.gpu_memory_utilization == 0.85
    assert cfg.scheduler.max_num_seqs == 256 and cfg.scheduler.prefill_chunk_size is not None
    chunk, budget = (512, 2048) if command == "serve" else (2048, 8192)
    assert (cfg.scheduler.prefill_chunk_size, cfg.scheduler.max_num_batched_tokens) == (chunk, budget)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_cpu_without_flags_is_the_readable_path(command):
    cfg = _config(command)
    assert cfg.device == "cpu" and cfg.dtype == "float32" and cfg.attention_backend == "torch"
    assert cfg.fast_path.resolve(_model(), "cpu").fused_forward is False
    assert cfg.scheduler.max_num_seqs == 8
    if command == "serve":
        assert (cfg.scheduler.prefill_chunk_size, cfg.scheduler.max_num_batched_tokens) == (64, 72)
    else:       # unchanged offline behaviour: whole prompts, a step of max(4096, max_model_len)
        assert (cfg.scheduler.prefill_chunk_size, cfg.scheduler.max_num_batched_tokens) == (None, 4096)


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_explicit_flags_win_on_cuda(command):
    cfg = _config(command, "--device", "cuda", "--attention-backend", "torch", "--no-fused-forward",
                  "--no-cuda-graph", "--max-num-seqs", "3", "--prefill-chunk-size", "0", "--dtype", "float16",
                  "--max-model-len", "10000", "--no-async-scheduling")
    assert (cfg.attention_backend, cfg.use_cuda_graph, cfg.dtype) == ("torch", False, "float16")
    assert cfg.fast_path.fused_forward is False and cfg.async_scheduling is False
    assert cfg.scheduler.max_num_seqs == 3 and cfg.scheduler.prefill_chunk_size is None
    assert cfg.scheduler.max_num_batched_tokens == 10000     # whole prompts fit a step


def test_tensor_parallel_turns_graphs_off_unless_asked():
    assert _config("serve", "--device", "cuda", "-tp", "2", "--no-cuda-graph").use_cuda_graph is False
    assert _config("serve", "--device", "cuda", "-tp", "2").use_cuda_graph is False
    assert _config("serve", "--device", "cuda").use_cuda_graph is True


def test_benchmark_batch_one_configurations_and_seed():
    from llmserve.bench.runner import make_engine_config, options_from_args

    for config in ("paged", "naive"):
        opts = options_from_args(_parse("benchmark", "--config", config, "--device", "cuda"))
        assert make_engine_config(opts, seed=7).scheduler.max_num_seqs == 1
    opts = options_from_args(_parse("benchmark", "--config", "static", "--max-num-seqs", "4"))
    cfg = make_engine_config(opts, seed=7)
    assert (cfg.scheduler.mode, cfg.scheduler.max_num_seqs, cfg.seed) == ("static", 4, 7)


@pytest.mark.parametrize("flags", [(), ("--device", "cuda"), ("--device", "cuda", "--max-num-seqs", "17",
                                                            "--prefill-chunk-size", "96", "--block-size", "32")])
def test_generate_and_benchmark_resolve_alike(flags):
    """Both are offline commands: the same flags give the same engine configuration."""
    assert _config("generate", *flags) == _config("benchmark", *flags)


def test_every_engine_flag_is_defined_once():
    """Each command takes every engine flag, with one destination (vLLM's name), and no module
    but engine_args.py spells an engine flag in an ``add_argument`` call."""
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    flags = {flag: name for name, f in fields.items() for flag in f.metadata["flags"]}
    for command in ENGINE_COMMANDS:
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        actions = {opt: a.dest for a in sub.choices[command]._actions for opt in a.option_strings}
        for flag, dest in flags.items():
            if command == "benchmark" and dest == "seed":
                continue                      # the workload group's --seed, same destination
            assert actions.get(flag) == dest, (command, flag, actions.get(flag))
    pattern = re.compile(r"add_argument\(\s*\"(--[a-z0-9-]+)\"")
    for path in PKG.rglob("*.py"):
        if path.name == "engine_args.py":
            continue
        for flag in pattern.findall(path.read_text()):
            if path.name in ("compare.py", "kernels.py"):   # no engine flags: their own harness knobs
                continue
            assert flag not in flags or flag == "--seed", f"{path.relative_to(PKG)} defines {flag} again"


def test_help_states_the_default_per_device():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["serve"].format_help().split())
    for needle in ("256 on CUDA, 8 on a CPU", "triton (default on CUDA)", "bfloat16 on CUDA",
                   "512 for serve"):
        assert needle in text, needle


def test_bad_values_are_refused():
    with pytest.raises(SystemExit):
        _parse("serve", "--max-num-seqs", "0")
    with pytest.raises(SystemExit):
        _parse("serve", "--gpu-memory-utilization", "1.5")
    with pytest.raises(ValueError, match="usage must be one of"):
        device_defaults("cpu", "interactive")
    with pytest.raises(ValueError, match="unknown engine fields"):
        add_engine_args(argparse.ArgumentParser(), exclude=("nope",))


def test_describe_config_names_what_runs():
    line = describe_config(_config("serve", "--device", "cuda"))
    for needle in ("attention=triton", "max_num_seqs=256", "prefill_chunk=512", "dtype=bfloat16",
                   "cuda_graph=True"):
        assert needle in line, line
