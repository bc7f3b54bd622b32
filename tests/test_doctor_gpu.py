"""`hybridrl doctor` says which NVIDIA driver the SGLang backend needs (sglang 0.5.21: CUDA 13,
driver >= 580.65.06) against the one it finds; with sglang installed, an older one is a problem."""

from __future__ import annotations

from hybridrl import doctor


def test_the_driver_sglang_needs():
    assert doctor.sglang_driver_problem("580.65.06") is None and doctor.sglang_driver_problem("590.44.01") is None
    old = doctor.sglang_driver_problem("575.57.08")
    assert old.startswith("NVIDIA driver 575.57.08 is older than 580.65.06") and "rollout.engine=native" in old
    assert "needs a GPU and driver >= 580.65.06" in doctor.sglang_driver_problem(None)


def test_an_old_driver_is_a_problem_only_with_sglang_installed(monkeypatch):
    monkeypatch.setattr(doctor, "nvidia_driver", lambda: "550.54.15")
    assert doctor.gpu_stack("0.5.21")["ok"] is False
    stack = doctor.gpu_stack(None)
    assert stack["ok"] is True and stack["nvidia_driver"] == "550.54.15" and "older than" in stack["problem"]
    monkeypatch.setattr(doctor, "nvidia_driver", lambda: "580.95.05")
    assert doctor.gpu_stack("0.5.21") == {"nvidia_driver": "580.95.05", "sglang": "0.5.21", "problem": None,
                                          "ok": True}
