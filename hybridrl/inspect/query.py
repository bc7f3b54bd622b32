"""Reading a run's ledger back: selections, and the eight trace questions for one trajectory.

For a trajectory id the answers are:
  policy       which policy (version -> release manifest) and sampler produced every token
  timings      how long each transition took (per turn: queued / prefill / decode, tool, env)
  actions      what the parser read and the authorizer decided for every action
  environment  which environment transitions happened, and which side effects (tools that ran)
  reward       which reward component came from which evaluator
  advantage    how the advantage was computed (estimator, the group's rewards and statistics)
  update       which update consumed the tokens (step, batch row, versions), or why none did
  checkpoint   which release and checkpoint resulted from that update
"""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from hybridrl.store.ledger import connect, ledger_dir

FAILED = ("failed", "infra_invalid", "aborted")


class RunLedger:
    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        if not self.run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir} is not a directory: pass a run directory (run.dir of an RL run)")
        self.db = connect(self.run_dir)
        self.root = ledger_dir(self.run_dir)
        cfg = self.run_dir / "config.json"
        self.config = json.loads(cfg.read_text()) if cfg.exists() else {}
        self._shards: dict[str, Any] = {}
        self._texts: dict[str, dict] = {}

    # ------------------------------------------------------------------ selections

    def steps(self) -> list[dict]:
        return [dict(r) for r in self.db.execute("SELECT * FROM steps ORDER BY step")]

    def releases(self) -> dict[int, dict]:
        """version -> the release (its row, and `published_for`: the step's rollout or the validation after
        its update; rollout when the ledger predates the distinction)."""
        out = {}
        for r in self.db.execute("SELECT * FROM releases ORDER BY version"):
            manifest = json.loads(r["manifest"]) if r["manifest"] else {}
            out[r["version"]] = {**dict(r), "published_for": manifest.get("published_for", "rollout")}
        return out

    def diagnosis(self) -> str | None:
        """Why the run learned nothing, when its metrics show it (`controller/diagnosis.py`)."""
        from hybridrl.controller.diagnosis import diagnose
        from hybridrl.telemetry.metrics import read_metrics

        critic = _needs_critic(self.config.get("algo", {}).get("advantage", "grpo"))
        found = diagnose(read_metrics(self.run_dir), group_baseline=not critic)
        return found.text if found is not None else None

    def evaluations(self, suite: str | None = None) -> list[dict]:
        """Which checkpoint scored what on which suite: one row per (step, suite, source), by step. A
        ledger written before evaluations were recorded has none."""
        try:
            rows = self.db.execute("SELECT * FROM evaluations" + (" WHERE suite = ?" if suite else "")
                                   + " ORDER BY suite, step, source", (suite,) if suite else ()).fetchall()
        except sqlite3.OperationalError:
            return []
        out = []
        for r in rows:
            row = dict(r)
            row["metrics"] = json.loads(row["metrics"])
            out.append(row)
        return out

    def resolve(self, target: str) -> str:
        """A trajectory id, its trace id, or a unique prefix of either -> the trajectory id."""
        rows = self.db.execute("SELECT id FROM trajectories WHERE id = ? OR trace_id = ?", (target, target)).fetchall()
        if not rows:
            rows = self.db.execute("SELECT id FROM trajectories WHERE substr(id, 1, ?) = ? OR substr(trace_id, 1, ?) = ?",
                                   (len(target), target, len(target), target)).fetchall()
        if len(rows) == 1:
            return rows[0]["id"]
        if not rows:
            raise KeyError(f"no trajectory {target!r} in {self.root} (list them with `hybridrl inspect "
                           f"{self.run_dir} --step N`)")
        raise KeyError(f"{target!r} names {len(rows)} trajectories; give more of the id, e.g. {rows[0]['id']!r}")

    def select(self, *, step: int | None = None, failed: bool = False, tool_errors: bool = False,
               lagged: bool = False, reward: float | None = None) -> list[dict]:
        where, args = [], []
        if step is not None:
            where.append("step = ?")
            args.append(step)
        if failed:
            where.append(f"status IN ({', '.join('?' * len(FAILED))})")
            args += FAILED
        if tool_errors:
            where.append("(tool_errors > 0 OR action_errors > 0)")
        if lagged:
            where.append("lag > 0")
        if reward is not None:
            where.append("abs(reward - ?) < 1e-9")
            args.append(reward)
        sql = "SELECT * FROM trajectories" + (" WHERE " + " AND ".join(where) if where else "")
        return [dict(r) for r in self.db.execute(sql + " ORDER BY step, shard_row", args)]

    def summary(self) -> dict:
        steps = self.steps()
        statuses = Counter(r["status"] for r in self.db.execute("SELECT status FROM trajectories"))
        n = sum(statuses.values())
        consumed = self.db.execute("SELECT count(*) FROM trajectories WHERE consumed_step IS NOT NULL").fetchone()[0]
        reasons = Counter(r["filter_reason"] for r in self.db.execute(
            "SELECT filter_reason FROM trajectories WHERE filter_reason IS NOT NULL"))
        data = sum(s["shard_bytes"] for s in steps if not s["pruned"])
        text = sum(s["text_bytes"] for s in steps if not s["pruned"])
        events = [dict(r) for r in self.db.execute("SELECT * FROM events ORDER BY at")]
        return {"run_dir": str(self.run_dir), "steps": len(steps), "trajectories": n, "consumed": consumed,
                "statuses": dict(statuses), "filter_reasons": dict(reasons),
                "releases": list(self.releases().values()),
                "bytes": {"data": data, "text": text,
                          "per_trajectory": (data + text) / n if n else 0.0,
                          "data_per_trajectory": data / n if n else 0.0},
                "pruned_steps": [s["step"] for s in steps if s["pruned"]], "events": events,
                "diagnosis": self.diagnosis(), "evaluations": self.evaluations()}

    # ------------------------------------------------------------------ one trajectory

    def index_row(self, tid: str) -> dict:
        row = self.db.execute("SELECT * FROM trajectories WHERE id = ?", (tid,)).fetchone()
        if row is None:
            raise KeyError(tid)
        return dict(row)

    def data_row(self, index: dict) -> dict | None:
        """The trajectory's data-plane row (None when retention deleted its shard)."""
        step = self.db.execute("SELECT shard, text_shard, pruned FROM steps WHERE step = ?", (index["step"],)).fetchone()
        if step is None or step["pruned"]:
            return None
        if step["shard"] not in self._shards:
            import pyarrow.parquet as pq

            self._shards[step["shard"]] = pq.read_table(self.root / "data" / step["shard"]).to_pylist()
        row = dict(self._shards[step["shard"]][index["shard_row"]])
        for key in ("rewards", "reward_evaluators", "timings", "tool_calls", "trace", "metadata"):
            row[key] = json.loads(row[key])
        row["text"] = None
        if step["text_shard"]:
            if step["text_shard"] not in self._texts:
                lines = (self.root / "text" / step["text_shard"]).read_text().splitlines()
                self._texts[step["text_shard"]] = {r["id"]: r for r in map(json.loads, lines)}
            row["text"] = self._texts[step["text_shard"]].get(index["id"])
        return row

    def explain(self, tid: str) -> dict:
        """The eight answers for one trajectory (see the module doc)."""
        index = self.index_row(tid)
        data = self.data_row(index)
        step = self.db.execute("SELECT * FROM steps WHERE step = ?", (index["step"],)).fetchone()
        releases = self.releases()
        out: dict[str, Any] = {"id": tid, "trace_id": index["trace_id"], "step": index["step"],
                               "task_id": index["task_id"], "group_id": index["group_id"],
                               "attempt": index["attempt"], "status": index["status"],
                               "truncation": index["truncation"], "end_reason": index["end_reason"],
                               "reward": index["reward"], "data": "present" if data else "pruned by retention"}
        trace = data["trace"] if data else []
        out["policy"] = self._policy(index, data, trace, releases)
        out["timings"] = self._timings(data, trace)
        out["actions"] = self._actions(trace)
        out["environment"] = {
            "env_steps": [{k: e.get(k) for k in ("turn", "reward", "done", "seconds", "info")}
                          for e in trace if e["span"] == "env_step"],
            "side_effects": [{k: e.get(k) for k in ("turn", "tool", "ok", "error", "latency_s")}
                             for e in trace if e["span"] == "action" and e.get("decision") == "authorized"],
            "observations": [{k: e.get(k) for k in ("turn", "start", "end", "roles")}
                             for e in trace if e["span"] == "observation"]}
        rewards, evaluators = json.loads(index["rewards"]), json.loads(index["evaluators"])
        reward_event = next((e for e in trace if e["span"] == "reward"), {})
        out["reward"] = {"total": index["reward"], "seconds": reward_event.get("seconds"),
                         "components": {k: {"value": v, "evaluator": evaluators.get(k, "?")}
                                        for k, v in rewards.items()}}
        out["advantage"] = (json.loads(index["advantage"]) if index["advantage"]
                            else {"computed": False, "why": f"not admitted to the update: {index['filter_reason']}"})
        if index["consumed_step"] is not None:
            tokens = sum(data["response_mask"]) if data else index["policy_tokens"]
            out["update"] = {"consumed": True, "step": index["consumed_step"], "batch_row": index["batch_row"],
                             "tokens_trained": tokens, "policy_version_before": step["rollout_version"],
                             "policy_version_after": step["version_after"]}
        else:
            out["update"] = {"consumed": False, "filter_reason": index["filter_reason"]}
        out["checkpoint"] = self._checkpoint(index, releases)
        if data:
            out["tokens"] = {"prompt_ids": data["prompt_ids"], "response_ids": data["response_ids"],
                             "mask": data["response_mask"], "versions": data["policy_versions"],
                             "behavior_logprobs": data["behavior_logprobs"], "old_logprobs": data["old_logprobs"],
                             "advantages": data["advantages"]}
            text = data["text"] or {}
            out["text"] = {"prompt": text.get("prompt"), "pieces": text.get("pieces"), "answer": text.get("answer")}
            out["tool_calls"] = data["tool_calls"]
            out["spans"] = [{"kind": e["span"], "turn": e.get("turn", -1), "start": e["start"], "end": e["end"]}
                            for e in trace if e["span"] in ("generate", "observation")]
        return out

    def _policy(self, index: dict, data: dict | None, trace: list, releases: dict) -> dict:
        by_version: Counter = Counter()
        if data:
            by_version.update(v for v, m in zip(data["policy_versions"], data["response_mask"]) if m)
        versions = {}
        for v, n in sorted(by_version.items()):
            rel = releases.get(v)
            versions[v] = {"tokens": n, "release": (
                {"checkpoint_hash": rel["checkpoint_hash"], "training_step": rel["training_step"],
                 "published_at_step": rel["published_at_step"]} if rel else
                ("the initial model (model.path), loaded by the engine at start" if v == 0 else "not recorded"))}
        requests = [{k: e.get(k) for k in ("turn", "request_id", "version", "tokens", "temperature", "top_p", "top_k",
                                           "seed", "sampler_contract", "finish")}
                    for e in trace if e["span"] == "generate"]
        return {"model": self.config.get("model", {}).get("path"), "policy_tokens": index["policy_tokens"],
                "by_version": versions, "lag": index["lag"],
                "sampler_contract": data["sampler_contract"] if data else None, "requests": requests}

    def _timings(self, data: dict | None, trace: list) -> dict:
        turns = []
        for e in trace:
            if e["span"] != "turn":
                continue
            gens = [g for g in trace if g["span"] == "generate" and g.get("turn") == e["turn"]]
            turns.append({"turn": e["turn"], "generate_s": e["generate_s"],
                          "queued_s": sum(g["queued_s"] for g in gens), "prefill_s": sum(g["prefill_s"] for g in gens),
                          "decode_s": sum(g["decode_s"] for g in gens), "tool_s": e["tool_s"], "env_s": e["env_s"],
                          "tokens": sum(g["tokens"] for g in gens)})
        return {"episode": data["timings"] if data else {}, "turns": turns}

    def _actions(self, trace: list) -> list[dict]:
        out = []
        for e in trace:
            if e["span"] == "parse":
                out.append({"turn": e["turn"], "parsed": {k: e[k] for k in ("answer", "num_answers", "calls", "errors")},
                            "decisions": []})
            elif e["span"] == "action" and out:
                out[-1]["decisions"].append({k: e.get(k) for k in ("tool", "decision", "message", "ok", "error",
                                                                   "latency_s") if k in e})
        return out

    def _checkpoint(self, index: dict, releases: dict) -> dict:
        if index["consumed_step"] is None:
            return {"resulted": None, "why": "no update consumed this trajectory"}
        step = self.db.execute("SELECT * FROM steps WHERE step = ?", (index["consumed_step"],)).fetchone()
        version = step["version_after"]
        rel = releases.get(version)
        ckpt = self.db.execute("SELECT step, checkpoint FROM steps WHERE step >= ? AND checkpoint IS NOT NULL "
                               "ORDER BY step LIMIT 1", (index["consumed_step"],)).fetchone()
        out: dict[str, Any] = {"policy_version": version,
                               "release": ({"checkpoint_hash": rel["checkpoint_hash"],
                                            "published_at_step": rel["published_at_step"]} if rel else None)}
        if rel is None:
            out["release_note"] = f"v{version} was not published (the run ended before the next rollout or validation)"
        if ckpt is not None:
            path = Path(ckpt["checkpoint"])
            out["checkpoint"] = {"step": ckpt["step"], "path": str(path),
                                 "complete": (path / "COMPLETE").exists(),
                                 "note": None if (path / "COMPLETE").exists() else "pruned or never completed"}
        else:
            out["checkpoint"] = None
            out["checkpoint_note"] = "no checkpoint was written at or after this update"
        return out


def _needs_critic(advantage: str) -> bool:
    """The run's estimator trains a critic (its row says; False when it cannot be loaded here)."""
    from hybridrl.algo.registry import ESTIMATORS
    from hybridrl.config.fields import ConfigValueError

    try:
        return ESTIMATORS.get(advantage).needs_critic
    except ConfigValueError:
        return False
