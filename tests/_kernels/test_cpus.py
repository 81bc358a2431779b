"""The kernels' default thread count (onnxkv._kernels._cpus): OMP_NUM_THREADS,
the affinity mask and the cgroup CPU quota, read from fake cgroup trees."""

import math
import os

import pytest

import onnxkv._kernels as K
from onnxkv._kernels import _cpus as C

V2 = "0::/{path}\n"
V1 = "12:memory:/{path}\n4:cpu,cpuacct:/{path}\n0::/\n"


def tree(tmp_path, membership, files):
    """A fake /sys/fs/cgroup (files: {relative path: content}) and /proc/self/cgroup; returns (root, self_cgroup)."""
    root = tmp_path / "cgroup"
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content)
    root.mkdir(exist_ok=True)
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(membership)
    return root, self_cgroup


@pytest.mark.parametrize(
    "value,want",
    [
        ("3", 3),
        (" 3 ", 3),
        ("4,2", 4),
        ("1", 1),
        (str(1 << 20), C.MAX_THREADS),
        ("", None),
        ("0", None),
        ("-2", None),
        ("+2", None),
        ("two", None),
        ("2.5", None),
        ("2 2", None),
        (",2", None),
    ],
)
def test_omp_num_threads(value, want):
    assert C.omp_num_threads({"OMP_NUM_THREADS": value}) == want
    assert C.omp_num_threads({}) is None


@pytest.mark.parametrize(
    "content,want",
    [
        ("max 100000\n", None),
        ("150000 100000\n", 1.5),
        ("50000 100000", 0.5),
        ("400000 100000", 4.0),
        ("", None),
        ("garbage", None),
        ("100000", None),
        ("-1 100000", None),
        ("100000 0", None),
    ],
)
def test_cgroup_v2_cpu_max(tmp_path, content, want):
    root, me = tree(tmp_path, V2.format(path=""), {"cpu.max": content})
    assert C.cgroup_cpu_quota(root, me) == want


def test_cgroup_v2_smallest_quota_of_the_cgroup_and_its_ancestors(tmp_path):
    root, me = tree(
        tmp_path,
        V2.format(path="a/b/c"),
        {"a/cpu.max": "200000 100000", "a/b/cpu.max": "max 100000", "a/b/c/cpu.max": "300000 100000"},
    )
    assert C.cgroup_cpu_quota(root, me) == 2.0


def test_cgroup_folders_that_do_not_exist_are_skipped(tmp_path):
    """In a container, /proc/self/cgroup names the host's path and the container's cgroup is the mount's root."""
    root, me = tree(tmp_path, V2.format(path="system.slice/docker-1.scope"), {"cpu.max": "250000 100000"})
    assert C.cgroup_cpu_quota(root, me) == 2.5


@pytest.mark.parametrize(
    "quota,period,want",
    [("150000", "100000", 1.5), ("-1", "100000", None), ("x", "100000", None), ("100000", "", None)],
)
def test_cgroup_v1_cfs_quota(tmp_path, quota, period, want):
    root, me = tree(
        tmp_path,
        V1.format(path="user.slice"),
        {
            "cpu/user.slice/cpu.cfs_quota_us": quota,
            "cpu/user.slice/cpu.cfs_period_us": period,
            "memory/user.slice/cpu.cfs_quota_us": "1000 100000",
        },
    )  # not the cpu controller's: ignored
    assert C.cgroup_cpu_quota(root, me) == want


def test_no_cgroup_files_no_quota(tmp_path):
    assert C.cgroup_cpu_quota(tmp_path / "none", tmp_path / "none") is None
    root, me = tree(tmp_path, "garbage line\n1:name=systemd:/\n", {})
    assert C.cgroup_cpu_quota(root, me) is None


def test_default_threads_omp_num_threads_wins(tmp_path):
    root, me = tree(tmp_path, V2.format(path=""), {"cpu.max": "100000 100000"})
    assert C.default_threads({"OMP_NUM_THREADS": "6"}, root, me, affinity=2) == 6


def test_default_threads_affinity_within_the_quota(tmp_path):
    root, me = tree(tmp_path, V2.format(path=""), {"cpu.max": "150000 100000"})
    assert C.default_threads({}, root, me, affinity=8) == 2  # 1.5 CPUs: rounded up
    assert C.default_threads({}, root, me, affinity=1) == 1  # the mask is smaller
    assert C.default_threads({"OMP_NUM_THREADS": "0"}, root, me, affinity=8) == 2  # invalid: ignored
    root, me = tree(tmp_path / "small", V2.format(path=""), {"cpu.max": "10000 100000"})
    assert C.default_threads({}, root, me, affinity=8) == 1  # 0.1 CPU: still one thread
    root, me = tree(tmp_path / "none", V2.format(path=""), {"cpu.max": "max 100000"})
    assert C.default_threads({}, root, me, affinity=8) == 8


def test_process_default_is_default_threads():
    """The kernels' process default (read at import) is this machine's default_threads()."""
    want = C.default_threads()
    quota = C.cgroup_cpu_quota()
    assert K.KernelSettings().threads == want
    if "OMP_NUM_THREADS" not in os.environ:
        assert want <= len(os.sched_getaffinity(0))
        assert quota is None or want <= math.ceil(quota)
