"""The `replicas` knobs of the rollout section: where the replica servers are and how long to wait for them.

Import-light on purpose (no torch): the config schema imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from hybridrl.backends.native.config import DTYPES
from hybridrl.config.fields import ConfigValueError, check_choice, check_positive, knob


@dataclass(kw_only=True)
class ReplicasConfig:
    """Rollout replicas: native engines in processes of their own (`hybridrl replica`), outside the training
    ranks' process group, reached over HTTP."""

    dtype: str = knob("auto", "the dtype the replicas hold the weights in (each one's rollout.native.dtype, the same "
                              "values; a replica in another is refused when it joins): auto | float32 | bfloat16 | "
                              "float16; auto = float32 on CPU, bfloat16 on CUDA, decided by distributed.device")
    urls: list[str] = knob(
        help="replica base URLs known at start (http://host:port); a URL that stops answering is dropped, and a "
             "process answering there again later joins at the next publication", factory=list)
    registry: str = knob("${run.dir}/replicas", "the directory replicas register in (`hybridrl replica --registry "
                                                "DIR` writes one JSON file there); empty: urls only")
    min_live: int = knob(1, "replicas the run waits for (up to wait_s) at its start and at each publication; past "
                            "wait_s it goes on with those that answer (a warning), with none it stops")
    wait_s: float = knob(60.0, "how long to wait for min_live replicas at the start and at each publication")
    connect_timeout_s: float = knob(2.0, "connecting to a replica: past it the replica counts as lost")
    request_timeout_s: float = knob(300.0, "one generation or weight upload: a replica that answers nothing past it "
                                           "counts as lost (its request goes to another replica)")

    def __post_init__(self) -> None:
        check_choice("dtype", self.dtype, DTYPES)
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ConfigValueError("urls", f"{url!r} is not a replica URL: write http://HOST:PORT (what "
                                               "`hybridrl replica` prints when it starts)")
        check_positive("min_live", self.min_live)
        check_positive("wait_s", self.wait_s, allow_zero=True)
        check_positive("connect_timeout_s", self.connect_timeout_s)
        check_positive("request_timeout_s", self.request_timeout_s)
        if not self.urls and not self.registry:
            raise ConfigValueError("registry", "rollout.engine=replicas needs a way to find its replicas: set "
                                               "rollout.replicas.urls=[http://HOST:PORT,...] or a registry directory")
