"""The OpenAI-compatible gateway's cost, side by side with what it replaces, interleaved in one run.

    python benchmarks/gateway.py overhead --json runs/bench/gateway_overhead.json [--agents 1 8 64]
                                          [--turns 4] [--min-requests 16] [--max-tokens 16] [--repeats 5]
                                          [--modes direct gateway gateway_inline] [--clients thread|engine]
                                          [--model DIR] [--driver loop|thread] [--engine native|instant]
    python benchmarks/gateway.py step --json runs/bench/gateway_step.json --model runs/demo/sft/hf
                                      [--steps 6] [--repeats 3]

`overhead`: the gateway's own added latency per request, (a request through the gateway) - (the same
request straight to the engine), at each `--agents` count. One native engine runs on the main thread's
event loop (the engine's loop). The agents (each a multi-turn conversation of `--turns` requests of
`--max-tokens` greedy tokens; at least `--min-requests` requests per measurement, so a single agent has
more turns) run on a loop of their own in another thread (`--clients thread`), so that their load does
not queue on the engine's loop; `--clients engine` runs them on the engine's loop instead (how this
benchmark measured before). Modes, each with the same questions (the engine's prefix cache is emptied
between modes, so none reuses another's KV blocks; `tokens_per_request` shows the work was the same):

- direct: the agent sends token ids to the engine's loop (`run_coroutine_threadsafe(engine.generate)`),
  the context grown by the chat template's delta as the built-in loop does;
- gateway: OpenAI-client agents through the gateway as it runs now (its HTTP server on its own loop and
  thread, generation handed to the engine's loop): HTTP over the Unix socket, chat template, token
  capture, turn parsing, the client's own parsing;
- gateway_inline: the same with the HTTP server on the engine's loop (`GatewayRunner(server_thread=False)`,
  the arrangement before the server had its own thread).

Every repeat runs every mode once, the order rotated per repeat. Reports per (agents, mode) the
per-request latency median (p10, p90), requests/s and the engine process's CPU per request (every
thread's); per gateway mode the added median (its median - direct's median) per repeat, the median and
[min, max] of those, the same over all requests pooled, and the added CPU per request. `--engine instant`
swaps the model for an engine that answers at once with the same few tokens: what is left is the path.

`step`: the demo's GRPO recipe (`recipes/calc_grpo_cpu.yaml`, the built-in agent loop) against the same
work written as an OpenAI-client agent (`recipes/calc_grpo_agent_cpu.yaml`), `--steps` steps each from
the same model (no validation or checkpoints), alternating; reports the median step time (steps after
the first) and stage times per recipe, and the ratio agent / built-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hybridrl.demo import build_base_model  # noqa: E402  (the demo's base model)

MODES = ("direct", "gateway", "gateway_inline")
TARGET_ADDED_MS = 5.0


# ---------------------------------------------------------------------------------------------------------
# overhead


def questions(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [f"What is {rng.randint(100, 999)} * {rng.randint(100, 999)}?" for _ in range(n)]


class Clients:
    """Where the agents run: a loop in a thread of its own, or (None) the engine's loop itself."""

    def __init__(self, own_thread: bool):
        self.loop = asyncio.new_event_loop() if own_thread else None
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-clients", daemon=True) \
            if own_thread else None
        if self._thread is not None:
            self._thread.start()

    async def run(self, coro):
        """Await `coro` on the agents' loop (from the engine's loop)."""
        if self.loop is None:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def close(self) -> None:
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
            self.loop.close()


async def to_loop(loop, coro):
    if loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


async def direct(engine, engine_loop, chat, prompts: list[str], turns: int, max_tokens: int,
                 tag: str) -> tuple[list, list]:
    """On the agents' loop: per-request latencies (s) and completion tokens of agents sending token ids to
    the engine's loop."""
    from hybridrl.rollout.protocol import SamplingParams

    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=0.0)
    latencies: list[float] = []
    tokens: list[int] = []

    async def agent(i: int, prompt: str) -> None:
        ids = chat.prompt_ids([{"role": "user", "content": prompt}])
        for turn in range(turns):
            t0 = time.perf_counter()
            out = await to_loop(engine_loop, engine.generate(ids, sampling, f"{tag}-{i}-{turn}"))
            latencies.append(time.perf_counter() - t0)
            tokens.append(len(out.token_ids))
            ended = bool(out.token_ids) and out.token_ids[-1] in chat.eos_ids
            ids = ids + out.token_ids + chat.observation_ids([{"role": "user", "content": "Next."}], after_eos=ended)

    await asyncio.gather(*[agent(i, p) for i, p in enumerate(prompts)])
    return latencies, tokens


async def conversation(client, messages: list[dict], turns: int, max_tokens: int) -> tuple[list, list]:
    """One agent: `turns` requests, each answer and a user turn appended; (latencies, tokens). `client` is
    an AsyncOpenAI client, or a `RawClient` (the same request as JSON over HTTP, none of the SDK's work)."""
    latencies, tokens = [], []
    for _ in range(turns):
        t0 = time.perf_counter()
        if isinstance(client, RawClient):
            reply = await client.chat(messages=messages, max_tokens=max_tokens)
            latencies.append(time.perf_counter() - t0)
            tokens.append(reply["usage"]["completion_tokens"])
            message = {k: v for k, v in reply["choices"][0]["message"].items() if v is not None}
        else:
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=max_tokens)
            latencies.append(time.perf_counter() - t0)
            tokens.append(reply.usage.completion_tokens)
            message = reply.choices[0].message.model_dump(exclude_none=True)
        messages = messages + [message, {"role": "user", "content": "Next."}]
    return latencies, tokens


class RawClient:
    """POST /v1/chat/completions with the episode's key, the body as the OpenAI SDK sends it."""

    def __init__(self, server, key: str, http):
        self.url, self.key, self.http = server.base_url + "/chat/completions", key, http

    async def chat(self, **body) -> dict:
        response = await self.http.post(self.url, json={"model": "policy", **body},
                                        headers={"Authorization": f"Bearer {self.key}"})
        response.raise_for_status()
        return response.json()


CLIENT_KIND = {"sdk": True}
CLIENT_NAME = {True: "openai", False: "http"}


def openai_client(server, key: str, http):
    if not CLIENT_KIND["sdk"]:
        return RawClient(server, key, http)
    import openai

    return openai.AsyncOpenAI(api_key=key, base_url=server.base_url, http_client=http, max_retries=0)


class ClientProcess:
    """The agents' clients in a process of their own (`python benchmarks/gateway.py _clients`): one JSON line
    per conversation in on its stdin, one line of its latencies out."""

    def __init__(self, server, agents: int):
        self.server, self.agents = server, agents
        self.proc = None
        self._answers: dict[int, asyncio.Future] = {}
        self._next = 0
        self._reader = None

    async def start(self) -> None:
        where = ["--socket", str(self.server.socket_path)] if self.server.socket_path else ["--url", self.server.base_url]
        self.proc = await asyncio.create_subprocess_exec(sys.executable, __file__, "_clients", *where, "--agents",
                                                         str(self.agents), "--client", CLIENT_NAME[CLIENT_KIND["sdk"]],
                                                         stdin=subprocess.PIPE,
                                                         stdout=subprocess.PIPE, cwd=ROOT)
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for line in self.proc.stdout:
            answer = json.loads(line)
            future = self._answers.pop(answer["id"])
            if "error" in answer:
                future.set_exception(RuntimeError(answer["error"]))
            else:
                future.set_result((answer["latencies"], answer["tokens"]))
        for future in self._answers.values():
            future.set_exception(RuntimeError("the clients' process ended"))

    async def converse(self, key: str, messages: list[dict], turns: int, max_tokens: int) -> tuple[list, list]:
        self._next += 1
        future = self._answers[self._next] = asyncio.get_running_loop().create_future()
        self.proc.stdin.write((json.dumps({"id": self._next, "key": key, "messages": messages, "turns": turns,
                                           "max_tokens": max_tokens}) + "\n").encode())
        return await future

    async def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            await self.proc.wait()
            await self._reader


def clients_main(args) -> int:
    """The clients' process: conversations as their lines arrive on stdin, answers on stdout."""
    from hybridrl.gateway.runner import _http_client

    class Where:
        socket_path = args.socket
        base_url = "http://hybridrl-gateway/v1" if args.socket else args.url

    async def main():
        http = _http_client(Where, limit=args.agents, timeout=3600)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        running = set()

        async def one(job: dict) -> None:
            try:
                lat, toks = await conversation(openai_client(Where, job["key"], http), job["messages"], job["turns"],
                                               job["max_tokens"])
                answer = {"id": job["id"], "latencies": lat, "tokens": toks}
            except Exception as err:  # noqa: BLE001 - reported to the engine's side
                answer = {"id": job["id"], "error": f"{type(err).__name__}: {err}"}
            sys.stdout.write(json.dumps(answer) + "\n")
            sys.stdout.flush()

        async for line in reader:
            task = asyncio.ensure_future(one(json.loads(line)))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
        await http.aclose()

    asyncio.run(main())
    return 0


class GatewayAgents:
    """OpenAI-client agents through one runner's gateway; their clients on the agents' thread (`clients`), on
    the engine's loop, or in their own process."""

    def __init__(self, runner, clients: Clients, agents: int, process: bool):
        self.runner, self.clients, self.agents = runner, clients, agents
        self.process = ClientProcess(runner.server, agents) if process else None
        self._http = None

    async def start(self) -> None:
        if self.process is not None:
            await self.process.start()

    async def _converse(self, key: str, messages: list[dict], turns: int, max_tokens: int) -> tuple[list, list]:
        from hybridrl.gateway.runner import _http_client

        if self._http is None:               # made on the agents' loop, where it is used
            self._http = _http_client(self.runner.server, limit=self.agents, timeout=3600)
        return await conversation(openai_client(self.runner.server, key, self._http), messages, turns, max_tokens)

    async def close(self) -> None:
        if self.process is not None:
            await self.process.close()
        if self._http is not None:
            await self.clients.run(self._http.aclose())

    async def run(self, task, prompts: list[str], turns: int, max_tokens: int) -> tuple[list, list]:
        from hybridrl.data.episode import TaskInstance

        latencies: list[float] = []
        tokens: list[int] = []

        async def agent(client, instance):            # on the engine's loop: the conversation runs elsewhere
            messages = [dict(m) for m in instance.messages]
            if self.process is not None:
                lat, toks = await self.process.converse(client.api_key, messages, turns, max_tokens)
            else:
                lat, toks = await self.clients.run(self._converse(client.api_key, messages, turns, max_tokens))
            latencies.extend(lat)
            tokens.extend(toks)
            return 0.0

        self.runner.agent = agent
        instances = [TaskInstance(task="calculator", task_id=f"q{i}", messages=({"role": "user", "content": p},),
                                  reference="0") for i, p in enumerate(prompts)]
        trajs = await self.runner.run(instances, task=task)
        bad = [t.metadata.get("end_reason") for t in trajs if t.status.value != "completed"]
        if bad:
            raise SystemExit(f"gateway episodes did not run cleanly: {bad[:3]}")
        return latencies, tokens


def _summary(lat: list[float], toks: list[int], wall: float) -> dict:
    return {"median_ms": 1e3 * statistics.median(lat), "p10_ms": 1e3 * _quantile(lat, 0.1),
            "p90_ms": 1e3 * _quantile(lat, 0.9), "requests": len(lat), "requests_per_s": len(lat) / wall,
            "tokens_per_request": statistics.fmean(toks), "latencies_ms": [1e3 * x for x in lat]}


class InstantEngine:
    """`--engine instant`: answers every request at once with the same few tokens (no model), so what a mode
    costs beyond `direct` is the path to the engine alone: the gateway's CPU per request, undiluted."""

    max_model_len = 1 << 20

    def __init__(self, tokenizer, eos_ids: tuple[int, ...], max_tokens: int):
        self.eos_token_ids = eos_ids
        self.answer = tokenizer.encode("The answer is 42.", add_special_tokens=False)[:max_tokens - 1] + [eos_ids[0]]

    async def generate(self, context, sampling, request_id):
        from hybridrl.rollout.protocol import FinishReason, GenerationOutput

        await asyncio.sleep(0)
        ids = self.answer[:sampling.max_new_tokens]
        finish = FinishReason.STOP if ids[-1] in self.eos_token_ids else FinishReason.LENGTH
        return GenerationOutput(request_id, list(ids), [-0.5] * len(ids), finish, 0, prompt_tokens=len(context))

    async def abort(self, request_id) -> None:
        return None

    async def run_in_engine(self, fn):
        return None

    def close(self) -> None:
        return None


def overhead(args) -> dict:
    from transformers import AutoTokenizer

    from hybridrl.agent.chat import ChatFormat
    from hybridrl.agent.config import AgentConfig, ToolsConfig
    from hybridrl.agent.tools.base import ToolBox
    from hybridrl.backends.native import NativeEngine, NativeEngineConfig
    from hybridrl.envs.tasks import get_task
    from hybridrl.gateway.config import GatewayConfig
    from hybridrl.gateway.runner import GatewayRunner

    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    most = max(args.agents)
    turns_for = {a: max(args.turns, math.ceil(args.min_requests / a)) for a in args.agents}
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.engine == "instant":
        engine = InstantEngine(tokenizer, (tokenizer.eos_token_id,), args.max_tokens)
    else:
        engine = NativeEngine.from_pretrained(args.model, NativeEngineConfig(kv_cache_mb=256, max_num_seqs=most,
                                                                             driver=args.driver), device="cpu")
    chat = ChatFormat(tokenizer, eos_token_ids=engine.eos_token_ids)
    agent_cfg = AgentConfig(max_turns=max(turns_for.values()) + 1, max_new_tokens_per_turn=args.max_tokens + 1,
                            max_response_tokens=100_000, max_episode_s=3600, temperature=0.0,
                            max_concurrent_episodes=most)
    task = get_task("calculator")
    clients = Clients(own_thread=args.clients != "engine")    # direct agents: their own thread with `process` too
    rows: dict[int, list[dict]] = {a: [] for a in args.agents}

    async def go():
        engine_loop = asyncio.get_running_loop()
        gateways = {}
        for mode in args.modes:
            if mode == "direct":
                continue
            runner = GatewayRunner(engine, tokenizer, agent_cfg=agent_cfg, gateway_cfg=GatewayConfig(),
                                   tools=ToolBox(cfg=ToolsConfig(kill_switch="", audit_log="")), run_id="bench",
                                   agent=lambda client, instance: None, server_thread=mode == "gateway")
            await runner.start()
            gateways[mode] = GatewayAgents(runner, clients, most, process=args.clients == "process")
            await gateways[mode].start()

        async def one(mode: str, prompts: list[str], turns: int, tag: str) -> tuple[list, list]:
            if mode == "direct":
                return await clients.run(direct(engine, engine_loop, chat, prompts, turns, args.max_tokens, tag))
            return await gateways[mode].run(task, prompts, turns, args.max_tokens)

        for mode in args.modes:                                    # warm-up: every path once
            await one(mode, questions(-1, 4), 1, "warm")
        for rep in range(args.repeats):
            for agents in args.agents:
                row: dict = {"repeat": rep, "load_avg_1m": os.getloadavg()[0]}
                order = args.modes[rep % len(args.modes):] + args.modes[:rep % len(args.modes)]
                prompts = questions(1000 * rep + agents, agents)   # the same questions for every mode
                for mode in order:
                    await engine.run_in_engine(lambda core: core.pool.invalidate())   # no prefix reuse across modes
                    t0, cpu0 = time.perf_counter(), _cpu_s()
                    lat, toks = await one(mode, prompts, turns_for[agents], f"r{rep}a{agents}")
                    row[mode] = _summary(lat, toks, time.perf_counter() - t0)
                    row[mode]["cpu_ms_per_request"] = 1e3 * (_cpu_s() - cpu0) / len(lat)
                row["order"] = order
                for mode in args.modes:
                    if mode != "direct" and "direct" in row:
                        row[f"{mode}_added_median_ms"] = row[mode]["median_ms"] - row["direct"]["median_ms"]
                        row[f"{mode}_added_cpu_ms"] = row[mode]["cpu_ms_per_request"] - row["direct"]["cpu_ms_per_request"]
                rows[agents].append(row)
                print(f"repeat {rep}, {agents} agents: " + ", ".join(
                    f"{m} {row[m]['median_ms']:.1f} ms" for m in args.modes) + "  added: " + ", ".join(
                    f"{m} {row[f'{m}_added_median_ms']:+.2f} ms" for m in args.modes if f"{m}_added_median_ms" in row)
                    + "  cpu/request: " + ", ".join(f"{m} {row[m]['cpu_ms_per_request']:.2f} ms" for m in args.modes)
                    + f"  load {row['load_avg_1m']:.1f}", flush=True)
        for g in gateways.values():
            await g.close()
            await g.runner.close()

    try:
        asyncio.run(go())
    finally:
        clients.close()
        engine.close()
    by_agents = {str(a): _aggregate(rows[a], args.modes) | {"turns": turns_for[a]} for a in args.agents}
    now = {a: r["added_ms"]["gateway"]["median_of_repeats"] for a, r in by_agents.items() if "gateway" in r["added_ms"]}
    return {"benchmark": "gateway overhead", "model": args.model, "engine": args.engine, "driver": args.driver,
            "clients": args.clients, "client": args.client,
            "torch_threads": torch.get_num_threads(), "switch_interval_s": sys.getswitchinterval(),
            "agents": args.agents, "modes": args.modes, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "cpu_count": os.cpu_count(), "target_added_ms": TARGET_ADDED_MS,
            "target_met_at": {a: v <= TARGET_ADDED_MS for a, v in now.items()},
            "by_agents": by_agents, "per_repeat": {str(a): rows[a] for a in args.agents}}


def _aggregate(rows: list[dict], modes: list[str]) -> dict:
    pooled = {m: [x for r in rows for x in r[m].pop("latencies_ms")] for m in modes}
    out: dict = {"median_ms": {m: statistics.median(v) for m, v in pooled.items()},
                 "p10_ms": {m: _quantile(v, 0.1) for m, v in pooled.items()},
                 "p90_ms": {m: _quantile(v, 0.9) for m, v in pooled.items()},
                 "requests_per_s": {m: statistics.median(r[m]["requests_per_s"] for r in rows) for m in modes},
                 "tokens_per_request": {m: statistics.fmean(r[m]["tokens_per_request"] for r in rows) for m in modes},
                 "cpu_ms_per_request": {m: statistics.median(r[m]["cpu_ms_per_request"] for r in rows) for m in modes},
                 "added_ms": {}, "added_cpu_ms": {}}
    for m in modes:
        if m == "direct" or "direct" not in modes:
            continue
        per = [r[f"{m}_added_median_ms"] for r in rows]
        out["added_ms"][m] = {"median_of_repeats": statistics.median(per), "spread": [min(per), max(per)],
                              "per_repeat": per, "pooled": out["median_ms"][m] - out["median_ms"]["direct"]}
        cpu = [r[f"{m}_added_cpu_ms"] for r in rows]
        out["added_cpu_ms"][m] = {"median_of_repeats": statistics.median(cpu), "spread": [min(cpu), max(cpu)]}
    return out


def _cpu_s() -> float:
    """This process's CPU seconds so far, every thread's (the engine, the gateway, the direct agents)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---------------------------------------------------------------------------------------------------------
# step time


RECIPES = {"builtin": ROOT / "recipes" / "calc_grpo_cpu.yaml", "agent": ROOT / "recipes" / "calc_grpo_agent_cpu.yaml"}
STAGES = ("rollout", "reward", "prep", "train", "sync")


def one_run(recipe: Path, model: str, steps: int, run_dir: Path, overrides: list[str]) -> dict:
    load = os.getloadavg()[0]
    cmd = [sys.executable, "-m", "hybridrl", "train", str(recipe), f"model.path={model}", f"run.dir={run_dir}",
           f"trainer.total_steps={steps}", "trainer.validate_every=0", "trainer.checkpoint_every=0",
           "trainer.export_hf=false", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{recipe.name} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in rows if r["step"] >= 2 and "time/step_s" in r]
    med = lambda key: statistics.median(r.get(key) or 0.0 for r in measured)  # noqa: E731
    return {"step_s": med("time/step_s"), "stage_times": {f"T_{s}": med(f"time/T_{s}") for s in STAGES},
            "reward_mean": statistics.fmean(r["reward/mean"] for r in measured), "steps_measured": len(measured),
            "load_avg_1m": [load, os.getloadavg()[0]]}


def step(args) -> dict:
    runs: dict[str, list[dict]] = {"builtin": [], "agent": []}
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-step-") as tmp:
        for rep in range(args.repeats):
            for side in (("builtin", "agent") if rep % 2 == 0 else ("agent", "builtin")):
                r = one_run(RECIPES[side], args.model, args.steps, Path(tmp) / f"{side}{rep}", args.overrides)
                runs[side].append(r)
                print(f"repeat {rep} {side}: step {r['step_s']:.3f}s  T_rollout {r['stage_times']['T_rollout']:.3f}s  "
                      f"load {r['load_avg_1m'][0]:.1f}", flush=True)
    med = {side: {"step_s": statistics.median(r["step_s"] for r in rs),
                  **{k: statistics.median(r["stage_times"][k] for r in rs) for k in rs[0]["stage_times"]}}
           for side, rs in runs.items()}
    paired = [a["step_s"] / b["step_s"] for a, b in zip(runs["agent"], runs["builtin"])]
    return {"benchmark": "gateway step time", "model": args.model, "steps": args.steps, "repeats": args.repeats,
            "overrides": args.overrides, "median": med, "ratio_step_agent_over_builtin": med["agent"]["step_s"]
            / med["builtin"]["step_s"], "ratio_per_repeat": paired, "target_ratio": 1.3, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    o = sub.add_parser("overhead")
    o.add_argument("--json", required=True)
    o.add_argument("--agents", type=int, nargs="+", default=[1, 8, 64], help="concurrent agents (each count measured)")
    o.add_argument("--turns", type=int, default=4)
    o.add_argument("--min-requests", type=int, default=16, help="requests per measurement at least (more turns)")
    o.add_argument("--max-tokens", type=int, default=16)
    o.add_argument("--repeats", type=int, default=5)
    o.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    o.add_argument("--clients", default="process", choices=("process", "thread", "engine"),
                   help="where the OpenAI clients run: a process of their own, a loop in their own thread, or "
                        "the engine's loop (direct agents: their own thread unless engine)")
    o.add_argument("--torch-threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    o.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s; default Python's)")
    o.add_argument("--model", default=None, help="HF directory (default: the demo's base model, built for the run)")
    o.add_argument("--driver", default="loop", choices=("loop", "thread"), help="the native engine's driver")
    o.add_argument("--engine", default="native", choices=("native", "instant"),
                   help="native: the demo's model on the native engine | instant: an engine that answers at once "
                        "(the gateway's own CPU per request, the model's time taken out)")
    s = sub.add_parser("step")
    s.add_argument("--json", required=True)
    s.add_argument("--model", required=True, help="the warm start both recipes train from (runs/demo/sft/hf)")
    s.add_argument("--steps", type=int, default=6)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("overrides", nargs="*", help="overrides for both recipes")
    c = sub.add_parser("_clients", help="(internal) the OpenAI clients' process of `overhead --clients process`")
    c.add_argument("--socket", default=None)
    c.add_argument("--url", default=None)
    c.add_argument("--agents", type=int, default=64)
    for sp in (o, c):
        sp.add_argument("--client", default="openai", choices=("openai", "http"),
                        help="openai: the OpenAI SDK (its own request/response work is timed too) | http: the same "
                             "JSON over the same HTTP pool, without the SDK (the gateway's own cost)")
    args = ap.parse_args()
    if args.what in ("_clients", "overhead"):
        CLIENT_KIND["sdk"] = args.client == "openai"
    if args.what == "_clients":
        return clients_main(args)
    if args.model is not None and not Path(args.model, "config.json").is_file():
        raise SystemExit(f"--model {args.model}: not a Hugging Face model directory (no config.json); "
                         "leave it out for the demo's base model, built for the run")
    with tempfile.TemporaryDirectory(prefix="hybridrl-gateway-bench-") as tmp:
        if args.what == "overhead" and args.model is None:
            args.model = build_base_model(Path(tmp) / "model")
        result = overhead(args) if args.what == "overhead" else step(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_repeat", "runs")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
