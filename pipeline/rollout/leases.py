"""Weight-load leases: the trainer tells the supervisor of a server's node that the server is busy loading weights.

A server loading weights answers no ``/health_generate`` (its scheduler is inside the load: about a
minute for a 7B folder from shared storage, more when eight servers read it at once), exactly like a
hung one, and the supervisor (``pipeline.rollout.supervise``) would kill it mid-load. Only the
trainer's client knows that it asked the server to load: before each load from disk, and for the
whole of a streamed update's session, it writes a lease file for the server into a folder both
sides read (under the shared ``rollout.weights_dir``), and removes it when the call ends. While a
server holds an unexpired lease the supervisor does not count its failed probes; its hang window
starts again when the lease ends.

A lease names a wall-clock deadline, so one left behind by a trainer killed mid-load shields a
server for at most that long. The deadline is the longest the client itself keeps waiting (its
admin timeout times its attempts): past it the client has given up on the server, so the supervisor
may too. Trainer and rollout nodes of one cluster keep their clocks within seconds of each other;
the deadlines are minutes.

Cost: one small JSON file per server being loaded, written when the load starts and at every bucket
of a streamed update (a few hundred bytes each); one ``stat`` and read per failed probe on the
supervisor's side.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlparse

from pipeline.io import atomic_write_json

__all__ = ["LOAD_LEASES_DIRNAME", "WeightLoadLeases", "load_leases_dir"]

# The leases' folder inside the weights folder that trainer and servers share; the dot keeps it apart from
# the exports (``v<N>``) and their staging folders (``.v<N>.staging``).
LOAD_LEASES_DIRNAME = ".loading"


def load_leases_dir(weights_dir: str | os.PathLike[str]) -> Path:
    """The lease folder of the servers that load from (or stream next to) ``weights_dir``."""
    return Path(weights_dir) / LOAD_LEASES_DIRNAME


class WeightLoadLeases:
    """The lease files in ``folder``, one per server URL (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    def path(self, url: str) -> Path:
        """``<folder>/<host>_<port>.json``: the server's address, in characters every filesystem takes."""
        address = urlparse(url).netloc or url
        return self.folder / (re.sub(r"[^A-Za-z0-9.-]", "_", address) + ".json")

    def hold(self, urls: Iterable[str], *, seconds: float) -> None:
        """Lease the servers at ``urls`` for ``seconds`` from now (a later call renews the deadline)."""
        until = time.time() + seconds
        for url in urls:
            atomic_write_json(self.path(url), {"url": url, "until": until, "pid": os.getpid()})

    def release(self, urls: Iterable[str]) -> None:
        for url in urls:
            self.path(url).unlink(missing_ok=True)

    def active(self, url: str) -> bool:
        """Whether the server at ``url`` holds an unexpired lease (an unreadable file counts as none)."""
        try:
            lease = json.loads(self.path(url).read_text(encoding="utf-8"))
            return float(lease["until"]) > time.time()
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False
