"""The OpenAI-compatible routes: ``create_app(engine)`` builds the FastAPI app
(``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``).
"""

from __future__ import annotations
import asyncio
import contextlib
import json
import time
import uuid
from typing import Any, AsyncIterator
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from .detokenizer import decode_tokens
from .metrics import ServiceMetrics
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                       ModelList, TokenizeRequest)
from .errors import error_response, install_error_handlers, log
from .prompt_limits import TooManyTokens
from .structured import ChatPlan, chat_messages, new_call_id, plan_chat, render_messages, tool_calls_of
from .tool_parser import HermesToolParser, ParsedCall, parse_tool_calls, template_messages, template_renders_tools
from .guard import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestGuardMiddleware
from .generation import (
    MAX_CHOICES,
    EngineView,
    Generation,
    Service,
    SSEResponse,
    chat_logprobs,
    completion_logprobs,
    echoed_prompt_logprobs,
    merge_logprobs,
    sse_event,
    usage_object,
)


async def _stream_events(gen: Any, choices) -> AsyncIterator[tuple[Any, list]]:
    """The events of ``gen`` worth a chunk (new text or a finish reason), each with the
    logprob records its choice produced since its previous chunk (events without text, e.g.
    a token held back by the incremental detokenizer, carry theirs forward)."""
    pending: dict[int, list] = {ch.index: [] for ch in choices}
    async for ev in gen.events():
        pending[ev.index].extend(ev.logprobs)
        if not ev.text and ev.finish_reason is None:
            continue
        records, pending[ev.index] = pending[ev.index], []
        yield ev, records


# ------------------------------------------------------------------------------------------------
# App factory
# ------------------------------------------------------------------------------------------------
def create_app(engine: Any, *, tokenizer: Any = None, served_model_name: str = "tiny",
               model_aliases: tuple[str, ...] = (), max_model_len: int | None = None,
               vocab_size: int | None = None, max_waiting: int | None = None,
               shutdown_timeout: float = 10.0, owns_engine: bool = False,
               max_choices: int = MAX_CHOICES,
               max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
               api_key: str | None = None, api_key_protects_metrics: bool = False,
               max_tokenize_tokens: int | None = None) -> FastAPI:
    """Build the FastAPI app.

    Args:
        engine: an ``AsyncLLMEngine`` (``generate(prompt_ids, sp, request_id=, priority=)`` async
            iterator, ``abort(request_id)``); its ``.engine`` (an ``LLMEngine``) supplies
            ``tokenizer``, ``max_model_len``, ``model_config.vocab_size``, ``check_request`` and
            ``stats()`` when not given here.
        tokenizer: HF tokenizer (default: the engine's).
        served_model_name: the ``model`` clients name; ``model_aliases`` are accepted too.
        max_model_len: context length in tokens (default, and at most: the engine's).
        max_waiting: answer 429 while this many requests wait (default: the engine's
            ``max_waiting``; ``None`` = unbounded).
        shutdown_timeout: seconds the lifespan shutdown waits for in-flight requests before
            aborting them.
        owns_engine: call ``engine.shutdown()`` when the app shuts down.
        max_choices: most engine requests (prompts x ``n``) one HTTP request may start.
        max_request_body_bytes: larger request bodies are answered 413 before they are read
            (``None``: no limit).
        api_key: when set, every route but ``/health`` and ``/metrics`` needs ``Authorization:
            Bearer <api_key>`` (401 otherwise); ``api_key_protects_metrics`` extends that to those two.

        max_tokenize_tokens: most tokens one ``/tokenize`` or ``/detokenize`` request may count
            (400 ``too_many_tokens`` above; default: the larger of 32,768 and 8 x the context).

    Raises:
        ValueError: ``max_request_body_bytes`` < 1, an empty ``api_key`` or
            ``max_tokenize_tokens`` < 1.
    """
    RequestGuardMiddleware.validate(max_request_body_bytes, api_key)  # at build time, not on the first request
    view = EngineView(engine, tokenizer, max_model_len, vocab_size)
    metrics = ServiceMetrics(view.stats)
    if max_tokenize_tokens is not None and (isinstance(max_tokenize_tokens, bool)
                                            or not isinstance(max_tokenize_tokens, int) or max_tokenize_tokens < 1):
        raise ValueError(f"max_tokenize_tokens must be an integer >= 1 (or None for the default), "
                         f"got {max_tokenize_tokens!r}")
    service = Service(view, served_model_name, tuple(model_aliases), metrics,
                      max_waiting if max_waiting is not None else view.max_waiting, max_tokenize_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        start = getattr(engine, "start", None)
        if callable(start):
            start()
        try:    # read the tokenizer's bounds now, not in the first request
            await service.run_blocking(service.budget.prepare)
        except Exception:  # noqa: BLE001 - serve without the early refusals
            log.warning("could not inspect the tokenizer for prompt-length bounds", exc_info=True)
        yield
        await service.drain(shutdown_timeout)
        service.close()
        if owns_engine:
            stop = getattr(engine, "shutdown", None)
            if callable(stop):
                await asyncio.to_thread(stop)

    app = FastAPI(title="llmserve", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible completions over the llmserve engine")
    app.state.service = service
    app.state.metrics = metrics
    install_error_handlers(app, metrics)
    app.add_middleware(RequestGuardMiddleware, max_body_bytes=max_request_body_bytes, api_key=api_key,
                       protect_open_routes=api_key_protects_metrics, metrics=metrics)

    @app.get("/health")
    async def health() -> Response:
        errored = getattr(engine, "errored", None)
        is_running = getattr(engine, "is_running", True)
        if errored is not None and not is_running:
            return error_response(503, f"engine loop failed: {errored!r}", type="service_unavailable")
        body = {"status": "ok", "batch_invariant": view.batch_invariant}
        if view.startup:
            body["startup"] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in view.startup.items()}
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        body, ctype = metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> dict:
        card = ModelCard(id=service.served_model_name, created=service.created,
                         root=service.served_model_name, max_model_len=view.max_model_len,
                         batch_invariant=view.batch_invariant)
        return {"object": "list", "data": [card.model_dump()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> Response:
        if model_id not in service.model_names:
            return error_response(404, f"model {model_id!r} does not exist; this server serves "
                                  f"{service.served_model_name!r} (see GET /v1/models)",
                                  type="invalid_request_error", param="model", code="model_not_found")
        card = ModelCard(id=model_id, created=service.created, root=service.served_model_name,
                         max_model_len=view.max_model_len, batch_invariant=view.batch_invariant)
        return JSONResponse(card.model_dump())

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return _tokenizer_info(service.tokenizer, view.max_model_len)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        service.check_model(body.model)
        tok = service.tokenizer
        cap = service.max_tokenize_tokens
        if body.messages is not None:
            if body.prompt is not None:
                raise APIError("send either prompt or messages, not both", param="messages")
            from ..tokenizer import apply_chat_template
            param, num_chars = "messages", sum(len(m.text()) for m in body.messages)
            msgs = render_messages(body.messages)       # earlier tool calls included, as in chat

            def text_of() -> str:
                return apply_chat_template(tok, msgs, bool(body.add_generation_prompt))
            add_special = bool(body.add_special_tokens) if body.add_special_tokens is not None else False
        elif body.prompt is not None:
            param, num_chars, prompt = "prompt", len(body.prompt), body.prompt

            def text_of() -> str:
                return prompt
            add_special = True if body.add_special_tokens is None else bool(body.add_special_tokens)
        else:
            raise APIError("prompt or messages is required", param="prompt")

        def too_many(at_least: int) -> APIError:
            return APIError(f"/tokenize counts at most {cap} tokens per request and this text has at least "
                            f"{at_least}; send it in parts", param=param, code="too_many_tokens")

        at_least = service.budget.quick_lower_bound(num_chars)
        if at_least > cap:
            raise too_many(at_least)

        def count() -> list[int]:
            try:
                return service.budget.encode(text_of(), cap + 1, add_special_tokens=add_special)
            except TooManyTokens as e:
                raise too_many(e.at_least) from None
            except (TypeError, UnicodeError, RecursionError) as e:
                raise APIError(f"the text could not be tokenized ({type(e).__name__})", param=param) from None

        ids = await service.run_tokenizer_route(count)
        out = {"count": len(ids), "max_model_len": view.max_model_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = tok.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        service.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < view.vocab_size]
        if bad:
            raise APIError(f"token ids must be in [0, {view.vocab_size}), got {bad[:5]}", param="tokens",
                           code="invalid_token_id")
        if len(body.tokens) > service.max_tokenize_tokens:
            raise APIError(f"/detokenize takes at most {service.max_tokenize_tokens} tokens per request, got "
                           f"{len(body.tokens)}; send them in parts", param="tokens", code="too_many_tokens")
        text = await service.run_tokenizer_route(decode_tokens, service.tokenizer, list(body.tokens))
        return {"prompt": text}

    @app.post("/v1/completions", responses={400: {"description": "invalid request"},
                                            429: {"description": "queue full"}})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        service.unsupported(body)
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix", code="unsupported_parameter")
        n = body.n or 1
        if body.best_of is not None and body.best_of != n:
            raise APIError("best_of must equal n (best-of sampling is not supported)", param="best_of",
                           code="unsupported_parameter")
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        # max_tokens 0 with echo scores the prompt only: the engine samples one token, dropped here
        score_only = max_tokens == 0
        if score_only and not body.echo:
            raise APIError("max_tokens must be >= 1 (0 is accepted with echo, to score the prompt only)",
                           param="max_tokens")
        max_tokens = max(1, max_tokens)
        prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
        texts = body.prompts()
        if len(texts) * n > max_choices:          # before any prompt is tokenized
            raise APIError(f"too many choices: {len(texts)} prompts x n={n} > {max_choices} per request",
                           param="prompt" if len(texts) > 1 else "n")
        for p in texts:
            if isinstance(p, str):
                service.precheck_prompt(len(p), max_tokens, "prompt")
        prompts = [await service.run_blocking(service.tokenize_prompt, p, "prompt", max_tokens) for p in texts]
        if len(prompts) * n > max_choices:
            raise APIError(f"too many choices: {len(prompts)} prompts x n={n} > {max_choices} per request",
                           param="prompt" if len(prompts) > 1 else "n")
        for ids in prompts:
            service.check_context(len(ids), max_tokens, "prompt")
        service.check_capacity(len(prompts) * n)
        choices = service.build_choices(
            prompts, n, lambda p, i: service.sampling_params(body, max_tokens, body.logprobs, i, [],
                                                             prompt_logprobs=prompt_lp),
            body.stop_list(), body.priority or 0, "cmpl")
        echo_texts = [await service.run_blocking(decode_tokens, service.tokenizer, ids) if body.echo else ""
                      for ids in prompts]
        gen = Generation(service, choices)
        # a stream starts once every choice is admitted (an echo stream needs the prompt's
        # logprobs of the first outputs first)
        await gen.start(request, until_admitted=bool(body.stream) and not body.echo)
        service.start_tracking(choices)
        rid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), service.served_model_name
        prompt_tokens = sum(len(p) for p in prompts)
        want_lp = body.logprobs is not None

        def echo_lp(ch) -> dict | None:
            if prompt_lp is None:
                return None
            return echoed_prompt_logprobs(service.tokenizer, ch.prompt_ids, ch.prompt_logprobs,
                                          len(echo_texts[ch.index // n]))

        def completion_tokens() -> int:
            return 0 if score_only else sum(c.num_output_tokens for c in choices)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = include_usage and bool(body.stream_options.continuous_usage_stats)

            async def stream() -> AsyncIterator[str]:
                extra = {"usage": None} if include_usage else {}
                if body.echo:
                    for ch in choices:
                        if prompt_lp is not None and ch.prompt_logprobs is None and ch.first is not None:
                            ch.prompt_logprobs = getattr(ch.first, "prompt_logprobs", None)
                        yield sse_event({"id": rid, "object": "text_completion", "created": created,
                                         "model": model,
                                         "choices": [{"index": ch.index, "text": echo_texts[ch.index // n],
                                                      "logprobs": echo_lp(ch), "finish_reason": None}], **extra})
                async for ev, records in _stream_events(gen, choices):
                    if score_only:
                        if ev.finish_reason is None:
                            continue
                        ev.text, records, ev.finish_reason = "", [], "length"
                    lp = None
                    if want_lp:
                        lp = completion_logprobs(service.tokenizer, records, len(echo_texts[ev.index // n]))
                    if continuous:
                        extra = {"usage": usage_object(prompt_tokens, completion_tokens())}
                    yield sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                                     "choices": [{"index": ev.index, "text": ev.text, "logprobs": lp,
                                                  "finish_reason": ev.finish_reason}], **extra})
                if include_usage:
                    yield sse_event({"id": rid, "object": "text_completion", "created": created, "model": model,
                                     "choices": [], "usage": usage_object(prompt_tokens, completion_tokens())})

            return SSEResponse(stream(), gen, rid)

        await gen.collect(request)
        out_choices = []
        for ch in choices:
            echo = echo_texts[ch.index // n]
            if score_only:
                text, lp, finish = echo, echo_lp(ch), "length"
            else:
                text, finish = echo + "".join(ch.text_parts), ch.finish_reason
                lp = merge_logprobs(echo_lp(ch), completion_logprobs(service.tokenizer, ch.logprobs, len(echo))) \
                    if want_lp else None
            out_choices.append({"index": ch.index, "text": text, "logprobs": lp, "finish_reason": finish})
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": out_choices,
                             "usage": usage_object(prompt_tokens, completion_tokens())})

    @app.post("/v1/chat/completions", responses={400: {"description": "invalid request"},
                                                 429: {"description": "queue full"}})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        service.check_model(body.model)
        service.unsupported(body)
        n = body.n or 1
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        plan = plan_chat(body)
        if plan.spec is not None:
            await service.compile_structured(plan)   # on the grammar threads, bounded in time
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # the template writes every message's text into the prompt: their length bounds it
        service.precheck_prompt(sum(len(m.text()) for m in body.messages), asked or 1, "messages")
        render = _chat_renderer(service.tokenizer, body, plan)
        ids = await service.run_blocking(lambda: service.tokenize_prompt(render(), "messages", asked or 1))
        limit = view.max_model_len
        if asked is not None:
            max_tokens = asked
        else:
            room = limit - len(ids)
            cap = view.capacity_tokens()
            if cap is not None:
                room = min(room, cap - len(ids))
            max_tokens = max(1, room)
        service.check_context(len(ids), max_tokens, "messages")
        service.check_capacity(n)
        lp_k = (body.top_logprobs or 0) if body.logprobs else None
        choices = service.build_choices(
            [ids], n, lambda p, i: service.sampling_params(body, max_tokens, lp_k, i, service.chat_stop_ids,
                                                           structured_output=plan.spec),
            body.stop_list(), body.priority or 0, "chat", prompt_param="messages")
        gen = Generation(service, choices)
        await gen.start(request, until_admitted=bool(body.stream))
        service.start_tracking(choices)
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), service.served_model_name
        prompt_tokens = len(ids)

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            continuous = include_usage and bool(body.stream_options.continuous_usage_stats)
            calls = _StreamedCalls(plan, choices)

            async def stream() -> AsyncIterator[str]:
                extra = {"usage": None} if include_usage else {}
                head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
                for ch in choices:
                    yield sse_event({**head, "choices": [{"index": ch.index, "delta": calls.first_delta(ch.index),
                                                          "logprobs": None, "finish_reason": None}], **extra})
                async for ev, records in _stream_events(gen, choices):
                    for delta, recs, finish in calls.chunks(ev, records, choices[ev.index].text_parts):
                        lp = chat_logprobs(service.tokenizer, recs) if lp_k is not None else None
                        if continuous:
                            extra = {"usage": usage_object(prompt_tokens, sum(c.num_output_tokens for c in choices))}
                        yield sse_event({**head, "choices": [{"index": ev.index, "delta": delta, "logprobs": lp,
                                                              "finish_reason": finish}], **extra})
                if include_usage:
                    yield sse_event({**head, "choices": [],
                                     "usage": usage_object(prompt_tokens, sum(c.num_output_tokens for c in choices))})

            return SSEResponse(stream(), gen, rid)

        await gen.collect(request)
        out_choices = []
        for ch in choices:
            message, finish = _chat_message(plan, "".join(ch.text_parts), ch.finish_reason)
            out_choices.append({
                "index": ch.index,
                "message": message,
                "logprobs": chat_logprobs(service.tokenizer, ch.logprobs) if lp_k is not None else None,
                "finish_reason": finish})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                             "choices": out_choices,
                             "usage": usage_object(prompt_tokens, sum(c.num_output_tokens for c in choices))})

    return app


def _complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _api_calls(calls: list[ParsedCall]) -> list[dict]:
    return [{"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls]


def _chat_message(plan: ChatPlan, text: str, finish: str | None) -> tuple[dict, str | None]:
    """A whole answer's ``message`` and ``finish_reason``: a forced call becomes
    ``tool_calls`` (legacy: ``function_call``) with ``content: null`` and finish reason
    ``tool_calls`` (``function_call``) once its JSON is complete; a call cut short by
    ``max_tokens`` or a stop string keeps its finish reason (a named call its partial arguments,
    a ``required`` one its text as ``content``). ``auto``: the Hermes blocks parsed into
    ``tool_calls`` (finish reason ``tool_calls`` when there is one), the other text as
    ``content``."""
    if plan.mode == "auto":
        content, calls = parse_tool_calls(text, plan.tool_names)
        if not calls:
            return {"role": "assistant", "content": text}, finish
        return ({"role": "assistant", "content": content, "tool_calls": _api_calls(calls)},
                "tool_calls" if finish != "abort" else finish)
    if not plan.calls_tools:
        return {"role": "assistant", "content": text}, finish
    done = finish != "abort" and _complete_json(text)
    if plan.mode == "function":
        return ({"role": "assistant", "content": None,
                 "function_call": {"name": plan.function, "arguments": text}},
                "function_call" if done else finish)
    calls = tool_calls_of(plan, text)
    if calls is None:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": None, "tool_calls": calls}, ("tool_calls" if done else finish)


class _StreamedCalls:
    """The chunks of streamed forced calls. A named tool (or legacy function) streams its
    arguments as they come (the first chunk names the call); a ``required`` call, whose
    function is only known once its JSON is complete, is buffered and sent whole with the
    choice's last chunk (with its logprobs). Free text streams as ``content``."""

    def __init__(self, plan: ChatPlan, choices) -> None:
        self.plan = plan
        self.ids = {ch.index: new_call_id() for ch in choices}
        self.buffered: dict[int, list] = {ch.index: [] for ch in choices}
        # auto: each choice's parser and the number of calls it has sent
        self.parsers = {ch.index: HermesToolParser(plan.tool_names) for ch in choices} \
            if plan.mode == "auto" else {}
        self.sent: dict[int, int] = {ch.index: 0 for ch in choices}

    def chunks(self, ev, records: list, text_parts: list[str]) -> list[tuple[dict, list, str | None]]:
        """The chunks ``ev`` completes, as ``(delta, logprob records, finish_reason)`` (none
        while a call is buffered; an ``auto`` event may complete text and calls: one chunk each,
        the records with the first)."""
        if self.plan.mode != "auto":
            recs = self.records(ev, records)
            if recs is None:
                return []                # a buffered call: sent whole at its end
            delta, finish = self.delta(ev, text_parts)
            return [(delta, recs, finish)]
        parser = self.parsers[ev.index]
        self.buffered[ev.index].extend(records)
        items = parser.feed(ev.text) if ev.text else []
        if ev.finish_reason is not None:
            items += parser.finish()
        out: list[tuple[dict, list, str | None]] = []
        for it in items:
            if isinstance(it, str):
                out.append(({"content": it}, [], None))
            else:
                k = self.sent[ev.index]
                self.sent[ev.index] += 1
                out.append(({"tool_calls": [{"index": k, "id": new_call_id(), "type": "function",
                                             "function": {"name": it.name, "arguments": it.arguments}}]},
                            [], None))
        if ev.finish_reason is not None:
            finish = ev.finish_reason
            if parser.num_calls and finish != "abort":
                finish = "tool_calls"
            if out:
                out[-1] = (out[-1][0], [], finish)
            else:
                out.append(({}, [], finish))
        if out:
            out[0] = (out[0][0], self.buffered[ev.index], out[0][2])
            self.buffered[ev.index] = []
        return out

    def first_delta(self, index: int) -> dict:
        mode = self.plan.mode
        if mode == "tool":
            return {"role": "assistant", "content": None,
                    "tool_calls": [{"index": 0, "id": self.ids[index], "type": "function",
                                    "function": {"name": self.plan.function, "arguments": ""}}]}
        if mode == "function":
            return {"role": "assistant", "content": None,
                    "function_call": {"name": self.plan.function, "arguments": ""}}
        if mode == "tools":
            return {"role": "assistant", "content": None}
        return {"role": "assistant", "content": ""}

    def records(self, ev, records: list) -> list | None:
        """The logprob records to send with ``ev``'s chunk; ``None``: send no chunk yet."""
        if self.plan.mode != "tools":
            return records
        self.buffered[ev.index].extend(records)
        if ev.finish_reason is None:
            return None
        out, self.buffered[ev.index] = self.buffered[ev.index], []
        return out

    def delta(self, ev, text_parts: list[str]) -> tuple[dict, str | None]:
        """``ev``'s chunk ``delta`` and ``finish_reason``."""
        mode = self.plan.mode
        if mode in ("text", "json"):
            return ({"content": ev.text} if ev.text else {}), ev.finish_reason
        finish = ev.finish_reason
        if mode == "tools":
            message, finish = _chat_message(self.plan, "".join(text_parts), finish)
            if message.get("tool_calls"):
                return {"tool_calls": [{"index": i, **c} for i, c in enumerate(message["tool_calls"])]}, finish
            return {"content": message["content"]}, finish
        if finish is not None and finish != "abort" and _complete_json("".join(text_parts)):
            finish = "function_call" if mode == "function" else "tool_calls"
        if not ev.text:
            return {}, finish
        if mode == "function":
            return {"function_call": {"arguments": ev.text}}, finish
        return {"tool_calls": [{"index": 0, "function": {"arguments": ev.text}}]}, finish


def _tokenizer_info(tokenizer: Any, max_model_len: int) -> dict:
    """``GET /tokenizer_info`` as vLLM serves it: the tokenizer's class, special tokens, length
    limit, chat template and added tokens (what remote-tokenizer clients such as lm-eval's
    ``tokenizer_backend=remote`` read: ``eos_token``, ``bos_token``, ``pad_token``,
    ``chat_template``)."""
    from ..tokenizer import CHATML_TEMPLATE

    def tok_str(name: str) -> str | None:
        v = getattr(tokenizer, name, None)
        return v if isinstance(v, str) or v is None else str(v)

    added = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    for i, t in decoder.items():
        added[str(i)] = {"content": str(getattr(t, "content", t)), "special": bool(getattr(t, "special", False))}
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "bos_token": tok_str("bos_token"),
        "eos_token": tok_str("eos_token"),
        "pad_token": tok_str("pad_token"),
        "unk_token": tok_str("unk_token"),
        "model_max_length": max_model_len,
        "chat_template": getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE,
        "added_tokens_decoder": added,
    }


def render_chat(tokenizer: Any, messages: list[dict]) -> str:
    """The ChatML prompt (``<|im_start|>role\\ncontent<|im_end|>\\n`` ... then the assistant
    header), via :func:`llmserve.tokenizer.apply_chat_template` when it exists."""
    try:
        from ..tokenizer import apply_chat_template
    except ImportError:
        apply_chat_template = None
    if apply_chat_template is not None:
        out = apply_chat_template(tokenizer, messages)
        if isinstance(out, str):
            return out
        return decode_tokens(tokenizer, list(out), skip_special_tokens=False)
    parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    return "".join(parts) + "<|im_start|>assistant\n"


def _chat_renderer(tokenizer: Any, body: ChatCompletionRequest, plan: ChatPlan):
    """A callable rendering ``body``'s prompt text (run on the tokenizer thread). ``auto`` tool
    choice with a tokenizer whose chat template renders tools (a Qwen2.5 checkpoint's) uses that
    template with ``tools=``, so the model sees its trained layout; otherwise the messages as
    text (:func:`~llmserve.serve.structured.chat_messages`) through :func:`render_chat`.

    The callable raises APIError (400) when the tokenizer's template fails on the messages.
    """
    if plan.mode == "auto" and template_renders_tools(tokenizer):
        msgs = template_messages(body.messages)
        tools = [{"type": "function", "function": {k: v for k, v in f.items() if v is not None}}
                 for f in plan.functions]

        def render_with_tools() -> str:
            try:
                out = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template error is about these messages
                raise APIError(f"the model's chat template could not render these messages with tools "
                               f"({type(e).__name__}: {e})", param="messages") from None
            return out if isinstance(out, str) else decode_tokens(tokenizer, list(out), skip_special_tokens=False)

        return render_with_tools
    messages = chat_messages(body, plan)
    return lambda: render_chat(tokenizer, messages)
