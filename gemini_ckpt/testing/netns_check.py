"""What a link rate in ``tc`` units means (:func:`parse_rate`), and whether this machine can make
network namespaces at all (:func:`unavailable_reason`): what :mod:`.netns` checks before it
makes anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

from ..errors import ConfigError

_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "bps": 8,
    "kbps": 8 * 10**3,
    "mbps": 8 * 10**6,
    "gbps": 8 * 10**9,
}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$")
_CAP_NET_ADMIN = 12


def parse_rate(text: str | int) -> int:
    """A link rate in ``tc`` units as bits per second: ``"1gbit"`` -> 10**9, ``"10mbit"``,
    ``"500kbit"``, ``"100mbps"`` (bytes), or a bare number of bits per second.

    >>> parse_rate("1gbit"), parse_rate("10mbit"), parse_rate(2_000_000)
    (1000000000, 10000000, 2000000)
    """
    if isinstance(text, int) and not isinstance(text, bool):
        bits = text
    else:
        match = _RATE.match(str(text).lower())
        if not match or match.group(2) not in _UNITS | {"": 1}:
            raise ConfigError(f"link={text!r} is not a rate; write it as tc does: '1gbit', '100mbit', '500kbit'")
        bits = int(float(match.group(1)) * (_UNITS.get(match.group(2)) or 1))
    if bits < 100_000:
        raise ConfigError(f"link={text!r} is {bits} bit/s; a link needs at least 100kbit (e.g. '10mbit')")
    return bits


def unavailable_reason() -> Optional[str]:
    """Why network namespaces can't be made on this machine, or None where they can."""
    if not os.path.isdir("/proc/self/ns") or not os.path.exists("/proc/self/ns/net"):
        return "network namespaces need Linux (/proc/self/ns/net is missing)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the '{tool}' tool is not installed (Debian: apt-get install iproute2)"
    try:
        caps = int(
            next(
                line.split()[1]
                for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("CapEff:")
            ),
            16,
        )
    except (OSError, StopIteration, ValueError):
        caps = 0
    if not caps & (1 << _CAP_NET_ADMIN):
        return "making network namespaces needs CAP_NET_ADMIN (run as root, or grant the capability)"
    probe = f"gckprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None
