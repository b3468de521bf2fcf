"""The host memory the offload may take respects the process's control groups (SLURM, Kubernetes, containers), not
only ``/proc/meminfo``: cgroup v2 and v1 layouts written in a temporary directory, limits above the process's group
included."""

from __future__ import annotations

from pathlib import Path

from tiledmlp.offload import host, host_memory
from tiledmlp.offload.host_memory import cgroup_free_bytes

GiB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_of_the_group_and_above(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/job/step\n")
    root = tmp_path / "fs"
    _write(root / "job" / "step" / "memory.max", "max\n")
    _write(root / "job" / "step" / "memory.current", str(1 * GiB))
    _write(root / "job" / "memory.max", str(8 * GiB))  # the job's limit binds its steps
    _write(root / "job" / "memory.current", str(3 * GiB))
    assert cgroup_free_bytes(str(proc), str(root)) == 5 * GiB


def test_cgroup_v1_limit_and_unlimited(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "4:memory:/pod/container\n3:cpu:/pod\n")
    memory = tmp_path / "fs" / "memory"
    _write(memory / "pod" / "container" / "memory.limit_in_bytes", str(16 * GiB))
    _write(memory / "pod" / "container" / "memory.usage_in_bytes", str(10 * GiB))
    _write(memory / "memory.limit_in_bytes", "9223372036854771712")  # the root: no limit
    _write(memory / "memory.usage_in_bytes", str(40 * GiB))
    assert cgroup_free_bytes(str(proc), str(tmp_path / "fs")) == 6 * GiB


def test_no_limit_and_no_cgroups(tmp_path):
    proc = tmp_path / "cgroup"
    _write(proc, "0::/\n")
    _write(tmp_path / "fs" / "memory.max", "max\n")
    _write(tmp_path / "fs" / "memory.current", "123\n")
    assert cgroup_free_bytes(str(proc), str(tmp_path / "fs")) is None
    assert cgroup_free_bytes(str(tmp_path / "missing"), str(tmp_path / "fs")) is None


def test_available_is_the_smaller_of_the_system_and_the_group(monkeypatch):
    monkeypatch.setattr(host_memory, "cgroup_free_bytes", lambda: 2 * GiB)
    assert host_memory.available_host_bytes() <= 2 * GiB
    monkeypatch.setattr(host_memory, "cgroup_free_bytes", lambda: None)
    assert host_memory.available_host_bytes() > 0
    assert host.available_host_bytes is host_memory.available_host_bytes  # what the offload's check reads
