"""LoRA + MoE + routing replay: the KL reference routes on its own, whether it is the LoRA actor's base
(adapters off, the actor's own routers) or a separate reference model (no replay installed).

Before: the LoRA base ran the actor's forward with the actor's replay mode ("rollout"), so its
reference logprobs replayed the rollout's routes while a separate reference routed itself: the KL
target depended on whether LoRA was on. What is checked here is the routers' replay mode during the
base's forward and after it (the real `BaseModel` and `moe.own_routing` over stand-in routers)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core")


class _Model:
    """Stands in for the GPTModel: `routers` are the replay hooks `moe.attach` installs."""

    def __init__(self, routers: int, **fields):
        from hybridrl.backends.megatron import moe

        self.__dict__.update(fields)
        self.routers = [SimpleNamespace(mode="rollout") for _ in range(routers)]
        moe.attach(self, self.routers)


class _Actor:
    """Stands in for the LoRA MegatronEngine: records the routers' replay mode at each forward."""

    def __init__(self):
        self.model = _Model(2, lora=SimpleNamespace(enabled=True))
        self.device, self.mesh, self.head = "cpu", None, "lm"
        self.passes = {"logprobs": 0, "train": 0}
        self.seen: list[tuple[bool, list[str]]] = []

    def compute_logprobs(self, batch, **kwargs):
        self.passes["logprobs"] += 1
        self.seen.append((self.model.lora.enabled, [h.mode for h in self.model.routers]))
        return {"logprobs": None}

    def compute_logits(self, batch):
        return self.compute_logprobs(batch)


def test_the_lora_base_reference_routes_on_its_own_and_the_actor_keeps_replaying():
    from hybridrl.backends.megatron.lora import BaseModel

    actor = _Actor()
    reference = BaseModel(actor)
    reference.compute_logprobs(None, temperature=1.0)
    reference.compute_logits(None)
    actor.compute_logprobs(None)                                   # the actor's own (old-logprob) forward
    assert actor.seen == [(False, ["off", "off"]), (False, ["off", "off"]), (True, ["rollout", "rollout"])]
    assert reference.passes["logprobs"] == 1


def test_own_routing_restores_the_mode_after_an_error():
    from hybridrl.backends.megatron import moe

    model = _Model(1)
    with pytest.raises(RuntimeError):
        with moe.own_routing(model):
            assert model.routers[0].mode == "off"
            raise RuntimeError("forward failed")
    assert model.routers[0].mode == "rollout"
