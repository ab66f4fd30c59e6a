"""Where a step's time goes: a component profile of the engine (``--profile-components``).

Method: method wrappers on the engine's documented parts (``engine.step``,
``scheduler.schedule``, ``runner.prepare``/``execute``, ``model.compute_logits`` /
``forward_reference``, ``sampler.sample``) plus forward hooks on the model's modules
(``*.self_attn`` / attention classes, ``*.mlp`` / MLP classes, every ``Linear``-like leaf and the
model root). Each timed region records its *exclusive* time (its own time minus that of timed
regions nested in it), so the components add up to the total profiled time. On CUDA every
region boundary calls ``torch.cuda.synchronize()`` so kernel time lands in the region that
launched it; this slows the profiled steps down, which is why the profile is a separate pass
after the measured run and never feeds the latency statistics.

Components:
  scheduling          ``scheduler.schedule``
  input_preparation   ``runner.prepare`` (token ids, positions, slot mapping, block tables)
  attention           attention modules minus their linear layers (RoPE, KV write, paged attention)
  linear              every linear layer (q/k/v/o, gate/up/down, lm_head; quantized ones too)
  mlp_other           MLP modules minus their linears (activation, gating multiply)
  model_other         the rest of the forward pass (embedding, norms, residual adds, logits cast)
  sampling            ``sampler.sample``
  detokenization      incremental ``tokenizer.decode`` of each new token, as a streaming server does
  engine_other        ``engine.step``/``runner.execute`` bookkeeping not covered above

Limits: modules run inside a captured CUDA graph or a compiled region fire no hooks; their
time shows up under ``model_other``/``engine_other`` (recorded in ``notes``).
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

__all__ = ["ComponentTimer", "COMPONENTS", "run_component_profile", "unavailable_profile"]

COMPONENTS = ("scheduling", "input_preparation", "attention", "linear", "mlp_other", "model_other",
              "sampling", "detokenization", "engine_other")


def unavailable_profile(reason: str) -> dict[str, Any]:
    """The ``component_profile`` section when no profile could be taken."""
    return {"available": False, "reason": reason, "components": None}


class ComponentTimer:
    """Exclusive wall-time accounting over nested regions.

    Args:
        sync: called at every region boundary (``torch.cuda.synchronize`` on CUDA) or None.
    """

    def __init__(self, sync: Callable[[], None] | None = None) -> None:
        self.sync = sync
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._stack: list[list[Any]] = []

    def enter(self, category: str) -> None:
        if self.sync is not None:
            self.sync()
        self._stack.append([category, time.perf_counter(), 0.0])

    def exit(self) -> None:
        if self.sync is not None:
            self.sync()
        if not self._stack:
            return
        category, start, child = self._stack.pop()
        elapsed = time.perf_counter() - start
        self.totals[category] += elapsed - child
        self.calls[category] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    def reset_stack(self) -> None:
        """Drop unfinished regions (after an exception escaped a hooked module)."""
        self._stack.clear()

    def wrap(self, fn: Callable, category: str) -> Callable:
        def timed(*args, **kwargs):
            self.enter(category)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        return timed

    def summary(self) -> dict[str, Any]:
        total = sum(self.totals.values())
        comps = {}
        for name in list(COMPONENTS) + sorted(set(self.totals) - set(COMPONENTS)):
            t = self.totals.get(name, 0.0)
            comps[name] = {"total_ms": t * 1000.0, "share": (t / total) if total > 0 else None,
                           "calls": int(self.calls.get(name, 0))}
        return {"total_ms": total * 1000.0, "components": comps}


class _Patcher:
    """Instance-attribute method wrapping and module hooks, all undone by ``restore()``."""

    def __init__(self, timer: ComponentTimer) -> None:
        self.timer = timer
        self._patched: list[tuple[Any, str, bool, Any]] = []
        self._handles: list[Any] = []
        self.hooked: list[str] = []
        self.missing: list[str] = []

    def wrap_method(self, obj: Any, attr: str, category: str, label: str) -> bool:
        fn = getattr(obj, attr, None) if obj is not None else None
        if fn is None or not callable(fn):
            self.missing.append(label)
            return False
        had = attr in getattr(obj, "__dict__", {})
        try:
            setattr(obj, attr, self.timer.wrap(fn, category))
        except (AttributeError, TypeError):
            self.missing.append(f"{label} (not patchable)")
            return False
        self._patched.append((obj, attr, had, fn))
        self.hooked.append(label)
        return True

    def hook_module(self, module: Any, category: str) -> None:
        timer = self.timer

        def pre(_m, _inp):
            timer.enter(category)

        def post(_m, _inp, _out):
            timer.exit()

        self._handles.append(module.register_forward_pre_hook(pre))
        try:
            self._handles.append(module.register_forward_hook(post, always_call=True))
        except TypeError:  # torch < 2.1
            self._handles.append(module.register_forward_hook(post))

    def restore(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for obj, attr, had, fn in reversed(self._patched):
            try:
                if had:
                    setattr(obj, attr, fn)
                else:
                    delattr(obj, attr)
            except AttributeError:
                pass
        self._patched.clear()


def _classify_module(name: str, module: Any) -> str | None:
    cls = type(module).__name__
    leaf = not any(True for _ in module.children())
    if "Linear" in cls and (leaf or "Quant" in cls or "Int" in cls):
        return "linear"
    lname = name.rsplit(".", 1)[-1]
    if lname in ("self_attn", "attn", "attention") or (cls.endswith("Attention") and not leaf):
        return "attention"
    if lname == "mlp" or cls.endswith("MLP"):
        return "mlp_other"
    return None


def _hook_model(patcher: _Patcher, model: Any, notes: list[str]) -> None:
    try:
        import torch.nn as nn
    except ImportError:  # pragma: no cover
        return
    if not isinstance(model, nn.Module):
        patcher.missing.append("model (not an nn.Module)")
        return
    patcher.hook_module(model, "model_other")
    counts: Counter[str] = Counter()
    linear_ids: set[int] = set()
    for name, mod in model.named_modules():
        if mod is model:
            continue
        cat = _classify_module(name, mod)
        if cat is None:
            continue
        if cat == "linear":
            # a quantized wrapper holding an nn.Linear: time the outer one only
            if any(id(p) in linear_ids for p in _ancestors(model, name)):
                continue
            linear_ids.add(id(mod))
        patcher.hook_module(mod, cat)
        counts[cat] += 1
        if cat == "attention" and callable(getattr(mod, "forward_reference", None)):
            # the uncached reference path (NaiveEngine) calls this method, not forward()
            patcher.wrap_method(mod, "forward_reference", cat, f"{name}.forward_reference")
    patcher.hooked.append(f"model modules {dict(counts)}")
    for meth in ("compute_logits", "forward_reference"):
        if callable(getattr(model, meth, None)):
            patcher.wrap_method(model, meth, "model_other", f"model.{meth}")


def _ancestors(model: Any, name: str) -> list[Any]:
    parts = name.split(".")
    out, mod = [], model
    for p in parts[:-1]:
        mod = getattr(mod, p, None)
        if mod is None:
            break
        out.append(mod)
    return out


def _first(obj: Any, *paths: str) -> tuple[Any, str | None]:
    for path in paths:
        cur = obj
        for part in path.split("."):
            cur = getattr(cur, part, None)
            if cur is None:
                break
        if cur is not None:
            return cur, path
    return None, None


def run_component_profile(engine: Any, prompts: list[tuple[list[int], Any, int]], *,
                          device: str = "cpu", max_steps: int = 256,
                          request_prefix: str = "profile") -> dict[str, Any]:
    """Profile ``engine`` on a batch of requests submitted at once.

    Args:
        engine: an ``LLMEngine``/``NaiveEngine`` (documented API: add_request, step,
            has_unfinished_requests, abort_request, tokenizer, scheduler, runner, sampler, model).
        prompts: ``(prompt_token_ids, SamplingParams, priority)`` per request.
        device: the engine's device; CUDA adds a synchronize at every region boundary.
        max_steps: stop (and abort the rest) after this many steps.

    Returns:
        ``{"available", "reason", "method", "num_requests", "num_steps", "num_tokens",
        "total_ms", "components": {name: {"total_ms", "share", "calls"}}, "hooked", "missing",
        "notes"}``. Never raises: a failure returns ``available: False`` with the reason.
    """
    sync = None
    notes: list[str] = []
    if str(device).startswith("cuda"):
        try:
            import torch
            sync = torch.cuda.synchronize
        except ImportError:  # pragma: no cover
            pass
    timer = ComponentTimer(sync)
    patcher = _Patcher(timer)
    ids: list[str] = []
    try:
        sched, spath = _first(engine, "scheduler")
        patcher.wrap_method(sched, "schedule", "scheduling", "scheduler.schedule")
        runner, rpath = _first(engine, "runner", "model_runner")
        if runner is not None:
            patcher.wrap_method(runner, "prepare", "input_preparation", f"{rpath}.prepare")
            patcher.wrap_method(runner, "execute", "engine_other", f"{rpath}.execute")
        else:
            patcher.missing.append("runner")
        sampler, spath = _first(engine, "sampler", "runner.sampler", "model_runner.sampler")
        # Sampler.sample calls sample_async (LLMEngine calls it directly): wrap the one that
        # every engine reaches, once.
        meth = "sample_async" if callable(getattr(sampler, "sample_async", None)) else "sample"
        patcher.wrap_method(sampler, meth, "sampling", f"{spath or 'sampler'}.{meth}")
        model, _ = _first(engine, "model", "runner.model", "model_runner.model")
        if model is not None:
            _hook_model(patcher, model, notes)
        else:
            patcher.missing.append("model")
        if getattr(getattr(engine, "config", None), "use_cuda_graph", False) and sync is not None:
            notes.append("CUDA graphs enabled: modules replayed from a graph fire no hooks; "
                         "their time is under model_other/engine_other")
        step = timer.wrap(engine.step, "engine_other")
        tok = getattr(engine, "tokenizer", None)
        decode = None
        if tok is not None and callable(getattr(tok, "decode", None)):
            decode = timer.wrap(tok.decode, "detokenization")
        else:
            notes.append("no tokenizer.decode: detokenization not measured")
        for i, (pids, sp, prio) in enumerate(prompts):
            rid = f"{request_prefix}-{i}"
            engine.add_request(list(pids), sp, request_id=rid, priority=prio)
            ids.append(rid)
        steps = tokens = 0
        while engine.has_unfinished_requests() and steps < max_steps:
            outs = step()
            steps += 1
            for o in outs or ():
                new = list(getattr(o, "new_token_ids", None) or [])
                tokens += len(new)
                if decode is not None and new:
                    decode(new, skip_special_tokens=True)
        if engine.has_unfinished_requests():
            notes.append(f"stopped after max_steps={max_steps}; unfinished requests aborted")
        summ = timer.summary()
        return {"available": True, "reason": None,
                "method": "method wrappers + forward hooks, exclusive wall time"
                          + (", CUDA-synchronised at region boundaries" if sync else ""),
                "num_requests": len(prompts), "num_steps": steps, "num_tokens": tokens,
                "total_ms": summ["total_ms"], "components": summ["components"],
                "hooked": patcher.hooked, "missing": patcher.missing, "notes": notes}
    except Exception as e:  # noqa: BLE001 - the profile must never fail the run
        timer.reset_stack()
        out = unavailable_profile(f"{type(e).__name__}: {e}")
        out.update(hooked=patcher.hooked, missing=patcher.missing, notes=notes)
        return out
    finally:
        patcher.restore()
        for rid in ids:
            try:
                engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                pass
