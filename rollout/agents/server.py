"""The agent endpoint: OpenAI-compatible chat completions served by a rollout worker on its own engine, one base URL
per running episode, every call recorded for training.

It is an aiohttp server on the engine's event loop (loopback only; an episode's URL holds a random id, so another
local process cannot write into it), so a request goes to ``generate_async`` on the loop and shares continuous
batching with every other episode; only reading it (JSON, chat template, tokenisation: seconds for a long body) runs on
the endpoint's reader thread (one, shared by its requests: a long body delays other calls' reading, never generation).
Routes, under ``/episodes/<id>/v1`` (an episode's base URL):
``POST /chat/completions`` and ``GET /models``. A call renders the messages with the tokenizer's chat template (tools
described), samples ``n`` completions (default 1) with the recipe's sampling (seeded per call, like an environment's
turns) and records each as an :class:`~rollout.agents.trajectory.AgentCall`. The reply's text is the decoded generated
ids, so the recorded ids reproduce it exactly, except that it ends before a stop string that ended it (OpenAI's
contract; the ids keep every generated token). A call whose client goes away before the reply (its timeout, a
disconnect) is aborted and not recorded: no one received it. A ``stream``
request gets the same reply as server-sent chunks while it is generated (:mod:`rollout.agents.streaming`; asked-for
log-probs come whole with each choice's last chunk); an error after the stream began comes as an ``error`` event.

Limits of the episode (``environment.max_turns`` calls, ``max_total_tokens`` of growth after the first call's prompt,
the engine's context) are answered with status 400 (codes ``episode_limit``, ``context_length_exceeded``); a call in
flight when its episode ends (a timeout) with 409 ``episode_closed``; an engine that cannot serve with 503. Every error
has OpenAI's JSON form, aiohttp's own (404, 405, 413) and an unexpected one (500, logged) included.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollout.agents import protocol
from rollout.agents.streaming import ChoiceStream, IncrementalText
from rollout.agents.trajectory import AgentCall
from rollout.config import SamplingConfig
from rollout.envs.episode import EpisodeLimits
from rollout.tokenizer import PromptLike, PromptRenderer, token_bytes

if TYPE_CHECKING:
    from aiohttp import web
    from transformers import PreTrainedTokenizerBase

    from rollout.engine.vllm_engine import Completion, VLLMEngine

__all__ = ["CONTEXT_LENGTH_EXCEEDED", "EPISODE_LIMIT", "LIMIT_CODES", "AgentEndpoint", "EpisodeCalls"]

log = logging.getLogger(__name__)

EPISODE_LIMIT = "episode_limit"
"""The error code of a call past the episode's ``max_turns``."""
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""The error code of a call with no room left to generate (the engine's context, ``max_total_tokens``)."""
LIMIT_CODES = (EPISODE_LIMIT, CONTEXT_LENGTH_EXCEEDED)

_MAX_BODY_BYTES = 16 << 20
_RENDER_BOUND = 4
"""A request whose text (contents, tool calls, tools) is over this many times what the context holds at the longest
token is refused unrendered."""


@dataclass
class EpisodeCalls:
    """One running episode's registration: how its calls are sampled and bounded, and what they recorded."""

    episode_id: str
    base_url: str
    sampling: SamplingConfig
    limits: EpisodeLimits
    seed_of_call: Callable[[int, int], int | None]
    """``(call index, n) ->`` the seed of that call's ``n`` completions (they take ``seed .. seed + n - 1``)."""
    calls: list[AgentCall] = field(default_factory=list)
    """Recorded completions, in completion order (``AgentCall.index`` gives a call's arrival order, ``choice`` which
    of its completions)."""
    num_accepted: int = 0
    first_prompt_len: int | None = None
    num_limit_refusals: int = 0
    """Calls refused by an episode limit (``episode_limit``, ``context_length_exceeded``)."""
    num_ignored_sampling: int = 0
    """Calls that sent sampling parameters the recipe's override."""
    num_unknown_params: int = 0
    """Calls that sent a parameter the endpoint does not know (ignored)."""
    closed: bool = False
    in_flight: set[asyncio.Future[Any]] = field(default_factory=set)
    engine_error: BaseException | None = None
    """Why the engine could not serve a call of this episode (answered 503): the runner raises it, so the pool
    replaces the worker as it does for any other episode, instead of failing the run on the agent's error."""


class AgentEndpoint:
    """The agent endpoint of one engine; see the module docstring. Episodes are opened and closed on the engine loop
    (:meth:`open`, :meth:`close` are coroutines for it); :meth:`shutdown` from any other thread."""

    def __init__(
        self, engine: VLLMEngine, tokenizer: PreTrainedTokenizerBase, model_name: str, host: str = "127.0.0.1"
    ) -> None:
        self.engine, self.tokenizer, self.model_name, self.host = engine, tokenizer, model_name, host
        # A request's JSON, chat template and tokenisation run on a thread of their own, so a long conversation (or a
        # 16 MB body) takes its time there instead of stopping the engine loop's generation for every episode; with a
        # tokenizer of its own, since a tokenizer is not safe to use from two threads at once.
        self._prompts = PromptRenderer(copy.deepcopy(tokenizer), use_chat_template=True)
        # No token covers more characters than its own string has: a request whose contents need more tokens than the
        # context holds at this rate is refused unrendered (megabytes of a tool's output took seconds on the one
        # reader thread, every other episode's calls waiting behind it).
        self._longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="agent-requests")
        self._episodes: dict[str, EpisodeCalls] = {}
        self._warned_unknown: set[str] = set()
        self._runner, self.port = engine.run(self._start())

    @property
    def address(self) -> str:
        """``http://host:port`` of the server."""
        return f"http://{self.host}:{self.port}"

    async def _start(self) -> tuple[web.AppRunner, int]:
        from aiohttp import web

        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[web.middleware(_openai_errors)])
        app.router.add_post("/episodes/{episode}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{episode}/v1/models", self._models)
        app.router.add_get("/episodes/{episode}/v1/models/{model}", self._models)
        # A client that goes away (its timeout, a disconnect) cancels its handler: the call is aborted, not recorded.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        server = site._server  # aiohttp keeps the bound sockets there; port 0 is resolved only after binding
        assert server is not None
        return runner, int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    async def open(
        self, sampling: SamplingConfig, limits: EpisodeLimits, seed_of_call: Callable[[int, int], int | None]
    ) -> EpisodeCalls:
        """Register an episode (on the engine loop) and return it, with its ``base_url``."""
        episode_id = secrets.token_urlsafe(12)
        episode = EpisodeCalls(episode_id, f"{self.address}/episodes/{episode_id}/v1", sampling, limits, seed_of_call)
        self._episodes[episode_id] = episode
        return episode

    async def close(self, episode: EpisodeCalls) -> None:
        """End an episode (on the engine loop): its URL stops answering and calls in flight are aborted."""
        episode.closed = True
        self._episodes.pop(episode.episode_id, None)
        for task in list(episode.in_flight):
            task.cancel()

    async def render(self, prompt: PromptLike) -> list[int]:
        """``prompt`` (text or messages) as the endpoint renders a call's messages (on its reader thread; awaited on
        any loop)."""
        return await asyncio.get_running_loop().run_in_executor(self._reader, self._prompts, prompt)

    def shutdown(self) -> None:
        """Stop the server (from any thread but the engine's)."""
        self.engine.run(self._runner.cleanup())
        self._reader.shutdown(cancel_futures=True)

    # -- routes ----------------------------------------------------------------------------------------------------
    async def _models(self, request: web.Request) -> web.Response:
        from aiohttp import web

        if request.match_info["episode"] not in self._episodes:
            return _not_found()
        asked = request.match_info.get("model")  # a retrieve: any name is served (chat calls may name any model)
        model = {"id": asked or self.model_name, "object": "model", "created": 0, "owned_by": "rl-align"}
        return web.json_response(model if asked is not None else {"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        episode = self._episodes.get(request.match_info["episode"])
        if episode is None:
            return _not_found()
        raw = await request.read()
        try:
            chat, prompt, prompt_len = await asyncio.get_running_loop().run_in_executor(self._reader, self._read, raw)
            if episode.closed:  # it ended while the request was read: nothing may start for it now
                raise protocol.ProtocolError("the episode ended while this call was read", code="episode_closed",
                                             status=409)  # fmt: skip
            sampling = self._call_sampling(episode, chat, prompt_len, exact=prompt is not None)
        except protocol.ProtocolError as e:
            return _error(e.status, str(e), e.param, e.code)
        assert prompt is not None, "a prompt left unrendered is past the context, refused above"
        index = episode.num_accepted
        episode.num_accepted += 1
        episode.num_ignored_sampling += bool(chat.ignored_sampling_params)
        episode.num_unknown_params += bool(chat.unknown_params)
        for name in set(chat.unknown_params) - self._warned_unknown:
            self._warned_unknown.add(name)
            log.warning("agent endpoint: request parameter %r is not one it knows; ignored (counted in "
                        "agent/unknown_params)", name)  # fmt: skip
        progress = _Progress() if chat.stream else None
        generation = asyncio.ensure_future(self.engine.generate_async(
            prompt, sampling, chat.n, episode.seed_of_call(index, chat.n),
            on_tokens=None if progress is None else progress.on_tokens,
        ))  # fmt: skip
        episode.in_flight.add(generation)
        try:
            if progress is not None:
                return await self._stream(request, episode, chat, prompt, index, generation, progress, sampling)
            outcome = await self._outcome(episode, generation)
        except asyncio.CancelledError:  # the client went away: its reply would reach no one, so nothing is trained on
            generation.cancel()
            raise
        finally:
            episode.in_flight.discard(generation)
        if isinstance(outcome, protocol.ProtocolError):
            return _error(outcome.status, str(outcome), code=outcome.code)
        choices = self._record(episode, chat, prompt, index, outcome, sampling.min_tokens)
        return web.json_response(protocol.chat_completion(
            _completion_id(), self.model_name, choices, len(prompt),
            sum(len(c.token_ids) for c in outcome), min(c.policy_version for c in outcome),
        ))  # fmt: skip

    async def _stream(
        self, request: web.Request, episode: EpisodeCalls, chat: protocol.ChatRequest, prompt: list[int], index: int,
        generation: asyncio.Future[list[Completion]], progress: _Progress, sampling: SamplingConfig,
    ) -> web.StreamResponse:  # fmt: skip
        """Send the reply as server-sent chunks while it is generated (:mod:`rollout.agents.streaming`); a client
        that goes away aborts the call like an unstreamed one (nothing is recorded)."""
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        request[_STREAMING] = True  # from here on an error cannot be a response of its own (the middleware knows)
        send = _EventSender(response)
        completion_id, created = _completion_id(), int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return protocol.chat_chunk(completion_id, self.model_name, created, choices, **extra)

        streams = [ChoiceStream(chat.parse_tool_calls, sampling.stop) for _ in range(chat.n)]
        texts = [IncrementalText(self._decode) for _ in range(chat.n)]
        try:
            await send(chunk([{"index": j, "delta": {"role": "assistant", "content": ""}} for j in range(chat.n)]))
            while not generation.done():
                grew = asyncio.ensure_future(progress.grew.wait())
                either: set[asyncio.Future[Any]] = {grew, generation}
                try:
                    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    grew.cancel()
                deltas = []
                for j, ids in progress.take().items():
                    if content := streams[j].update(texts[j].update(ids)):
                        deltas.append({"index": j, "delta": {"content": content}})
                if deltas:
                    await send(chunk(deltas))
            outcome = await self._outcome(episode, generation)
            if isinstance(outcome, protocol.ProtocolError):
                await send(protocol.error_body(str(outcome), code=outcome.code))
            else:
                choices = self._record(episode, chat, prompt, index, outcome, sampling.min_tokens)
                await send(chunk(
                    [{"index": j, "delta": streams[j].finish(m), "finish_reason": f, "logprobs": lp}
                     for j, (m, f, lp) in enumerate(choices)],
                    policy_version=min(c.policy_version for c in outcome),
                ))  # fmt: skip
                if chat.include_usage:
                    await send(chunk([], usage=(len(prompt), sum(len(c.token_ids) for c in outcome))))
        except Exception:  # the reply began: an error now goes as an event (a second response would corrupt it)
            log.exception("agent endpoint: a streamed call failed")
            await send(protocol.error_body("internal error of the agent endpoint (the rollout worker's log has it)",
                                           code="internal_error"))  # fmt: skip
        await send.done()
        return response

    async def _outcome(
        self, episode: EpisodeCalls, generation: asyncio.Future[list[Completion]]
    ) -> list[Completion] | protocol.ProtocolError:
        """The call's completions, or the error that answers it (an ended episode, an engine that cannot serve)."""
        from rollout.engine.errors import EngineBrokenError

        try:
            completions = await generation
        except asyncio.CancelledError:
            handler = asyncio.current_task()
            if not generation.cancelled() or (handler is not None and handler.cancelling()):
                raise  # this handler itself is being cancelled (its client went away, server shutdown)
            return protocol.ProtocolError("the episode ended (its agent returned, failed or ran out of time) while "
                                          "this call was in flight",
                                          code="episode_closed", status=409)  # fmt: skip
        except (EngineBrokenError, RuntimeError) as e:
            if isinstance(e, EngineBrokenError):
                episode.engine_error = episode.engine_error or e
            return protocol.ProtocolError(f"the rollout engine cannot serve: {e}", code="engine_unavailable",
                                          status=503)  # fmt: skip
        except Exception as e:  # a request the checks let through that the engine cannot take: this endpoint's bug
            log.exception("agent endpoint: a call failed in the engine")
            return protocol.ProtocolError(f"internal error: {type(e).__name__}: {str(e)[:200]}", code="internal_error",
                                          status=500)  # fmt: skip
        if episode.closed:
            return protocol.ProtocolError("the episode ended while this call was in flight", code="episode_closed",
                                          status=409)  # fmt: skip
        return completions

    def _record(
        self, episode: EpisodeCalls, chat: protocol.ChatRequest, prompt: list[int], index: int,
        completions: list[Completion], min_tokens: int,
    ) -> list[tuple[dict[str, Any], str, dict[str, Any] | None]]:  # fmt: skip
        """Record the call's completions for training; their reply messages, finish reasons and log-probs (when
        asked for). A reply's text ends before the stop string that ended it (the recorded call keeps every generated
        token, and the whole text for rewards, as an environment's turn does: the next call's prompt, built from the
        reply, then starts a new sample); ``min_tokens``: the call's, within which no stop string ends a reply."""
        choices = []
        call_ids = f"call_{secrets.token_hex(6)}"  # not the episode's id: that is its URL's secret, and ids get logged
        for j, completion in enumerate(completions):
            ids = completion.token_ids.tolist()
            text = self._decode(ids)
            episode.calls.append(AgentCall(index, prompt, completion.token_ids, completion.logprobs,
                                           completion.policy_version, completion.finish_reason, text, j))  # fmt: skip
            if completion.stop_string:
                checked_from = len(self._decode(ids[:min_tokens])) if min_tokens else 0
                text = protocol.cut_at_ending_stop(text, completion.stop_string, checked_from)
            call_id = call_ids + (f"_{j}" if chat.n > 1 else "")
            message, calls_tools = protocol.assistant_reply(text, chat.parse_tool_calls, call_id)
            finish = "length" if completion.finish_reason == "length" else ("tool_calls" if calls_tools else "stop")
            logprobs = None
            if chat.logprobs:
                tokens = token_bytes(self.tokenizer, completion.token_ids.tolist())
                logprobs = protocol.token_logprobs(tokens, completion.logprobs.tolist())
            choices.append((message, finish, logprobs))
        return choices

    def _decode(self, ids: Sequence[int]) -> str:
        """A reply's text from generated ids: special tokens dropped."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def _read(self, raw: bytes) -> tuple[protocol.ChatRequest, list[int] | None, int]:
        """A request body as a checked request, its prompt ids and their count (on the reader thread); ``ProtocolError``
        (400) for anything wrong with it. Contents too long for the context at any tokenisation are not rendered: no
        ids, and the fewest tokens they could be."""
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise protocol.ProtocolError(f"the request body is not JSON: {e}") from e
        except (ValueError, RecursionError) as e:  # valid JSON Python cannot read: a 5,000-digit number, deep nesting
            raise protocol.ProtocolError(f"the request body cannot be read: {str(e)[:200] or type(e).__name__}") from e
        chat = protocol.parse_chat_request(body)
        vocab = len(self._prompts.tokenizer)
        if any(t >= vocab for t in chat.stop_token_ids):  # vLLM does not check them: one past the vocabulary broke it
            raise protocol.ProtocolError(f"stop_token_ids: the vocabulary has {vocab} tokens (ids 0 to {vocab - 1})",
                                         param="stop_token_ids")  # fmt: skip
        contents = sum(len(m["content"] or "") for m in chat.messages)
        fewest = -(-contents // self._longest_token)
        if fewest > self.engine.config.max_model_len:
            return chat, None, fewest
        # Tool calls' arguments and tool descriptions count towards no bound (a template may leave them out), but
        # rendering megabytes of them holds the one reader thread, every episode's calls behind it.
        other = len(json.dumps([m.get("tool_calls") for m in chat.messages], default=str)) + len(
            json.dumps(chat.tools, default=str))  # fmt: skip
        most = _RENDER_BOUND * self.engine.config.max_model_len * self._longest_token
        if contents + other > most:
            raise protocol.ProtocolError(
                f"the request holds {contents + other} characters of messages, tool calls and tools: over "
                f"{_RENDER_BOUND}x what a context of {self.engine.config.max_model_len} tokens (at most "
                f"{self._longest_token} characters each) holds; it was not rendered", param="messages")  # fmt: skip
        try:
            prompt = self._prompts(chat.messages, chat.tools)
            return chat, prompt, len(prompt)
        except Exception as e:  # the template is the model's (jinja): any of its errors is the request's fault here
            why = f"the chat template cannot render these messages: {e}"
            raise protocol.ProtocolError(why, param="messages") from e

    def _call_sampling(
        self, episode: EpisodeCalls, chat: protocol.ChatRequest, prompt_len: int, exact: bool = True
    ) -> SamplingConfig:
        """The call's sampling within the episode's limits, for a prompt of ``prompt_len`` tokens (``exact`` False: at
        least that many); ``ProtocolError`` when a limit refuses it (counted in the episode's limit refusals)."""
        limits, max_model_len = episode.limits, self.engine.config.max_model_len
        if episode.num_accepted >= limits.max_turns:
            episode.num_limit_refusals += 1
            raise protocol.ProtocolError(
                f"episode limit: at most {limits.max_turns} chat completions per episode (environment.max_turns)",
                code=EPISODE_LIMIT,
            )
        room = max_model_len - prompt_len
        if limits.max_total_tokens is not None:
            first = prompt_len if episode.first_prompt_len is None else episode.first_prompt_len
            room = min(room, limits.max_total_tokens - (prompt_len - first))
        if room <= 0:
            episode.num_limit_refusals += 1
            raise protocol.ProtocolError(
                f"the prompt has {'' if exact else 'at least '}{prompt_len} tokens: no room left to generate "
                f"(rollout.engine.max_model_len = "
                f"{max_model_len}, environment.max_total_tokens = {limits.max_total_tokens})",
                param="messages", code=CONTEXT_LENGTH_EXCEEDED,
            )  # fmt: skip
        if episode.first_prompt_len is None:
            episode.first_prompt_len = prompt_len
        base = episode.sampling
        max_tokens = min(base.max_tokens, room, chat.max_tokens or base.max_tokens)
        return base.model_copy(update={
            "max_tokens": max_tokens, "min_tokens": min(base.min_tokens, max_tokens), "stop": [*base.stop, *chat.stop],
            "stop_token_ids": [*base.stop_token_ids, *chat.stop_token_ids],
        })  # fmt: skip


class _Progress:
    """A streamed call's choices that grew since the sender last looked (filled on the engine loop)."""

    def __init__(self) -> None:
        self.grew = asyncio.Event()
        self._ids: dict[int, list[int]] = {}

    def on_tokens(self, choice: int, token_ids: Sequence[int]) -> None:
        self._ids[choice] = list(token_ids)
        self.grew.set()

    def take(self) -> dict[int, list[int]]:
        """The latest ids of each choice that grew, forgotten here."""
        ids, self._ids = self._ids, {}
        self.grew.clear()
        return ids


class _EventSender:
    """Writes server-sent events; once the client is gone, writes nothing more (its handler is then cancelled, and
    the call with it)."""

    def __init__(self, response: web.StreamResponse) -> None:
        self._response, self._gone = response, False

    async def __call__(self, event: dict[str, Any]) -> None:
        await self._write(f"data: {json.dumps(event)}\n\n".encode())

    async def done(self) -> None:
        await self._write(b"data: [DONE]\n\n")
        if not self._gone:
            await self._response.write_eof()

    async def _write(self, data: bytes) -> None:
        if self._gone:
            return
        try:
            await self._response.write(data)
        except ConnectionError:
            self._gone = True


def _completion_id() -> str:
    """A reply's id: random, not the episode's id (its URL's secret; reply ids get logged)."""
    return f"chatcmpl-{secrets.token_hex(12)}"


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_STREAMING = "rl_align.streaming"
"""Set on a request whose streamed reply has begun."""


async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error in OpenAI's JSON form, aiohttp's own too (a route or method not served, a body over
    ``_MAX_BODY_BYTES``), and an unexpected one as a 500 with that form instead of aiohttp's plain-text page."""
    from aiohttp import web

    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        message = e.text or e.reason
        if e.status in (404, 405):
            message = (f"{request.method} {request.path} is not served: an episode's base URL serves POST "
                       "<base_url>/chat/completions and GET <base_url>/models")  # fmt: skip
        return _error(e.status, message, code=_HTTP_CODES.get(e.status, "invalid_request"))
    except Exception:
        if request.get(_STREAMING):
            raise  # the reply began: aiohttp closes the connection (the stream sends its own error event first)
        log.exception("agent endpoint: %s %s failed", request.method, request.path)
        return _error(500, "internal error of the agent endpoint (the rollout worker's log has it)",
                      code="internal_error")  # fmt: skip


def _error(status: int, message: str, param: str | None = None, code: str = "invalid_request") -> web.Response:
    from aiohttp import web

    return web.json_response(protocol.error_body(message, param, code), status=status)


def _not_found() -> web.Response:
    return _error(404, "no episode at this base URL: each base URL serves one episode while it runs",
                  code="episode_not_found")  # fmt: skip
