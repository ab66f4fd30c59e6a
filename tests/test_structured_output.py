"""Structured output (grammar-constrained decoding): the token bitmask in the sampler, the
``StructuredOutput`` spec, and the engine's matchers on the tiny model (CPU).

The bitmask tests compare :func:`apply_token_bitmask` with a bit-by-bit reference at awkward
batch compositions (constrained and free rows mixed, batch 1, odd batches, a vocabulary wider or
narrower than the mask) and check that free rows are never touched. The engine tests check that
constrained outputs always parse and validate, finish when the grammar does, and are identical
with and without preemption, co-scheduled requests, chunked prefill, asynchronous scheduling and
speculative decoding.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

from llmserve.core.sampling_params import SamplingParams, StructuredOutput
from llmserve.worker.sampler import (Sampler, TokenBitmask, _unpack_disallowed_torch, apply_token_bitmask)

xgr = pytest.importorskip("xgrammar")

V_TINY = 151936


# ---------------------------------------------------------------------------------------------
# A JSON Schema check (jsonschema when installed, else by hand for the schemas used here)
# ---------------------------------------------------------------------------------------------
def _check_by_hand(value, schema, path="$"):
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if "const" in schema:
        assert value == schema["const"], f"{path}: {value!r} != {schema['const']!r}"
    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                _check_by_hand(value, sub, path)
                break
            except AssertionError as e:
                errors.append(str(e))
        else:
            raise AssertionError(f"{path}: matches no anyOf branch: {errors}")
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, f"{path}: missing {k!r}"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for k, v in value.items():
            if k in props:
                _check_by_hand(v, props[k], f"{path}.{k}")
    elif t == "array":
        assert isinstance(value, list), f"{path}: not an array"
        assert len(value) >= schema.get("minItems", 0) and len(value) <= schema.get("maxItems", 10**9)
        for i, v in enumerate(value):
            _check_by_hand(v, schema.get("items", {}), f"{path}[{i}]")
    elif t == "boolean":
        assert isinstance(value, bool), f"{path}: not a boolean"
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: not an integer"
        assert schema.get("minimum", -float("inf")) <= value <= schema.get("maximum", float("inf"))
    elif t == "string":
        assert isinstance(value, str), f"{path}: not a string"
        assert len(value) <= schema.get("maxLength", 10**9)


def validate(value, schema) -> None:
    """AssertionError unless ``value`` is valid under ``schema``."""
    try:
        import jsonschema
    except ImportError:
        _check_by_hand(value, schema)
        return
    jsonschema.validate(value, schema)
    _check_by_hand(value, schema)   # the hand check agrees (it guards itself)


#: Bounded outputs: enums, booleans, a small integer, a short array; nothing else allowed.
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "level": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2},
    },
    "required": ["ok", "color", "level", "tags"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------------------------------------
# The bitmask in the sampler
# ---------------------------------------------------------------------------------------------
def _reference_masked(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """Bit by bit: token t of row rows[j] is allowed iff bit t % 32 of word t // 32 is set."""
    out = logits.clone()
    v = logits.shape[1]
    words = bitmask.to(torch.int64) & 0xFFFFFFFF                   # unsigned view of the int32 words
    for j, r in enumerate(rows):
        for t in range(v):
            w = t // 32
            allowed = w < words.shape[1] and (int(words[j, w]) >> (t % 32)) & 1
            if not allowed:
                out[r, t] = float("-inf")
    return out


def _random_bitmask(rows: int, words: int, gen: torch.Generator, density: float = 0.3) -> torch.Tensor:
    bits = torch.rand((rows, words, 32), generator=gen) < density                  # [R, W, 32]
    vals = (bits.to(torch.int64) << torch.arange(32)).sum(-1)                      # [R, W] in [0, 2^32)
    return torch.where(vals >= 2**31, vals - 2**32, vals).to(torch.int32)


@pytest.mark.parametrize("batch,rows,vocab", [
    (1, [0], 70),             # batch 1, constrained
    (1, [], 70),              # batch 1, free
    (5, [0, 3], 96),          # odd batch, mixed, vocab a multiple of 32
    (5, [4, 1, 2], 70),       # rows out of order
    (7, list(range(7)), 33),  # every row constrained, vocab one past a word
    (3, [1], 100),            # a lone constrained row in the middle
])
def test_bitmask_matches_bitwise_reference(batch, rows, vocab):
    gen = torch.Generator().manual_seed(batch * 100 + vocab)
    logits = torch.randn((batch, vocab), generator=gen)
    bm = _random_bitmask(len(rows), (vocab + 31) // 32, gen)
    ref = _reference_masked(logits, rows, bm)
    got = apply_token_bitmask(logits.clone(), TokenBitmask(rows, bm))
    assert torch.equal(got, ref)
    free = [i for i in range(batch) if i not in rows]
    assert torch.equal(got[free], logits[free])                   # free rows untouched
    # the device path's unpacking (used off the CPU) agrees with the CPU path
    disallowed = _unpack_disallowed_torch(bm)[:, :vocab]
    assert torch.equal(disallowed, got[rows] == float("-inf")) if rows else disallowed.numel() == 0


def test_bitmask_vocab_wider_or_narrower_than_the_mask():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn((3, 80), generator=gen)
    narrow = _random_bitmask(2, 2, gen, density=1.0)               # covers 64 ids: 64..79 never allowed
    got = apply_token_bitmask(logits.clone(), TokenBitmask([0, 2], narrow))
    assert torch.isinf(got[[0, 2], 64:]).all() and torch.isfinite(got[[0, 2], :64]).all()
    assert torch.equal(got[1], logits[1])
    wide = _random_bitmask(1, 8, gen)                              # 256 bits for 80 ids: the rest ignored
    got = apply_token_bitmask(logits.clone(), TokenBitmask([1], wide))
    assert torch.equal(got, _reference_masked(logits, [1], wide[:, :3]))


def test_bitmask_rejects_malformed_input():
    logits = torch.zeros((2, 40))
    ok = torch.full((1, 2), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, TokenBitmask([0], ok.to(torch.int64)))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, TokenBitmask([0, 1], ok))      # one mask row for two rows
    with pytest.raises(ValueError, match="distinct"):
        apply_token_bitmask(logits, TokenBitmask([2], ok))
    with pytest.raises(ValueError, match="distinct"):
        apply_token_bitmask(logits, TokenBitmask([0, 0], ok.repeat(2, 1)))


def _one_hot_mask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = (vocab + 31) // 32
    vals = torch.zeros((len(allowed), words), dtype=torch.int64)
    for j, ids in enumerate(allowed):
        for t in ids:
            vals[j, t // 32] |= 1 << (t % 32)
    return torch.where(vals >= 2**31, vals - 2**32, vals).to(torch.int32)


@pytest.mark.parametrize("batch,rows", [(1, [0]), (5, [1, 4]), (7, [0, 2, 3, 6]), (4, [])])
def test_sampler_constrains_only_the_masked_rows(batch, rows):
    """Greedy and sampled (seeded) rows, mixed with penalties and logprobs: constrained rows
    pick allowed tokens only; free rows get exactly what they get without any mask."""
    vocab = 200
    gen = torch.Generator().manual_seed(batch)
    logits = torch.randn((batch, vocab), generator=gen) * 3
    params = []
    for i in range(batch):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, logprobs=3))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_k=50, seed=i))
        else:
            params.append(SamplingParams(temperature=0.7, top_p=0.9, seed=i, presence_penalty=0.5, logprobs=2))
    ids = [f"r{i}" for i in range(batch)]
    history = None
    from llmserve.worker.sampler import TokenHistory
    history = [TokenHistory([1, 2], [3]) for _ in range(batch)]
    rng = random.Random(batch)
    allowed = [sorted(rng.sample(range(vocab), 2 if j % 2 else 1)) for j in range(len(rows))]
    mask = TokenBitmask(rows, _one_hot_mask(allowed, vocab))
    free = Sampler("cpu", seed=0).sample(logits.clone(), params, ids, history=history)
    got = Sampler("cpu", seed=0).sample(logits.clone(), params, ids, history=history, token_bitmask=mask)
    for j, r in enumerate(rows):
        assert got.token_ids[r] in allowed[j]
        if params[r].logprobs:
            top = got.logprobs[r]["top"]
            assert {t for t, _ in top} <= set(allowed[j]) and len(top) == min(len(allowed[j]), params[r].logprobs)
    for i in range(batch):
        if i not in rows:
            assert got.token_ids[i] == free.token_ids[i]
            assert got.logprobs[i] == free.logprobs[i]


def test_sampler_fixes_a_given_device_argmax_without_writing_it():
    """A decode graph hands its argmax in: constrained greedy rows are recomputed from the
    masked logits and the caller's buffer is left as it was."""
    vocab = 64
    logits = torch.randn((3, vocab), generator=torch.Generator().manual_seed(5))
    argmax = logits.argmax(-1)
    before = argmax.clone()
    target = int(logits[1].argsort()[0])                           # the least likely token of row 1
    mask = TokenBitmask([1], _one_hot_mask([[target]], vocab))
    got = Sampler("cpu").sample_async(logits.clone(), [SamplingParams()] * 3, ["a", "b", "c"],
                                      argmax=argmax, token_bitmask=mask).result()
    assert got.token_ids == [int(before[0]), target, int(before[2])]
    assert torch.equal(argmax, before)


# ---------------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------------
def test_structured_output_spec_validation():
    s = StructuredOutput("json_schema", {"type": "object", "properties": {"b": {}, "a": {}}})
    assert json.loads(s.json_schema) == {"type": "object", "properties": {"b": {}, "a": {}}}
    assert list(json.loads(s.json_schema)["properties"]) == ["b", "a"]         # property order kept
    assert s.key == StructuredOutput("json_schema", s.json_schema).key
    assert StructuredOutput("json_object").key != StructuredOutput("json_object", whitespace="any").key
    for kw, msg in [(dict(kind="xml"), "kind"), (dict(kind="json_schema"), "required"),
                    (dict(kind="json_object", json_schema={}), "None for kind"),
                    (dict(kind="json_schema", json_schema="{nope"), "not valid JSON"),
                    (dict(kind="json_schema", json_schema=[1]), "JSON object"),
                    (dict(kind="json_object", whitespace="tabs"), "whitespace")]:
        with pytest.raises(ValueError, match=msg):
            StructuredOutput(**kw)
    with pytest.raises(ValueError, match="structured_output must be"):
        SamplingParams(structured_output={"type": "json_object"})


# ---------------------------------------------------------------------------------------------
# The engine on the tiny model
# ---------------------------------------------------------------------------------------------
BLOCK = 16


def _config(max_seqs=8, num_blocks=256, chunk=None, budget=2048, async_scheduling=None):
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig

    return EngineConfig(model="tiny", device="cpu", dtype="float32", async_scheduling=async_scheduling,
                        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                                  prefill_chunk_size=chunk, max_model_len=512))


def _run(engine, reqs):
    seqs = [engine.add_request(p, sp) for p, sp in reqs]
    while engine.has_unfinished_requests():
        engine.step()
    return seqs


def _text(engine, ids) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def workload():
    """Constrained requests (greedy and seeded sampled, two choices of one prompt) mixed with
    free ones (fixed lengths) at prompt lengths around the block size."""
    rng = random.Random(11)
    spec = StructuredOutput("json_schema", SCHEMA)
    reqs = []
    for i, n in enumerate((3, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK + 3, 7)):
        prompt = [rng.randrange(10, 151643) for _ in range(n)]
        if i % 2 == 0:
            reqs.append((prompt, SamplingParams(max_tokens=48, structured_output=spec)))
            reqs.append((prompt, SamplingParams(max_tokens=48, temperature=0.9, seed=i, structured_output=spec)))
        else:
            reqs.append((prompt, SamplingParams(max_tokens=rng.randint(4, 24), ignore_eos=True)))
    return reqs


@pytest.fixture(scope="module")
def reference(workload):
    from llmserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(_config())
    seqs = _run(eng, workload)
    return eng, [list(s.output_token_ids) for s in seqs], [s.finish_reason for s in seqs]


def test_constrained_outputs_validate_and_stop_with_the_grammar(reference, workload):
    eng, outs, reasons = reference
    constrained = [i for i, (_, sp) in enumerate(workload) if sp.structured_output is not None]
    for i in constrained:
        assert reasons[i] == "stop", (i, _text(eng, outs[i]))
        assert outs[i][-1] in eng.eos_token_ids             # the grammar's stop token ends it
        validate(json.loads(_text(eng, outs[i])), SCHEMA)
    for i, (_, sp) in enumerate(workload):
        if i not in constrained:
            assert reasons[i] == "length" and len(outs[i]) == sp.max_tokens
    st = eng.stats()["structured_output"]
    assert st["grammar_cache"]["compiles"] == 1 and st["grammar_cache"]["hits"] >= len(constrained)
    assert st["requests"] == len(constrained) and st["active"] == 0 and st["rejected_tokens"] == 0
    assert st["mask_rows"] == sum(len(outs[i]) for i in constrained)   # one bitmask row per token


@pytest.mark.parametrize("kw", [
    dict(max_seqs=1),                                      # alone: no co-scheduled request
    dict(num_blocks=10, chunk=11, budget=40),              # forced preemption (recompute) + chunks
    dict(chunk=7, budget=29),                              # chunked prefill mixed with decodes
    dict(async_scheduling=True),                           # step n+1 planned before n is read
    dict(async_scheduling=True, num_blocks=10, chunk=11, budget=40),
])
def test_constrained_outputs_do_not_depend_on_the_batch(reference, workload, kw):
    from llmserve.engine.llm_engine import LLMEngine

    _, ref, ref_reasons = reference
    eng = LLMEngine(_config(**kw))
    seqs = _run(eng, workload)
    assert [list(s.output_token_ids) for s in seqs] == ref
    assert [s.finish_reason for s in seqs] == ref_reasons
    if "num_blocks" in kw:
        assert eng.stats()["num_preemptions"] > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_total_blocks
    assert len(eng.structured) == 0 and all(s.num_pending == 0 for s in seqs)


def test_step_seconds_book_the_early_read_once(workload, monkeypatch):
    """With asynchronous scheduling a step with constrained rows reads the previous step's
    tokens before it samples (``_launch``); that read's seconds are booked once (its wait as
    ``device_wait``, not again inside ``sample``), so the phases sum to at most the stepping
    time and a slower device shows only as ``device_wait``."""
    import time as _time

    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.worker.sampler import PendingSample

    original = PendingSample.wait

    def run(delay: float) -> tuple[dict, float, float]:
        waits, done = [], []                 # done: samples already waited for (kept alive)

        def slow_wait(self):                 # a device that takes `delay` to deliver the ids
            if any(d is self for d in done):  # the ids are here: result()'s wait is free
                return original(self)
            t = _time.perf_counter()
            _time.sleep(delay)
            original(self)
            waits.append(_time.perf_counter() - t)
            done.append(self)

        monkeypatch.setattr(PendingSample, "wait", slow_wait)
        eng = LLMEngine(_config(async_scheduling=True))
        seqs = [eng.add_request(p, sp) for p, sp in workload]
        t = _time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        wall = _time.perf_counter() - t
        assert all(s.is_finished for s in seqs)
        return eng.stats()["step_seconds"], wall, sum(waits)

    fast, fast_wall, _ = run(0.0)
    slow, slow_wall, slept = run(0.02)
    for st, wall in ((fast, fast_wall), (slow, slow_wall)):
        assert sum(st.values()) <= wall
    assert slept > 0.2 and slow["device_wait"] >= slept - 1e-3
    # the sleeps are in device_wait only: sample grows by far less than they add
    assert slow["sample"] - fast["sample"] < 0.25 * slept


def test_ignore_eos_still_ends_with_the_grammar_and_abort_frees_the_matcher():
    from llmserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(_config())
    spec = StructuredOutput("json_schema", {"enum": ["yes", "no"]})
    out = eng.generate([5, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True, structured_output=spec))[0]
    assert out.finish_reason == "stop" and json.loads(_text(eng, out.output_token_ids)) in ("yes", "no")
    seq = eng.add_request([5, 6], SamplingParams(max_tokens=30, structured_output=spec))
    assert seq.request_id in eng.structured
    eng.abort_request(seq.request_id)
    assert seq.request_id not in eng.structured


def test_bad_schemas_and_engines_without_grammars_are_refused():
    from llmserve.engine.llm_engine import LLMEngine
    from llmserve.engine.naive import NaiveEngine

    eng = LLMEngine(_config())
    for schema, msg in [({"type": "nope"}, "Unsupported type"),
                        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum")]:
        with pytest.raises(ValueError, match=f"invalid JSON schema .*: .*{msg}"):
            eng.add_request([1, 2], SamplingParams(structured_output=StructuredOutput("json_schema", schema)))
    assert not eng.has_unfinished_requests() and len(eng.structured) == 0
    with pytest.raises(ValueError, match="not supported by NaiveEngine"):
        NaiveEngine(_config()).add_request([1, 2], SamplingParams(structured_output=StructuredOutput("json_object")))


def test_grammar_cache_compiles_once_per_schema_and_evicts_the_oldest():
    from llmserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(dataclasses.replace(_config(), grammar_cache_size=1))
    a, b = StructuredOutput("json_schema", {"enum": ["a"]}), StructuredOutput("json_schema", {"enum": ["b"]})
    for spec in (a, a, b, b, a):
        eng.check_structured_output(spec)
    st = eng.structured.cache.stats()
    assert (st["compiles"], st["hits"], st["cached"]) == (3, 2, 1)
    with pytest.raises(ValueError, match="grammar_cache_size"):
        dataclasses.replace(_config(), grammar_cache_size=0)


def test_speculative_decoding_goes_through_the_grammar(reference, workload):
    """Greedy constrained requests under speculative decoding (draft = the target's weights):
    the same tokens as target-only constrained decoding, drafts masked (all accepted), the
    matchers rolled back after each verification; sampled ones stay valid."""
    from llmserve.engine.speculative import SpeculativeEngine

    _, ref, _ = reference
    greedy = [i for i, (_, sp) in enumerate(workload) if sp.greedy]
    eng = SpeculativeEngine(_config(), draft_model="target", num_speculative_tokens=3)
    seqs = _run(eng, [workload[i] for i in greedy])
    assert [list(s.output_token_ids) for s in seqs] == [ref[i] for i in greedy]
    st = eng.speculative_stats()
    assert st["num_verifications"] > 0 and st["acceptance_rate"] > 0.99
    sampled = [(p, dataclasses.replace(sp, num_speculative_tokens=2))
               for p, sp in workload if sp.structured_output is not None and not sp.greedy]
    for s in _run(eng, sampled):
        assert s.finish_reason == "stop"
        validate(json.loads(_text(eng, s.output_token_ids)), SCHEMA)
    assert eng.stats()["structured_output"]["rejected_tokens"] == 0 and len(eng.structured) == 0


def test_a_token_outside_the_grammar_aborts_the_request_once(monkeypatch, caplog):
    """Should a constrained row ever be sampled without its mask (an engine bug), the grammar
    refuses the token: the request is aborted (logged, its callback told once), never
    reported as a valid stop."""
    from llmserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(_config())
    monkeypatch.setattr(eng, "_constrain", lambda seqs, logits, argmax: (seqs, logits, argmax, None))
    seen = []
    spec = StructuredOutput("json_schema", {"enum": ["yes", "no"]})
    seq = eng.add_request([5, 6, 7], SamplingParams(max_tokens=8, structured_output=spec), callback=seen.append)
    with caplog.at_level("ERROR", logger="llmserve.engine"):
        while eng.has_unfinished_requests():
            eng.step()
    assert seq.finish_reason == "abort" and len(seq.output_token_ids) == 1
    assert [o.finished for o in seen] == [True] and "not allowed by its grammar" in caplog.text
    assert eng.stats()["structured_output"]["rejected_tokens"] == 1 and len(eng.structured) == 0


def test_step_bitmasks_reuse_two_buffers_and_fill_every_row():
    """fill_bitmask without ``out`` takes rows of two host buffers in turn (stale contents are
    overwritten: the rows equal masks filled into a fresh all-allowed bitmask)."""
    from llmserve.engine.llm_engine import LLMEngine

    eng = LLMEngine(_config())
    spec = StructuredOutput("json_schema", {"enum": ["yes", "no"]})
    seqs = [eng.add_request([5, 6, 7], SamplingParams(max_tokens=8, structured_output=spec)) for _ in range(10)]
    m = eng.structured
    ids = [s.request_id for s in seqs]
    first = m.fill_bitmask(ids[:3])
    first.fill_(0)                                           # stale contents for the next turn
    second = m.fill_bitmask(ids[:5])
    third = m.fill_bitmask(ids[:4])
    assert first.data_ptr() == third.data_ptr() != second.data_ptr()
    assert third.shape == (4, m.cache.bitmask_words) and second.shape == (5, m.cache.bitmask_words)
    fresh = m.new_bitmask(4)
    m.fill_bitmask(ids[:4], out=fresh)
    assert torch.equal(third, fresh) and torch.equal(second[:4], fresh)
    bigger = m.fill_bitmask(ids)                             # grows past the buffer's 8 rows
    assert bigger.shape[0] == 10 and torch.equal(bigger[:4], fresh)


@pytest.mark.parametrize("rows", [2, 3, 16, 17])
def test_serial_and_pooled_bitmask_fills_agree(rows):
    """Below ``grammar_parallel_fill_rows`` the rows are filled one by one on the calling thread
    (no xgrammar pool is made), at or above it on the pool; both give the same bits, for
    matchers in different states of the schema."""
    from llmserve.engine.llm_engine import LLMEngine

    spec = StructuredOutput("json_schema", SCHEMA)
    masks = {}
    for threshold in (rows + 1, rows):                       # serial, then pooled
        eng = LLMEngine(dataclasses.replace(_config(max_seqs=32), grammar_parallel_fill_rows=threshold,
                                            grammar_fill_threads=2))
        seqs = [eng.add_request([5, 6, 7], SamplingParams(max_tokens=64, structured_output=spec))
                for _ in range(rows)]
        m = eng.structured
        ids = [s.request_id for s in seqs]
        for i, sid in enumerate(ids):                        # row i accepts i grammar-allowed tokens
            matcher = m._active[sid].matcher
            for _ in range(i):
                one = m.new_bitmask(1)
                matcher.fill_next_token_bitmask(one, 0)
                bits = (one[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1
                allowed = bits.flatten()[: m.vocab_size].nonzero().flatten().tolist()
                assert allowed and matcher.accept_token(allowed[len(allowed) // 2])
        masks[threshold] = m.fill_bitmask(ids).clone()
        assert (m._batch is not None) == (threshold <= rows)
    assert torch.equal(masks[rows], masks[rows + 1])


def test_grammar_fill_settings_are_validated():
    from llmserve.config import EngineConfig

    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="grammar_parallel_fill_rows"):
            EngineConfig(grammar_parallel_fill_rows=bad)
    for bad in (0, False, "auto"):
        with pytest.raises(ValueError, match="grammar_fill_threads"):
            EngineConfig(grammar_fill_threads=bad)
    assert EngineConfig(grammar_fill_threads=None).grammar_fill_threads is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_constrained_decode_graphs_async_match_sync():
    """On the GPU: CUDA-graph decode (the graph's argmax fixed for masked rows), pinned
    bitmasks copied asynchronously, asynchronous scheduling reading the previous step early;
    constrained outputs are valid and identical to the synchronous engine's."""
    from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig
    from llmserve.engine.llm_engine import LLMEngine

    def make(flag):
        return LLMEngine(EngineConfig(model="random:qwen2.5-0.5b", device="cuda", dtype="bfloat16",
                                      attention_backend="triton", async_scheduling=flag,
                                      cache=CacheConfig(block_size=16, num_blocks=512),
                                      scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=512,
                                                                prefill_chunk_size=64, max_num_batched_tokens=128)))
    rng = random.Random(3)
    spec = StructuredOutput("json_schema", SCHEMA)
    reqs = [([rng.randrange(10, 151643) for _ in range(n)],
             SamplingParams(max_tokens=48, structured_output=spec) if i % 2 == 0 else
             SamplingParams(max_tokens=20, ignore_eos=True)) for i, n in enumerate((5, 16, 17, 40, 90, 3))]
    ref = [list(s.output_token_ids) for s in _run(make(False), reqs)]
    eng = make(True)
    seqs = _run(eng, reqs)
    assert [list(s.output_token_ids) for s in seqs] == ref
    assert eng.runner.num_graph_steps > 0
    for s, (_, sp) in zip(seqs, reqs):
        if sp.structured_output is not None:
            assert s.finish_reason == "stop"
            validate(json.loads(_text(eng, s.output_token_ids)), SCHEMA)


@pytest.mark.parametrize("schema,needle", [
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "'allOf' at #"),
    ({"not": {"type": "string"}}, "'not' at #"),
    ({"$ref": "http://example.com/s.json"}, "points outside the schema"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "'uniqueItems'"),
    ({"type": "array", "contains": {"type": "integer"}}, "'contains'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "'oneOf'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "required": ["a"], "dependencies": {"a": ["b"]}}, "'dependencies'"),
    ({"type": "object", "properties": {}, "required": ["z"], "additionalProperties": False}, "names ['z']"),
    ({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"not": {}}}}}},
     "#/properties/a/properties/b"),
])
def test_schema_keywords_that_would_not_be_enforced_are_refused(schema, needle):
    from llmserve.core.sampling_params import StructuredOutput

    with pytest.raises(ValueError, match="not enforced|outside the schema|does not declare") as e:
        StructuredOutput(kind="json_schema", json_schema=schema)
    assert needle in str(e.value)


def test_schema_property_names_are_not_keywords():
    from llmserve.core.sampling_params import StructuredOutput

    spec = StructuredOutput(kind="json_schema", json_schema={
        "type": "object", "properties": {"not": {"type": "integer"}, "allOf": {"enum": ["oneOf"]}},
        "$defs": {"x": {"type": "boolean"}}, "required": ["not"]})
    assert "not" in spec.json_schema
