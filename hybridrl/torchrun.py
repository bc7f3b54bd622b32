"""`python -m hybridrl.torchrun ARGS`: torchrun's agent (`torch.distributed.run`, the same arguments),
leaving without the interpreter's teardown once its ranks are done (`hybridrl.distributed.process_exit`:
about a second per process that has imported torch). hybridrl's own commands start their ranks through
it; `torchrun ARGS` does the same work, only its exit is slower.
"""

from __future__ import annotations

from hybridrl.distributed.process_exit import run_then_leave


def main() -> None:
    from torch.distributed.run import main as agent

    agent()            # its arguments from sys.argv, as torchrun's


if __name__ == "__main__":
    run_then_leave(main)
