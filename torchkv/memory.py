"""Process memory: resettable peak resident set size (Linux `VmHWM`), and CUDA peak allocation."""

import resource
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss() -> int:
    """Resident set size now, in bytes."""
    kib = _status_kib("VmRSS")
    return -1 if kib is None else kib * 1024


def reset_peak() -> bool:
    """Reset the peak counters (RSS high-water mark, CUDA peak); False where the RSS peak cannot be reset."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident set size since `reset_peak`, in bytes (the process lifetime peak where unsupported)."""
    kib = _status_kib("VmHWM")
    if kib is None:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib * 1024
