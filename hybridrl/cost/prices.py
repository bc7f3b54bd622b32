"""Prices (configs/prices.yaml) and the money of a run's books: money follows time.

    device     every device-second of the books (busy or idle) x device_hour[kind] / 3600
    cpu        the seconds the episodes spent in tools and environment steps x cpu_hour / 3600
    tools      calls x tool_call[name] (tool_call.default for a tool not listed)
    storage    bytes the run keeps (ledger, checkpoints, export, logs) / 1e9 x gb_stored
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridrl.cost.accounting import Books
from hybridrl.cost.records import MALFORMED

DEFAULT_PRICES = Path(__file__).resolve().parents[2] / "configs" / "prices.yaml"


class PriceError(ValueError):
    """A price table that cannot be used: one line naming the key and the fix."""


@dataclass
class Prices:
    currency: str
    device_hour: dict[str, float]
    cpu_hour: float
    tool_call: dict[str, float]
    gb_stored: float
    source: str

    def device_rate(self, kind: str) -> float:
        if kind not in self.device_hour:
            raise PriceError(f"{self.source}: no device_hour.{kind} (kinds listed: {', '.join(self.device_hour)}); "
                             f"add it or pass --device-kind")
        return float(self.device_hour[kind])

    def tool_rate(self, name: str) -> float:
        return float(self.tool_call.get(name, self.tool_call.get("default", 0.0)))


def load_prices(path: str | Path | None = None) -> Prices:
    import yaml

    path = Path(path) if path else DEFAULT_PRICES
    if not path.exists():
        raise PriceError(f"price table {path} not found (pass --prices FILE; the shipped one is configs/prices.yaml)")
    raw: Any = yaml.safe_load(path.read_text()) or {}
    known = {"currency", "device_hour", "cpu_hour", "tool_call", "gb_stored"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise PriceError(f"{path}: unknown key '{unknown[0]}' (known: {', '.join(sorted(known))})")
    for key in ("device_hour", "tool_call"):
        if not isinstance(raw.get(key, {}), dict):
            raise PriceError(f"{path}: '{key}' must map names to prices, got {raw[key]!r}")
    try:
        prices = Prices(currency=str(raw.get("currency", "USD")),
                        device_hour={str(k): float(v) for k, v in (raw.get("device_hour") or {}).items()},
                        cpu_hour=float(raw.get("cpu_hour", 0.0)),
                        tool_call={str(k): float(v) for k, v in (raw.get("tool_call") or {}).items()},
                        gb_stored=float(raw.get("gb_stored", 0.0)), source=str(path))
    except (TypeError, ValueError) as err:
        raise PriceError(f"{path}: every price must be a number ({err})") from None
    if not prices.device_hour:
        raise PriceError(f"{path}: 'device_hour' lists no device kind (add e.g. cpu: 0.05)")
    return prices


def device_kind(books: Books, override: str | None = None) -> str:
    if override:
        return override
    return "cpu" if books.device == "cpu" else "gpu"


def money(books: Books, prices: Prices, kind: str) -> dict[str, Any]:
    """The books in money: by stage family, and the run's totals."""
    rate = prices.device_rate(kind)
    by_stage = {stage: s / 3600 * rate for stage, s in books.stage_totals().items()}
    env = books.environment or {}
    cpu = (env.get("tool_s", 0.0) + env.get("env_s", 0.0)) / 3600 * prices.cpu_hour
    tools = sum(n * prices.tool_rate(name) for name, n in (env.get("tool_calls") or {}).items() if name != MALFORMED)
    storage = sum(books.stored_bytes.values()) / 1e9 * prices.gb_stored
    device = sum(by_stage.values())
    total = device + cpu + tools + storage
    admitted = books.tokens.get("admitted", 0.0)
    successes = books.episodes.get("successes", 0)
    lost = sum(v for k, v in by_stage.items() if k.startswith("lost/"))
    return {"currency": prices.currency, "device_kind": kind, "device_hour": rate, "device": device,
            "by_stage": by_stage, "environment_cpu": cpu, "tool_calls": tools, "storage": storage, "total": total,
            "lost_to_faults": lost,
            "per_admitted_token": total / admitted if admitted else None,
            "per_million_admitted_tokens": total / admitted * 1e6 if admitted else None,
            "per_verified_success": total / successes if successes else None,
            "prices": prices.source}
