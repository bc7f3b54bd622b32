"""`ReplicasEngine`: the RolloutEngine protocol over a pool of replica servers (`hybridrl replica`, server.py),
processes outside the training ranks' process group. Losing one never restarts the training ranks.

    generate        to the live replica with the fewest requests in flight, among those serving the current
                    version; the answer streams back (the tokens generated so far, every 50 ms, then the
                    output). A replica that stops answering (connection refused or reset, or nothing back
                    within request_timeout_s) is lost for good; the request goes to another live replica
                    with the same request id, sampling parameters and seed, and the tokens (and logprobs)
                    the lost one had streamed back: it goes on from them, drawing each next token with the
                    uniform of its output index, so the tokens are those of an uninterrupted request (up to
                    the last bits batch composition moves), each labelled with the version that sampled
                    it. Generation is pure: the agent loop applies actions in the trainer's process once
                    the output is back, so a request lost with its replica has applied nothing, and its
                    trajectory is built once
    update_weights  each bucket goes to every live replica, which copies it and (with digests) reads it back;
                    the version switches here once every live replica holds all of it. Only the job's rank 0
                    uploads (with a registry): the other ranks' clients wait for it to say which replicas
                    hold the version (handoff.py), so a replica receives each version once, not once per
                    rank. At a version's first bucket the pool is refreshed: replicas that registered (or
                    answer at a configured URL) since join it and receive that whole version before they
                    serve (none serves weights it did not receive from this trainer: the engine starts at
                    version -1)
    sleep / wake_up nothing to release: the replicas do not share the trainer's memory (`sleep(())` ends the
                    requests in flight with ABORT)

Which replica runs a request depends on timing; what it samples does not (same weights, the request's seed),
except for the last bits that batch composition can move in any engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from hybridrl.backends.replicas import handoff, wire
from hybridrl.backends.native.sampler import request_seed
from hybridrl.backends.replicas.config import ReplicasConfig
from hybridrl.rollout.protocol import KV_CACHE, GenerationOutput, SamplingParams, check_tags
from hybridrl.rollout.versions import NO_WEIGHTS, Publication
from hybridrl.rollout.weight_spec import WeightMismatch, dtype_name, validate_named_tensors

log = logging.getLogger(__name__)

# attempts of one request on replicas that still answer after its connection failed
MAX_ATTEMPTS = 3


class ReplicaLost(Exception):
    """A replica that stopped answering."""


class ReplicaTimeout(ReplicaLost):
    """A replica that answered nothing within request_timeout_s (lost whether or not it still answers /info)."""


@dataclass
class Replica:
    url: str
    instance: str                      # the id of the server's process (a new process at the same URL is another)
    version: int = NO_WEIGHTS          # the version it holds whole, as it answered this trainer
    missing: set[str] = field(default_factory=set)    # tensors of the version in progress it has not verified
    in_flight: int = 0


class ReplicasEngine:
    """The client of the replica pool, in the trainer's process."""

    releasable_tags = frozenset()      # nothing of the trainer's memory is held

    def __init__(self, cfg: ReplicasConfig, *, registry: str | Path | None = None, model: str = "",
                 uploads: bool = True, job: str = ""):
        """`uploads=False` (a trainer rank other than 0, with a registry): this client sends no weights; it
        takes the replicas rank 0's client published each version to (handoff.py), for `job`."""
        self.cfg, self.model = cfg, model
        self.registry = Path(registry) if registry else None
        self.uploads, self.job = uploads or self.registry is None, job
        self.live: dict[str, Replica] = {}       # instance -> replica, in the order they joined
        self.lost: dict[str, str] = {}           # instance -> why (never taken back)
        self.counts: Counter = Counter()
        self._where: dict[str, Replica] = {}     # request id on the wire -> the replica running it
        # the ids this client's requests carry on the replicas: several clients (one per trainer rank) share
        # a pool, and a request's id must be unique on its replica
        self._tag = uuid.uuid4().hex[:12]
        self._aborts: set[asyncio.Task] = set()
        self._client: Any = None
        self._client_loop: Any = None
        self._spec: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None    # the first replica's
        self._seed = 0                    # the replicas' rollout.native.seed (the same on each): the first one's
        info = self._first_info()
        self.eos_token_ids = tuple(info["eos_token_ids"])
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info["vocab_size"])
        self._publication = Publication(self._spec, NO_WEIGHTS)

    # -- as a registered rollout engine (`rollout.registry`) -------------------------------------

    @classmethod
    def for_rank(cls, cfg: Any, ctx: Any) -> "ReplicasEngine":
        section = cfg.rollout.replicas
        return cls(section, registry=section.registry or None, model=cfg.model.path, uploads=ctx.rank == 0,
                   job=handoff.job_key())

    @classmethod
    def releasable_tags_for(cls, cfg: Any) -> frozenset[str]:
        return cls.releasable_tags

    @classmethod
    def colocated_transport(cls, engine: Any, ranks: Sequence[int], group: Any) -> Any:
        """Each bucket to `update_weights`, which uploads it to every live replica."""
        from hybridrl.publication.transport_inprocess import InProcessTransport

        return InProcessTransport(engine)

    # -- the protocol -------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self._publication.version

    def weight_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._spec)

    def stats(self) -> dict[str, Any]:
        """The client's counters (cumulative) and the pool's size now."""
        return {**self.counts, "replicas_live": len(self.live), "policy_version": self.policy_version}

    async def generate(self, token_ids: Sequence[int], sampling: SamplingParams, request_id: str) -> GenerationOutput:
        """On a live replica serving the current version; again on another when that one is lost."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        if sampling.seed is None:         # the seed the native engine would draw for it, whichever replica runs it
            sampling = dataclasses.replace(sampling, seed=request_seed(self._seed, request_id))
        body = {"token_ids": [int(t) for t in token_ids], "sampling": wire.sampling_to_json(sampling),
                "request_id": self._wire_id(request_id), "stream": True}
        saved = Saved()
        for _ in range(MAX_ATTEMPTS):
            replica = self._pick()
            if saved.token_ids:
                body["resume"] = {"token_ids": saved.token_ids, "logprobs": saved.logprobs}
            try:
                out = await self._generate_on(replica, body, saved)
            except ReplicaLost as err:
                if not isinstance(err, ReplicaTimeout) and await self._still_there(replica):   # the connection failed
                    await self._abort_on(replica, body["request_id"])
                    continue
                self._lose(replica, str(err))
                self.counts["requests_resubmitted"] += 1
                log.warning("request %s: replica %s (%s) lost mid-request; going on on another replica from the %d "
                            "tokens it generated (%d live)", request_id, replica.instance, replica.url,
                            len(saved.token_ids), len(self.live))
                continue
            if "resume" in body:
                self.counts["tokens_resumed"] += len(body["resume"]["token_ids"])
                out = saved.before(out)
            self.counts["requests"] += 1
            self.counts["decode_tokens"] += len(out.token_ids)
            self.counts["prefill_tokens"] += out.prompt_tokens - out.cached_prompt_tokens
            self.counts["prefix_hit_tokens"] += out.cached_prompt_tokens
            return dataclasses.replace(out, request_id=request_id)
        raise RuntimeError(f"request {request_id}: its connection to a replica failed {MAX_ATTEMPTS} times while the "
                           "replica still answered; check the network between the trainer and the replicas")

    async def abort(self, request_id: str) -> bool:
        wire_id = self._wire_id(request_id)
        replica = self._where.get(wire_id)
        return await self._abort_on(replica, wire_id) if replica is not None else False

    async def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                             digests: Mapping[str, str] | None = None) -> None:
        """Upload to every live replica what it still misses of `version`; the version switches here once
        each holds all of it, verified. A replica lost on the way is dropped; mismatches raise WeightMismatch
        naming them (the publisher sends those again)."""
        items = list(named_tensors)
        validate_named_tensors(items, self._spec)
        self._publication.check(version)
        if digests is not None and set(digests) < {n for n, _ in items}:
            raise ValueError("update_weights: digests must cover every tensor of the call")
        if not self.uploads:
            await self._follow([n for n, _ in items], version)
            return
        if self._publication.pending != version:       # a version's first bucket: the pool is refreshed here
            await self._refresh_pool()
            for replica in self.live.values():
                replica.missing = set(self._spec)
        targets = list(self.live.values())
        answers = await asyncio.gather(*[self._upload(r, items, version, digests) for r in targets],
                                       return_exceptions=True)
        mismatched: set[str] = set()
        for replica, answer in zip(targets, answers):
            if isinstance(answer, ReplicaLost):
                self._lose(replica, str(answer))
            elif isinstance(answer, WeightMismatch):
                mismatched.update(answer.names)
            elif isinstance(answer, BaseException):
                raise answer
        self._require_live()
        self._publication.arrive([n for n in self._spec if all(n not in r.missing for r in self.live.values())],
                                 version)
        if self._publication.version == version:
            self._check_switched(version)
            if self.registry is not None and self.job:        # the other ranks' clients take it from here
                handoff.write_published(self.registry, version, self.job,
                                        [(r.instance, r.url) for r in self.live.values()])
        if mismatched:
            raise WeightMismatch(sorted(mismatched), f"publication v{version}: {len(mismatched)} tensor(s) read back "
                                                     f"on a replica differ from what was sent")

    async def _follow(self, names: list[str], version: int) -> None:
        """A client that does not upload: the version's last bucket waits until rank 0's client says which
        replicas hold it, verified (joining those it did not know), then switches to it."""
        if not self._publication.completes(names, version):
            self._publication.arrive(names, version)
            return
        published = await handoff.wait_published(self.registry, version, self.job,
                                                 self.cfg.wait_s + self.cfg.request_timeout_s)
        for instance, url in published:
            if instance not in self.live and instance not in self.lost:
                info = await self._info(url)
                if info is not None and info["instance"] == instance:
                    self._join(url, info)
        holding = {instance for instance, _ in published}
        for replica in self.live.values():     # one rank 0 did not publish to serves nothing here until it does
            replica.version = version if replica.instance in holding else NO_WEIGHTS
        if not any(r.version == version for r in self.live.values()):
            raise RuntimeError(f"publication v{version}: none of the replicas rank 0 published it to answers this "
                               f"rank ({', '.join(url for _, url in published) or 'none named'})")
        self._publication.arrive(names, version)

    async def sleep(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        """Nothing to release (the replicas hold no memory of the trainer's: `sleep(())`); requests in flight end
        with ABORT, as the protocol says."""
        check_tags(self, tags)
        await asyncio.gather(*[self._abort_on(replica, request_id) for request_id, replica in list(self._where.items())])

    async def wake_up(self, tags: Iterable[str] = (KV_CACHE,)) -> None:
        check_tags(self, tags)

    def writable_views(self, names: Sequence[str]) -> None:
        """None: the weights live in other processes (a publisher sends buckets)."""
        return None

    async def commit_in_place(self, names: Sequence[str], version: int) -> None:
        raise RuntimeError("the replicas' weights live in other processes: nothing is written in place")

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._client_loop is not None and not self._client_loop.is_closed():
            try:
                if self._client_loop.is_running():
                    self._client_loop.create_task(client.aclose())
                else:
                    self._client_loop.run_until_complete(client.aclose())
            except RuntimeError:
                pass  # its loop is gone: the sockets close with it

    def _wire_id(self, request_id: str) -> str:
        return f"{self._tag}/{request_id}"

    # -- the pool -----------------------------------------------------------------------------

    def _candidates(self) -> list[str]:
        """Configured URLs, then the registered ones (oldest registration first)."""
        urls = list(self.cfg.urls)
        if self.registry is not None and self.registry.is_dir():
            for path in handoff.registrations(self.registry):
                try:
                    urls.append(json.loads(path.read_text())["url"])
                except (OSError, ValueError, KeyError):
                    continue     # being written, or not a registration
        return list(dict.fromkeys(u.rstrip("/") for u in urls))

    def _join(self, url: str, info: Mapping[str, Any]) -> None:
        """Take a replica that answered `info` at `url` into the pool (weights still to come), unless it serves
        another model than the run's (refused for good: its instance counts as lost, the reason logged)."""
        instance = info["instance"]
        if instance in self.lost or instance in self.live:
            return
        problem = self._misfit(info)
        if problem is not None:
            self.lost[instance] = problem
            log.error("rollout replica %s at %s refused: %s", instance, url, problem)
            return
        self.live[instance] = Replica(url, instance)
        self.counts["replicas_joined"] += 1
        log.info("replica %s (%s) joined the pool (%d live); it serves once it holds a whole published version",
                 instance, url, len(self.live))

    def _misfit(self, info: Mapping[str, Any]) -> str | None:
        """Why a replica cannot serve this run (None: it can): another model's shapes, or another dtype."""
        theirs = {n: (tuple(s), d) for n, (s, d) in info["weight_spec"].items()}
        if self._spec is not None and theirs != {n: (s, dtype_name(d)) for n, (s, d) in self._spec.items()}:
            return f"it serves a model of another shape than the run's: start it with --model {self.model or 'model.path'}"
        if self._spec is not None and int(info["seed"]) != self._seed:
            return (f"its rollout.native.seed is {info['seed']}, the pool's {self._seed}: start it with "
                    f"rollout.native.seed={self._seed} (a request without a seed samples by it)")
        dtypes = {d for _, d in theirs.values()}
        if self.cfg.dtype != "auto" and dtypes != {self.cfg.dtype}:
            return (f"its weights are {sorted(dtypes)}, rollout.replicas.dtype={self.cfg.dtype}: start it with "
                    f"rollout.native.dtype={self.cfg.dtype}")
        return None

    def _first_info(self) -> dict[str, Any]:
        """At start: wait (up to wait_s) for min_live replicas; the first one's description of the model."""
        import httpx

        deadline, first = time.monotonic() + self.cfg.wait_s, None
        with httpx.Client(timeout=self.cfg.connect_timeout_s, trust_env=False) as client:
            while True:
                for url in self._candidates():
                    if url in {r.url for r in self.live.values()}:
                        continue
                    try:
                        info = client.get(f"{url}/info").raise_for_status().json()
                    except httpx.HTTPError:
                        continue
                    self._join(url, info)
                    if first is None and info["instance"] in self.live:    # the model as the first replica has it
                        first, self._seed = info, int(info["seed"])
                        self._spec = {n: (tuple(shape), getattr(torch, dtype))
                                      for n, (shape, dtype) in info["weight_spec"].items()}
                if len(self.live) >= self.cfg.min_live or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        self._require_live()
        self._warn_short()
        return first

    async def _refresh_pool(self) -> None:
        """Replicas that appeared since join (waiting up to wait_s while fewer than min_live are live)."""
        deadline = time.monotonic() + self.cfg.wait_s
        while True:
            known = {r.url for r in self.live.values()}
            for url in self._candidates():
                if url not in known:
                    info = await self._info(url)
                    if info is not None:
                        self._join(url, info)
            if len(self.live) >= self.cfg.min_live or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        self._require_live()
        self._warn_short()

    def _warn_short(self) -> None:
        if 0 < len(self.live) < self.cfg.min_live:
            log.warning("%d rollout replica(s) live, fewer than rollout.replicas.min_live=%d after %.0f s: going on "
                        "with them", len(self.live), self.cfg.min_live, self.cfg.wait_s)

    def _require_live(self) -> None:
        if self.live:
            return
        lost = "; ".join(f"{i}: {why}" for i, why in self.lost.items()) or "none answered"
        where = f"--registry {self.registry}" if self.registry is not None else "--port P (one of rollout.replicas.urls)"
        raise RuntimeError(f"no rollout replica is live ({lost}): start one with `python -m hybridrl replica "
                           f"--model {self.model or 'MODEL_DIR'} {where}`; it joins at the next publication")

    def _pick(self) -> Replica:
        serving = [r for r in self.live.values() if r.version == self.policy_version >= 0]
        if not serving:
            self._require_live()
            raise RuntimeError(f"no rollout replica serves a published version yet (engine at v{self.policy_version}): "
                               "publish before generating")
        return min(serving, key=lambda r: r.in_flight)

    def _lose(self, replica: Replica, why: str) -> None:
        if self.live.pop(replica.instance, None) is not None:
            self.lost[replica.instance] = why
            self.counts["replicas_lost"] += 1
            log.warning("rollout replica %s (%s) lost: %s; %d live", replica.instance, replica.url, why,
                        len(self.live))

    def _check_switched(self, version: int) -> None:
        for replica in list(self.live.values()):
            if replica.version != version:
                self._lose(replica, f"it holds v{replica.version} after every tensor of v{version} was verified there")
        self._require_live()

    # -- HTTP ---------------------------------------------------------------------------------

    def _http(self) -> Any:
        """The client of this event loop (one pool of connections per loop)."""
        import httpx

        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=None)
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.cfg.request_timeout_s, connect=self.cfg.connect_timeout_s),
                limits=limits, trust_env=False)
            self._client_loop = loop
        return self._client

    @contextlib.contextmanager
    def _answering(self, path: str) -> Iterator[None]:
        """httpx's timeouts and transport failures on `path` as the replica's loss."""
        import httpx

        try:
            yield
        except httpx.TimeoutException as err:
            raise ReplicaTimeout(f"no answer to {path} within {self.cfg.request_timeout_s:g} s") from err
        except httpx.TransportError as err:
            raise ReplicaLost(f"{type(err).__name__} on {path}: {err}") from err

    async def _post(self, replica: Replica, path: str, **kwargs: Any) -> Any:
        with self._answering(path):
            return await self._http().post(f"{replica.url}{path}", **kwargs)

    async def _info(self, url: str) -> dict[str, Any] | None:
        import httpx

        try:
            response = await self._http().get(f"{url}/info", timeout=self.cfg.connect_timeout_s)
            return response.raise_for_status().json()
        except httpx.HTTPError:
            return None

    async def _still_there(self, replica: Replica) -> bool:
        """Whether the same server process answers at the replica's URL (a connection failed, not it)."""
        if replica.instance in self.lost:
            return False
        info = await self._info(replica.url)
        return info is not None and info["instance"] == replica.instance

    async def _generate_on(self, replica: Replica, body: dict[str, Any], saved: "Saved") -> GenerationOutput:
        """The request on `replica`, its answer streamed: what it generated so far goes into `saved` as it
        comes, so that another replica can go on from there if this one is lost."""
        request_id = body["request_id"]
        self._where[request_id] = replica
        replica.in_flight += 1
        try:
            with self._answering("/generate"):
                return await self._stream(replica, body, saved)
        except asyncio.CancelledError:
            task = asyncio.get_running_loop().create_task(self._abort_on(replica, request_id))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        finally:
            replica.in_flight -= 1
            self._where.pop(request_id, None)

    async def _stream(self, replica: Replica, body: dict[str, Any], saved: "Saved") -> GenerationOutput:
        """POST /generate with "stream": each line of what it generated goes into `saved`; the output."""
        async with self._http().stream("POST", f"{replica.url}/generate", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                _answer(response, replica)
            async for line in response.aiter_lines():
                message = json.loads(line)
                if "saved" in message:
                    saved.add(message["saved"])
                elif "output" in message:
                    return wire.output_from_json(message["output"])
                else:
                    _refusal(message["status"], message["error"], replica)
        raise ReplicaLost("/generate's answer ended before its output")

    async def _abort_on(self, replica: Replica, request_id: str) -> bool:
        try:
            response = await self._post(replica, "/abort", json={"request_id": request_id},
                                        timeout=self.cfg.connect_timeout_s)
        except ReplicaLost:
            return False
        return bool(response.status_code == 200 and response.json().get("found"))

    async def _upload(self, replica: Replica, items: list[tuple[str, torch.Tensor]], version: int,
                      digests: Mapping[str, str] | None) -> None:
        """What `replica` still misses of this call's tensors; what it verified no longer counts as missing."""
        sent = [(n, t) for n, t in items if n in replica.missing]
        if not sent:
            return
        payload = wire.weights_payload(sent, version, None if digests is None else {n: digests[n] for n, _ in sent},
                                       client=self._tag)
        try:
            answer = _answer(await self._post(replica, "/weights", content=payload), replica)
        except WeightMismatch as err:       # the others were verified there
            replica.missing.difference_update(n for n, _ in sent if n not in err.names)
            raise
        replica.missing.difference_update(n for n, _ in sent)
        replica.version = int(answer["policy_version"])


def _answer(response: Any, replica: Replica) -> dict[str, Any]:
    """The JSON of a replica's answer; its refusals as the exceptions the engine protocol raises."""
    if response.status_code == 200:
        return response.json()
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
    _refusal(response.status_code, body.get("error", response.text[:500]), replica, body.get("mismatch"))


def _refusal(status: int, error: str, replica: Replica, mismatch: list[str] | None = None) -> None:
    if status == 409:
        raise WeightMismatch(mismatch, f"replica {replica.instance}: {error}")
    if status == 400:
        raise ValueError(f"replica {replica.instance}: {error}")
    raise RuntimeError(f"replica {replica.instance} ({replica.url}) failed: {error}")


@dataclass
class Saved:
    """What a request generated on replicas that were lost: its output tokens and their logprobs (as the
    replicas streamed them), the version of the first and where later versions begin."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int = NO_WEIGHTS
    version_starts: list[tuple[int, int]] = field(default_factory=list)

    def add(self, line: Mapping[str, Any]) -> None:
        """One streamed line: the tokens from index `start` on, with the versions of the replica's output."""
        start, ids = int(line["start"]), [int(t) for t in line["token_ids"]]
        if start != len(self.token_ids):
            raise ReplicaLost(f"a replica streamed tokens from index {start}, {len(self.token_ids)} were saved")
        self._label(int(line["policy_version"]), line["version_starts"], start, start + len(ids))
        self.token_ids += ids
        self.logprobs += [float(x) for x in line["logprobs"]]

    def before(self, out: GenerationOutput) -> GenerationOutput:
        """The answer of the replica that went on from here (its tokens and logprobs hold the saved ones),
        labelled with the saved tokens' versions, then its own."""
        n = len(self.token_ids)
        if out.token_ids[:n] != self.token_ids:
            raise RuntimeError(f"request {out.request_id}: the replica that went on from {n} saved tokens answered "
                               "other ones in their place")
        self._label(out.policy_version, out.version_starts, n, len(out.token_ids))
        return dataclasses.replace(out, logprobs=self.logprobs + list(out.logprobs[n:]),
                                   policy_version=self.policy_version, version_starts=tuple(self.version_starts))

    def _label(self, first: int, starts: Sequence[Sequence[int]], lo: int, hi: int) -> None:
        """Take a replica's versions (`first` from index 0, then `starts`) for output indices [lo, hi)."""
        bounds = [(0, first), *((int(i), int(v)) for i, v in starts)]
        for k, (index, version) in enumerate(bounds):
            end = bounds[k + 1][0] if k + 1 < len(bounds) else hi
            if end <= lo or index >= hi:
                continue
            at = max(index, lo)
            if at == 0:
                self.policy_version = version
            elif version != (self.version_starts[-1][1] if self.version_starts else self.policy_version):
                self.version_starts.append((at, version))
