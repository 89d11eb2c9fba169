"""The update group forms from inside a torchrun rank: its store is the group's own, not torchrun's agent store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.parallel.rendezvous import reserved_port

REPO = Path(__file__).resolve().parents[2]
MEMBER = """
import sys, torch
from pipeline.parallel.weight_transfer import UpdateGroup
rank, port = int(sys.argv[1]), int(sys.argv[2])
group = UpdateGroup.join(master_address="127.0.0.1", master_port=port, rank=rank, world_size=2, name="weights",
                         backend="gloo", timeout_s=20)
tensor = torch.arange(4.0) if rank == 0 else torch.zeros(4)
group.broadcast([tensor])
group.destroy()
print(tensor.tolist())
"""


def test_rank_0_of_a_torchrun_job_hosts_the_update_group_store() -> None:
    with reserved_port() as port:
        # What torchrun puts in every rank's environment: c10d's rendezvous would then make rank 0 a store client.
        torchrun_env = {**os.environ, "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0",
                        "PYTHONPATH": str(REPO)}
        trainer = subprocess.Popen([sys.executable, "-c", MEMBER, "0", str(port)], env=torchrun_env,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        server = subprocess.Popen([sys.executable, "-c", MEMBER, "1", str(port)],
                                  env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        outputs = [process.communicate(timeout=60) for process in (trainer, server)]
        assert [process.returncode for process in (trainer, server)] == [0, 0], outputs
        assert [out.strip() for out, _ in outputs] == ["[0.0, 1.0, 2.0, 3.0]"] * 2
