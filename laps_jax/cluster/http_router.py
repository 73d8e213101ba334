"""The network router: serve.py's OpenAI API in front of several serve.py instances.

    app = create_router_app(HTTPRouter(["http://127.0.0.1:8001", "http://127.0.0.1:8002"],
                                       RouterConfig(policy="laps")))

`POST /v1/completions` and `POST /v1/chat/completions` (streams passed through as they come),
`GET /v1/models` (an instance's answer), `GET /health` (200 while some instance is in the
rotation), `GET /metrics` (the router's own), `GET /router/status` (JSON: each instance's URL,
group, health and load).

Routing: `policy.RoutingPolicy` (the same object the simulator's router uses: moves,
hysteresis, dwell and draining show in /router/status) over the healthy instances that are not
full, fed with each instance's load (pending prefill tokens, and of them short ones:
instances.py, upstream.py), its requests in flight, whether the router's requests decode
there (laps, off unless `decode_step_tokens`: a laps instance runs a decode step before each
prefill step while any sequence decodes; None counts a decode step as a prefill of the
threshold's tokens, both memory-bound steps; `decode_seq_tokens` adds more per sequence
decoding there; other clients' decoding is not seen; neither showed a gain live,
docs/BENCHMARKS.md), how fast each has lately turned work into first
tokens (laps, when `pace_weight`, router.py's default 0.3: cluster/pace.py), and the prefix
of the prompt its cache is expected to hold (`upstream.BlockIndex`). The short/long
threshold is `--threshold` or else the one the instances report from their latency profiles
(`laps_short_threshold_tokens`), and the long chunk a short request may wait out on an
instance is the one it reports (`laps_long_chunk_tokens`; FALLBACK_CHUNK until it does).
Affinity needs the prompt's token ids: a completion whose prompt is token ids has them; text
prompts and chat messages are tokenized (and templated) with `tokenizer`, the instances' own
(`--tokenizer DIR`), exactly as serve.py does. Without a tokenizer the router estimates a
text's tokens from its length (`CHARS_PER_TOKEN`) and keeps affinity by the text itself: the
chained hashes of its 64-byte blocks (`text_key`: a chat's messages as JSON, so earlier turns
are a prefix of the next) in an LRU index per instance, a matched block counted as 16 tokens.

The router validates only what it must read (the body is a JSON object); anything else about a
request is for the instance to judge, and its 4xx answer is passed through as it is, so errors
read the same as serve.py's. Errors of the router itself are JSON by serve.py's own middleware
and HTTP runner (auth, size limit, parser errors). By default it never queues: a request no
instance can take (all unhealthy, or each at `max_inflight` requests from this router) gets 503
with Retry-After. With `hold_tokens` (late binding of long requests, cluster/hold.py;
router.py's default with laps-inflow) a long request waits in the router while every available
instance has that much prefill ahead of it (short work and smaller long work; None: each
instance's own long chunk), at most `max_inflight` x instances of them (then 503 with
Retry-After), and then goes to the policy's pick among the instances below the hold (one that
found room on arrival, to the policy's pick among all). A request whose instance fails goes on
at another (failover.py): sent again if nothing reached the client yet, a stream resumed from
the tokens the client has.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import json
import time

import aiohttp
from aiohttp import web

from laps_jax.cluster.failover import route
from laps_jax.cluster.hold import (AGING_TOKENS_PER_S as HOLD_AGING_TOKENS_PER_S, HoldQueue,
                                   held_counts, holds)
from laps_jax.cluster.instances import TEXT_BLOCK_BYTES, Instance, log, poll_forever
from laps_jax.cluster.pace import FORGET_S, Pace, relative_speeds
from laps_jax.cluster.policy import LAPS, Choice, RouterConfig, RoutingPolicy
from laps_jax.cluster.router_metrics import RouterMetrics
from laps_jax.cluster.upstream import cached_prefixes, matched_blocks, prompt_hashes, text_hashes
from laps_jax.server import loop_lag
from laps_jax.server.app import errors_and_auth
from laps_jax.server.protocol import APIError, parse_messages, parse_prompt
from laps_jax.server.state import GUARDED, STATE, ServerState, decode_json, read_body

CHARS_PER_TOKEN = 4      # text length per token when the router has no tokenizer
MAX_TEXT_BLOCKS = 8192   # text blocks hashed per prompt (512 KiB: a longer prefix adds little)
ANY_VOCAB = 1 << 31      # token ids are range-checked by the instance, not here
DEFAULT_MAX_MODEL_LEN = 1 << 20  # until an instance says (/v1/models)
PARSE_THREADS = 2
INLINE_PARSE_BYTES = 32768  # bodies up to this size are parsed on the event loop (JSON and
# block hashes: 0.8 ms for 2,000 token ids in 13 KB)
INLINE_TOKENIZE_BYTES = 8192  # ... when the router tokenizes them
FALLBACK_THRESHOLD = 256  # until an instance reports its own
FALLBACK_CHUNK = 512.0  # tokens of an instance's long step until it reports its own
GROUPED = ("length-aware", *LAPS)  # policies with short and long groups


class Estimate:
    """What routing needs of a request: its prompt's token ids (None: unknown) and length, and
    without them the hashes of its text's blocks (`text_key`)."""

    def __init__(self, ids: list[int] | None, tokens: int, stream: bool,
                 text: list[bytes] | None = None):
        self.ids, self.tokens, self.stream, self.text = ids, tokens, stream, text
        self._hashes: dict[int, list[bytes]] = {}

    def block_hashes(self, block_size: int) -> list[bytes]:
        """The chained hashes of the prompt's full blocks, computed once per block size: a
        long request is looked up when held, again when placed, and then remembered."""
        if block_size not in self._hashes:
            self._hashes[block_size] = prompt_hashes(self.ids or [], block_size)
        return self._hashes[block_size]


def text_key(kind: str, prompt) -> str | None:
    """The text the router indexes for a prompt it does not tokenize: a completion's prompt
    string; a chat's messages, each as JSON of [role, content] (so a conversation's earlier
    turns are a prefix of its next turn's key, as the chat template renders them a prefix of
    its text); None for anything the instance will refuse."""
    if kind == "completion":
        return prompt if isinstance(prompt, str) else None
    if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in prompt):
        return None
    return "".join(json.dumps([m.get("role"), m.get("content")], ensure_ascii=False)
                   for m in prompt)


def _by_text(kind: str, prompt, stream: bool) -> Estimate:
    key = text_key(kind, prompt)
    if key is None:
        return Estimate(None, 0, stream)
    n = (len(prompt) if kind == "completion" else
         sum(len(m.get("content") or "") for m in prompt if isinstance(m.get("content"), str)))
    return Estimate(None, n // CHARS_PER_TOKEN + 1, stream,
                    text_hashes(key, TEXT_BLOCK_BYTES, MAX_TEXT_BLOCKS))


def estimate(raw: bytes, kind: str, tokenizer, max_model_len: int) -> Estimate:
    """Reads the body (400 unless a JSON object) and the prompt's tokens, on a worker thread.
    A prompt the parser refuses is not answered here: the instance answers it."""
    body = decode_json(raw)
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    stream = body.get("stream") is True
    if "laps_resume" in body:  # the router's own, when it resumes a stream (failover.py)
        raise APIError("'laps_resume' is set by the router, not by clients", param="laps_resume")
    try:
        if kind == "completion":
            p = body.get("prompt")
            if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
                p = p[0]
            if isinstance(p, str) and tokenizer is None:
                return _by_text(kind, p, stream)
            ids = parse_prompt(body, ANY_VOCAB, tokenizer, max_model_len)
        else:
            if tokenizer is None:
                return _by_text(kind, body.get("messages"), stream)
            ids = parse_messages(body, tokenizer, max_model_len)
    except APIError:
        return Estimate(None, 0, stream)
    return Estimate(list(ids), len(ids), stream)


class HTTPRouter:
    split = None  # cluster/pd_router.py's PDSplit: requests go prefill -> decode

    def __init__(self, urls: list[str], config: RouterConfig | None = None, *,
                 tokenizer=None, threshold: int | None = None, spill_tokens: float = 2048.0,
                 max_inflight: int = 256,
                 instance_api_key: str | None = None, decode_step_tokens: float | None = 0.0,
                 decode_seq_tokens: float = 0.0, long_chunk_tokens: float | None = None,
                 pace_weight: float = 0.0, pace_forget_s: float = FORGET_S,
                 hold_tokens: float | None = 0.0):
        if not urls:
            raise ValueError("a router needs at least one instance")
        config = config or RouterConfig()
        self.fixed_threshold = threshold if config.threshold is None else config.threshold
        # loads are tokens here: the threshold (None: the instances', below) and margins too
        self.config = dataclasses.replace(
            config, spill_s=spill_tokens if config.spill_s is None else config.spill_s)
        self.pace_weight = pace_weight  # laps: weigh each instance's measured pace (0: not)
        self.pace_forget_s = pace_forget_s  # how fast an unrefreshed pace fades (pace.py)
        self.instances = [self._instance(k, u) for k, u in enumerate(urls)]
        self.policy = RoutingPolicy(len(urls), self.config,
                                    lambda new, cached: new <= self.threshold,
                                    self.config.spill_s, FALLBACK_CHUNK)
        self.tokenizer, self.max_inflight = tokenizer, max_inflight
        self.decode_step_tokens = decode_step_tokens  # None: the threshold; 0: not counted
        self.decode_seq_tokens = decode_seq_tokens  # more per decoding sequence (0: not)
        self.fixed_chunk = long_chunk_tokens  # given: every instance's, whatever they report
        # late binding of long requests (cluster/hold.py): one waits in the
        # router while every instance has `hold_tokens` of prefill ahead of it (None: each
        # instance's long chunk, `long_chunk`; 0: never, they go on arrival)
        self.hold_tokens = hold_tokens
        self.hold = (HoldQueue(self.can_send, HOLD_AGING_TOKENS_PER_S,
                               max_inflight * len(urls)) if hold_tokens != 0 else None)
        self.upstream_headers = ({"Authorization": f"Bearer {instance_api_key}"}
                                 if instance_api_key else {})
        self.session: aiohttp.ClientSession | None = None
        self._pollers: list[asyncio.Task] = []

    @property
    def max_model_len(self) -> int:
        lens = [i.max_model_len for i in self.instances if i.max_model_len]
        return min(lens) if lens else DEFAULT_MAX_MODEL_LEN

    async def start(self) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0))
        self._pollers = [asyncio.create_task(poll_forever(i, self.session, self.upstream_headers))
                         for i in self.instances]

    async def stop(self) -> None:
        for t in self._pollers:
            t.cancel()
        await asyncio.gather(*self._pollers, return_exceptions=True)
        for i in self.instances:
            i.fail_inflight()
        if self.session is not None:
            await self.session.close()

    def _instance(self, k: int, url: str) -> Instance:
        """Instance `k` at `url`, with its own pace when the router measures paces."""
        return Instance(url.rstrip("/"), slot=k,
                        pace=Pace(self.pace_weight) if self.pace_weight else None)

    def replace_instance(self, k: int, url: str) -> None:
        """Instance `k` answers at `url` from now on (a restarted instance at a new address:
        `ray_cluster.Follower`). The old address leaves as a dead instance does (its requests
        in flight go on elsewhere, what was known of its cache is dropped); slot `k` keeps its
        place in the policy (its group); the new address joins when its polls say healthy."""
        self.instances[k].mark_down(f"replaced by {url}")
        self.instances[k] = self._instance(k, url)
        if self._pollers:  # started: poll the new address instead of the old
            self._pollers[k].cancel()
            self._pollers[k] = asyncio.create_task(
                poll_forever(self.instances[k], self.session, self.upstream_headers))

    @property
    def threshold(self) -> int:
        """`--threshold` if given, else the smallest short/long cut the healthy instances report
        (`laps_short_threshold_tokens`, from their latency profiles), else FALLBACK_THRESHOLD."""
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        reported = [i.report.threshold for i in self.instances
                    if i.healthy and i.report is not None and i.report.threshold is not None]
        return min(reported) if reported else FALLBACK_THRESHOLD

    def long_chunk(self, inst: Instance) -> float:
        """`long_chunk_tokens` if given, else the long chunk `inst` reports
        (`laps_long_chunk_tokens`), else FALLBACK_CHUNK (as `threshold`)."""
        if self.fixed_chunk is not None:
            return float(self.fixed_chunk)
        r = inst.report
        return float(r.long_chunk) if r is not None and r.long_chunk else FALLBACK_CHUNK

    def group(self, k: int) -> str | None:
        return self.policy.group[k] if self.config.policy in GROUPED else None

    def available(self, k: int) -> bool:
        i = self.instances[k]
        return i.healthy and len(i.inflight) < self.max_inflight

    def hold_at(self, inst: Instance) -> float:
        """The hold at `inst`: `hold_tokens`, or with None its long chunk (`long_chunk`)."""
        return self.long_chunk(inst) if self.hold_tokens is None else self.hold_tokens

    def hold_size(self) -> float:
        """The hold a request must be larger than to be held: `hold_tokens`, or with None the
        smallest long chunk of the healthy instances (`long_chunk`: FALLBACK_CHUNK while none
        reports one)."""
        if self.hold_tokens is not None:
            return self.hold_tokens
        if self.fixed_chunk is not None:
            return float(self.fixed_chunk)
        return min((self.long_chunk(i) for i in self.instances if i.healthy),
                   default=FALLBACK_CHUNK)

    def _over_hold(self, tokens: int) -> tuple[set[int], set[int]]:
        """The available instances, and of them those with their hold or more of work ahead
        of a long request of `tokens` new tokens."""
        ks = {k for k in range(len(self.instances)) if self.available(k)}
        return ks, {k for k in ks
                    if self.instances[k].load.ahead(tokens) >= self.hold_at(self.instances[k])}

    def can_send(self, tokens: int) -> bool:
        """With a hold: some available instance has less than it ahead of the request, or
        none is available (the request is then answered with 503 at once, not held)."""
        ks, full = self._over_hold(tokens)
        return not ks or full != ks

    def held_back(self, tokens: int | None) -> set[int]:
        """For a held request: the available instances with the hold or more ahead of it,
        unless that is all of them (none for a request not held)."""
        if tokens is None:
            return set()
        ks, full = self._over_hold(tokens)
        return set() if full == ks else full

    def pick(self, est: Estimate, exclude: set[int]) -> tuple[int, int, bool]:
        """(instance, new tokens there, short) for a request, or a 503 when none can take it."""
        return self.placed(est, self.choose(est, exclude))

    @staticmethod
    def placed(est: Estimate, c: Choice) -> tuple[int, int, bool]:
        """(instance, new tokens there, short) of a choice."""
        return c.instance, max(est.tokens - c.cached_tokens, 0), c.short

    def choose(self, est: Estimate, exclude: set[int]) -> Choice:
        """The policy's choice for a request (`pick`'s, with what `policy.withdraw` needs when
        the request fails there), or a 503 when no instance can take it."""
        eligible = [self.available(k) and k not in exclude for k in range(len(self.instances))]
        if not any(eligible):
            up = sum(i.healthy for i in self.instances)
            why = (f"all {len(self.instances)} instances are unavailable" if not up else
                   f"every available instance has {self.max_inflight} requests in flight")
            raise APIError(f"no instance can take the request now ({why}); retry shortly", 503,
                           "unavailable", headers={"Retry-After": "1"})
        cached = self.cached(est)
        loads = [i.load.load for i in self.instances]
        # a decode step, in tokens (None: a memory-bound step, a prefill of the threshold's
        # tokens, where prefill turns compute-bound; 0, the default: not counted), plus
        # `decode_seq_tokens` per sequence decoding there (0, the default: not counted)
        step = (float(self.threshold) if self.decode_step_tokens is None
                else self.decode_step_tokens)
        per_seq = self.decode_seq_tokens
        decode = ([(step if i.decoding else 0.0) + per_seq * i.decoding
                   for i in self.instances] if step or per_seq else None)
        return self.policy.choose(max(est.tokens, 1), cached, loads, time.monotonic(),
                                  eligible,
                                  short_loads=[i.load.short_load for i in self.instances],
                                  inflight=[len(i.inflight) for i in self.instances],
                                  decode_step=decode,
                                  chunk=[self.long_chunk(i) for i in self.instances],
                                  speed=self.speeds() if self.pace_weight else None,
                                  unit_s=self.seconds_per_token())

    def cached(self, est: Estimate) -> list[int]:
        """The prompt tokens each instance's cache is expected to hold (as far as known)."""
        if est.ids:
            return cached_prefixes(est.ids, [i.blocks for i in self.instances],
                                   est.block_hashes)
        if est.text:  # the text's blocks as tokens, leaving one to compute as the engine does
            return [min(matched_blocks(est.text, i.texts) * TEXT_BLOCK_BYTES // CHARS_PER_TOKEN,
                        est.tokens - 1) for i in self.instances]
        return [0] * len(self.instances)

    def held_tokens(self, est: Estimate) -> int | None:
        """With a hold: the new tokens a request is held by (its fewest anywhere), or None
        when it goes at once (no hold, or no larger than the threshold or the hold:
        cluster/hold.py)."""
        if self.hold is None:
            return None
        threshold, size = self.threshold, self.hold_size()
        if est.tokens <= max(threshold, size):  # short or within the hold even if nothing cached
            return None
        best = max(self.cached(est), default=0)
        new = max(est.tokens - best, 0)
        return new if holds(new, best, new <= threshold, new <= size) else None

    def remember(self, inst: Instance, est: Estimate) -> None:
        """`inst` has the request's prompt in its cache from now on (as far as it is known)."""
        if est.ids and inst.blocks is not None:
            inst.blocks.add_hashes(est.block_hashes(inst.blocks.block_size))
        elif est.text and inst.texts is not None:
            inst.texts.add_hashes(est.text)

    def seconds_per_token(self) -> list[float] | None:
        """Each instance's measured seconds per pending token (laps-inflow's unit; the mean of
        the others' where one has none yet), None until some instance has a pace."""
        paces = [i.pace.value if i.pace is not None else None for i in self.instances]
        known = [v for v in paces if v is not None]
        if not known:
            return None
        mean = sum(known) / len(known)
        return [mean if v is None else v for v in paces]

    def speeds(self) -> list[float]:
        """How slow each instance runs now against the others, from its measured pace."""
        return relative_speeds([i.pace for i in self.instances], time.monotonic(),
                               self.pace_forget_s)

    def status(self) -> dict:
        s = self.policy.stats
        draining = self.policy.draining()
        speeds = self.speeds()
        return {"policy": self.config.policy, "threshold": self.threshold,
                "threshold_from": "--threshold" if self.fixed_threshold is not None else
                "instances", "healthy": sum(i.healthy for i in self.instances),
                "held": len(self.hold.held) if self.hold is not None else 0,
                "held_total": held_counts(self.hold)[0],
                "held_seconds_total": round(held_counts(self.hold)[1], 3),
                "hold_tokens": self.hold_size() if self.hold is not None else 0,
                "hold_from": None if self.hold is None else
                "instances" if self.hold_tokens is None else "--hold-tokens",
                "by_affinity": s.by_affinity, "spilled": s.spilled, "moves": s.moves,
                "behind": s.behind,
                "group_sizes": [list(g) for g in s.groups[-20:]],
                "instances": [self._instance_status(k, draining[k], speeds[k])
                              for k in range(len(self.instances))]}

    def _instance_status(self, k: int, draining: bool, speed: float) -> dict:
        """One instance's status, with its measured pace when laps weighs paces (`speed`:
        how slow laps takes it to run now against the others, 1 = as they do)."""
        inst = self.instances[k]
        out = inst.status(self.group(k), draining)
        if inst.pace is not None:
            value = inst.pace.value
            out["pace_ms_per_token"] = None if value is None else round(value * 1e3, 4)
            out["relative_speed"] = round(speed, 3)
        return out


ROUTER = web.AppKey("router", HTTPRouter)


async def generate(request: web.Request, kind: str) -> web.StreamResponse:
    router, state = request.app[ROUTER], request.app[STATE]
    raw = await read_body(request, state.read_timeout_s)
    parse = functools.partial(estimate, raw, kind, router.tokenizer, router.max_model_len)
    # a small body is read here: a hop to a worker thread costs more (and on busy cores,
    # a wait for the thread to be scheduled) than its parse
    inline = INLINE_PARSE_BYTES if router.tokenizer is None else INLINE_TOKENIZE_BYTES
    est = (parse() if len(raw) <= inline else
           await asyncio.get_running_loop().run_in_executor(state.parse_pool, parse))
    if router.split is not None:
        return await router.split.generate(request, kind, raw, est)
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    return await route(request, router, path, raw, est)


async def completions(request: web.Request):
    return await generate(request, "completion")


async def chat_completions(request: web.Request):
    return await generate(request, "chat")


async def models(request: web.Request):
    for i in request.app[ROUTER].instances:
        if i.healthy and i.models is not None:
            return web.json_response(i.models)
    raise APIError("no instance is available", 503, "unavailable", headers={"Retry-After": "1"})


async def health(request: web.Request):
    n = sum(i.healthy for i in request.app[ROUTER].instances)
    return web.json_response({"status": "ok" if n else "unavailable", "healthy_instances": n},
                             status=200 if n else 503)


async def status(request: web.Request):
    return web.json_response(request.app[ROUTER].status())


async def metrics(request: web.Request):
    return web.Response(body=request.app[STATE].metrics.render(),
                        headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_router_app(router: HTTPRouter, api_key: str | None = None,
                      max_request_bytes: int = 4 << 20) -> web.Application:
    """The router's aiohttp app; it starts and stops the router with itself. Serve it with
    `server.http_runner.make_runner` (JSON answers to HTTP parser errors, read timeouts)."""
    app = web.Application(client_max_size=max_request_bytes, middlewares=[errors_and_auth])
    # serve.py's middleware reads auth and the request counter from a ServerState; the router
    # has no engine, so the engine fields stay empty (nothing else of the server runs here).
    # The key guards what serve.py's guards and the router's own status pages (instance
    # addresses, loads, errors; serve_cluster.py's /cluster/status): /health and /metrics stay
    # open, as serve.py's do
    state = ServerState(dispatcher=None, engines=[], tokenizer=router.tokenizer, vocab_size=0,
                        max_model_len=0, served_names=(), api_key=api_key,
                        guarded=GUARDED + ("/router/", "/cluster/"),
                        metrics=RouterMetrics(router),
                        parse_pool=concurrent.futures.ThreadPoolExecutor(
                            PARSE_THREADS, thread_name_prefix="router-parse"))
    app[STATE], app[ROUTER] = state, router

    async def start(_app) -> None:
        await router.start()

    async def stop(_app) -> None:
        await router.stop()
        state.parse_pool.shutdown(wait=False, cancel_futures=True)

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    loop_lag.watch(app, log, state.metrics.registry)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/router/status", status)
    return app
