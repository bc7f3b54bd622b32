"""Every rank of a rollout group takes the same branch of a publication (publication/agree.py):
two real ranks over gloo, one refusing by its own check (tests/publication/agree_jobs.py)."""

from __future__ import annotations

import json

from tests.launch import run_torchrun


def test_a_refusal_on_one_rank_is_every_ranks_refusal(tmp_path):
    out = tmp_path / "agree.json"
    proc = run_torchrun(["--standalone", "--nproc-per-node=2", "-m", "tests.publication.agree_jobs", str(out)],
                        timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = json.loads(out.read_text())
    for case, refuser in (("owner refuses", 0), ("stand-in refuses", 1)):
        outcomes = [r[case] for r in ranks]
        message = outcomes[0]["outcome"]
        assert message.startswith("refused: publication v") and f"(by rank {refuser})" in message, message
        assert "dtype float32, expected bfloat16" in message            # the refuser's own reason, on both
        assert all(o["outcome"] == message for o in outcomes)            # the same branch, the same words
        assert all(o["gathered"] == 0 for o in outcomes)                 # nobody entered a collective alone
        assert [o["version"] for o in outcomes] == [0, 0]                # nothing moved: nothing to roll back
    both = [r["both accept"] for r in ranks]
    assert all(o["outcome"] == "published" and o["version"] == 3 and o["gathered"] == 1 for o in both)
    # decided alone (no peers): the owner refuses, the stand-in waits in the gather until its timeout
    alone = [r["decided alone"] for r in ranks]
    assert alone[0]["outcome"].startswith("refused:") and alone[0]["gathered"] == 0
    assert alone[1]["outcome"].startswith("error:") and alone[1]["version"] == 0
