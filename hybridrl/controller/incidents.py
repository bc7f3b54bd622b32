"""Incidents: rules over each step's metrics on the controller, each with an action (`incidents` section).

    rule        fires when                                                               default action
    nan         the update's loss or gradient norm is NaN or infinite                     stop
    mismatch    the rollout/trainer logprob mismatch (mismatch/mean_abs, nats per token)  warn
                is above incidents.mismatch_max
    drop        incidents.drop_metric (val/accuracy) fell more than incidents.drop_by     warn
                below its best over the last incidents.drop_window evaluations
    kl          the KL to the reference (`kl`) is above incidents.kl_max                  warn
    all_failed  every episode of the step failed outside the policy's answer (an agent    warn
                error or an infrastructure fault)

Actions: `off`; `warn`, one line on the console naming the knobs most likely at fault; `stop`, a
clean stop that resumes (the same command continues from the newest complete checkpoint, as after
Ctrl-C; the incident's step is not checkpointed); `rollback`, the run goes back to its newest
complete checkpoint (always one written before the incident: a step's checkpoint comes after its
checks) and goes on from there, its learning rate multiplied by `incidents.rollback_lr_scale`;
after `incidents.max_rollbacks` rollbacks in one process, or without a checkpoint to go back to,
a rollback is a stop. A rollback happens inside the running process, so it needs the colocated
placement with `trainer.rollout_mode=sync` (no episode in flight across steps); elsewhere the config
is refused at load time. Every incident is an event of kind `incident` in the run ledger (`hybridrl
inspect RUN` lists the events), with its rule, step, action and evidence.

The rules run twice a step: after the update (nan, mismatch, kl, all_failed: before any
validation runs on a policy they condemn) and after the validation (drop); a rule fires at most
once per step. Import-light: the config section is read at load time.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, knob

ACTIONS = ("off", "warn", "stop", "rollback")
_SEVERITY = {"off": 0, "warn": 1, "rollback": 2, "stop": 3}


@dataclass(kw_only=True)
class IncidentsConfig:
    """Rules over each step's metrics and what each does when it fires."""

    nan: str = knob("stop", "NaN or infinite loss / gradient norm: off | warn | stop | rollback")
    mismatch: str = knob("warn", "rollout/trainer logprob mismatch above mismatch_max: off | warn | stop | rollback")
    mismatch_max: float = knob(0.1, "the bound on mismatch/mean_abs (mean |trainer - rollout logprob| per policy "
                                    "token, nats)")
    drop: str = knob("warn", "drop_metric fell more than drop_by below its best: off | warn | stop | rollback")
    drop_metric: str = knob("val/accuracy", "the metric the drop rule watches (any metrics.jsonl key; higher is "
                                            "better), e.g. val/accuracy or reward/mean")
    drop_by: float = knob(0.2, "the fall from the best that fires the drop rule (in the metric's units: 0.2 = 20 "
                               "points of accuracy)")
    drop_window: int = knob(0, "the best is taken over this many earlier evaluations of drop_metric; 0 = all")
    kl: str = knob("warn", "KL to the reference above kl_max: off | warn | stop | rollback")
    kl_max: float = knob(1.0, "the bound on the update's KL to the reference (`kl`, nats per token)")
    all_failed: str = knob("warn", "every episode of a step failed (agent error or infrastructure): off | warn | "
                                   "stop | rollback")
    rollback_lr_scale: float = knob(1.0, "rollback: multiply the learning rate by this at each rollback (1 = "
                                         "unchanged), e.g. 0.5")
    max_rollbacks: int = knob(2, "rollback: at most this many in one process; the next incident asking for one stops "
                                 "the run")

    def __post_init__(self) -> None:
        for rule in RULES:
            check_choice(rule.name, getattr(self, rule.name), ACTIONS)
        for name in ("mismatch_max", "kl_max", "drop_by", "rollback_lr_scale"):
            check_positive(name, getattr(self, name))
        check_positive("drop_window", self.drop_window, allow_zero=True)
        check_positive("max_rollbacks", self.max_rollbacks, allow_zero=True)
        if self.rollback_lr_scale > 1:
            raise ConfigValueError("rollback_lr_scale", f"must be in (0, 1] (a rollback lowers the learning rate or "
                                                        f"keeps it), got {self.rollback_lr_scale}")
        if not self.drop_metric:
            raise ConfigValueError("drop_metric", "name a metric (e.g. val/accuracy), or set incidents.drop=off")

    def action(self, rule: str) -> str:
        return getattr(self, rule)

    def rolling_back(self) -> list[str]:
        """The rules whose action is rollback."""
        return [rule.name for rule in RULES if self.action(rule.name) == "rollback"]


# ------------------------------------------------------------------ the rules: pure functions of metrics


def _not_finite(value: Any) -> bool:
    return value is not None and not math.isfinite(float(value))


def check_nan(cfg: IncidentsConfig, m: dict, history: list) -> dict | None:
    keys = ("loss", "train/grad_norm", "train/grad_norm_max", "critic/loss")
    bad = {k: str(float(m[k])) for k in keys if _not_finite(m.get(k))}     # "nan", "inf": JSON has neither
    return {"values": bad} if bad else None


def check_mismatch(cfg: IncidentsConfig, m: dict, history: list) -> dict | None:
    value = m.get("mismatch/mean_abs")
    if value is None or not float(value) > cfg.mismatch_max:
        return None
    return {"mismatch/mean_abs": float(value), "mismatch/max_abs": m.get("mismatch/max_abs"),
            "bound": cfg.mismatch_max}


def check_kl(cfg: IncidentsConfig, m: dict, history: list) -> dict | None:
    value = m.get("kl")
    if value is None or not float(value) > cfg.kl_max:
        return None
    return {"kl": float(value), "bound": cfg.kl_max}


def check_all_failed(cfg: IncidentsConfig, m: dict, history: list) -> dict | None:
    from hybridrl.controller.diagnosis import all_failed

    if not all_failed(m):
        return None
    return {"episodes": m.get("episodes"), "agent_errors": m.get("episodes/agent_errors", 0.0),
            "infra_invalid": m.get("status/infra_invalid", 0.0)}


def check_drop(cfg: IncidentsConfig, m: dict, history: list[tuple[int, float]]) -> dict | None:
    """`history`: (step, value) of drop_metric at the earlier evaluations, oldest first."""
    value = m.get(cfg.drop_metric)
    earlier = history[-cfg.drop_window:] if cfg.drop_window else history
    if value is None or not earlier:
        return None
    best_step, best = max(earlier, key=lambda sv: sv[1])
    if not best - float(value) > cfg.drop_by:
        return None
    return {"metric": cfg.drop_metric, "value": float(value), "best": best, "best_step": best_step,
            "drop_by": cfg.drop_by, "window": len(earlier)}


@dataclass(frozen=True)
class Rule:
    name: str                     # the rule, and the config knob holding its action
    check: Callable[[IncidentsConfig, dict, list], dict | None]     # the evidence, or None
    says: Callable[[dict], str]   # what happened, from the evidence
    knobs: str                    # what to change


RULES = (
    Rule("nan", check_nan, lambda e: "non-finite " + ", ".join(f"{k}={v}" for k, v in e["values"].items()),
         "lower train.lr, keep train.clip_grad > 0, use train.dtype=float32 or bfloat16 rather than float16, check "
         "the task's reward scale"),
    Rule("mismatch", check_mismatch,
         lambda e: f"rollout/trainer mismatch mismatch/mean_abs={e['mismatch/mean_abs']:.4g} > {e['bound']:g}",
         "make the engine and the trainer agree (the same train.dtype and rollout dtype, publish.verify), bound "
         "the correction (algo.tis_cap, algo.mis), or raise incidents.mismatch_max"),
    Rule("kl", check_kl, lambda e: f"KL to the reference {e['kl']:.4g} > {e['bound']:g}",
         "raise algo.kl_coef, lower train.lr, or tighten algo.clip_low / algo.clip_high"),
    Rule("all_failed", check_all_failed,
         lambda e: (f"every episode failed ({e['episodes']:.0f}: {e['agent_errors']:.0f} agent errors, "
                    f"{e['infra_invalid']:.0f} infrastructure-invalid)"),
         "see `hybridrl inspect RUN_DIR --failed` for each episode's error (the agent, tools, engine or verifier)"),
    Rule("drop", check_drop,
         lambda e: (f"{e['metric']} fell to {e['value']:.4g} from its best {e['best']:.4g} (step {e['best_step']}), "
                    f"more than {e['drop_by']:g}"),
         "lower train.lr, raise algo.kl_coef, fewer algo.ppo_epochs, or set incidents.drop=rollback with "
         "incidents.rollback_lr_scale=0.5"),
)
RULE = {r.name: r for r in RULES}


@dataclass(frozen=True)
class Incident:
    rule: str
    step: int
    action: str                   # what the rule asks for (off rules never fire)
    evidence: dict
    text: str                     # one line: what happened, then the knobs

    def record(self, **taken: Any) -> dict:
        """The ledger's detail of this incident, with what was done about it."""
        return {"rule": self.rule, "action": self.action, "evidence": self.evidence, "text": self.text, **taken}


@dataclass
class IncidentWatch:
    """The rules' state over a run: the history of drop_metric (fed by the run's logged steps, the step-0
    validation and a resumed run's earlier rows included), which rules fired at which step, and the
    rollbacks this process made. A run observer (`on_start`, `on_step`) plus `check(step, metrics)`."""

    cfg: IncidentsConfig
    say: Callable[[str], None] = field(default=lambda text: print(text, file=sys.stderr, flush=True))
    history: list = field(default_factory=list)          # (step, drop_metric value), oldest first
    fired: set = field(default_factory=set)              # (step, rule)
    rollbacks: int = 0

    def on_start(self, run: dict) -> None:
        self.history = []
        for row in run.get("earlier_metrics", []):
            self.on_step(int(row["step"]), row)

    def on_step(self, step: int, metrics: dict) -> None:
        value = metrics.get(self.cfg.drop_metric)
        if value is not None and math.isfinite(float(value)):
            self.history = [(s, v) for s, v in self.history if s != step] + [(step, float(value))]

    def check(self, step: int, metrics: dict) -> list[Incident]:
        """The incidents of `metrics` (step `step`), each rule at most once per step, each said in one line."""
        out = []
        for rule in RULES:
            action = self.cfg.action(rule.name)
            if action == "off" or (step, rule.name) in self.fired:
                continue
            evidence = rule.check(self.cfg, metrics, [(s, v) for s, v in self.history if s < step])
            if evidence is None:
                continue
            self.fired.add((step, rule.name))
            incident = Incident(rule.name, step, action, evidence,
                                f"rl: incident at step {step} ({rule.name}, {action}): {rule.says(evidence)} — "
                                f"{rule.knobs}")
            self.say(incident.text)
            out.append(incident)
        return out

    def rewound(self, step: int) -> None:
        """The run went back to step `step` (a rollback): later steps are done again."""
        self.history = [(s, v) for s, v in self.history if s <= step]
        self.fired = {(s, r) for s, r in self.fired if s <= step}


def decide(incidents: list[Incident]) -> str:
    """The action of a step's incidents: the most severe one asks for."""
    return max((i.action for i in incidents), key=_SEVERITY.__getitem__, default="off")


# ------------------------------------------------------------------ acting on them (the controller)


def respond(run: Any, incidents: list[Incident]) -> bool:
    """Record a step's incidents in the ledger and act: `stop` raises `JobStopped` (resumable);
    `rollback` restores the newest checkpoint and returns True (the loop goes on from it)."""
    if not incidents:
        return False
    watch, cfg = run.hooks.incidents, run.cfg.incidents
    step, action = incidents[0].step, decide(incidents)
    checkpoint = run.checkpoints.latest()
    why = None
    if action == "rollback" and checkpoint is None:
        action, why = "stop", "no complete checkpoint to roll back to"
    elif action == "rollback" and watch.rollbacks >= cfg.max_rollbacks:
        action, why = "stop", f"incidents.max_rollbacks={cfg.max_rollbacks} reached"
    if action == "rollback":
        scale = cfg.rollback_lr_scale
        lr = run.roll_back(checkpoint, lr_scale=scale)
        watch.rollbacks += 1
        watch.rewound(run.step)
        taken = {"taken": "rollback", "checkpoint": str(checkpoint), "resumed_at_step": run.step + 1,
                 "lr_scale": scale, "lr": lr, "rollback": watch.rollbacks}
        _record(run, step, incidents, taken)
        print(f"rl: rolled back to {checkpoint} (step {run.step}) after the incident at step {step}"
              + (f"; learning rate x{scale:g} -> {lr['after']:.3g}" if scale != 1 else ""), flush=True)
        return True
    if action == "stop":
        _record(run, step, incidents, {"taken": "stop", "checkpoint": str(checkpoint) if checkpoint else None,
                                       **({"why": why} if why else {})})
        run.stop_for_incident(step, f"incident at step {step} ({', '.join(i.rule for i in incidents)})"
                              + (f"; {why}" if why else ""))
    _record(run, step, incidents, {"taken": action})
    return False


def _record(run: Any, step: int, incidents: list[Incident], taken: dict) -> None:
    for incident in incidents:
        run.ledger.record_incident(step, incident.record(**taken))
