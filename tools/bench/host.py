"""What the figures were measured on: the host's CPUs and their identity, torch's threads and
the variables that size them, and the commit of the code measured."""
import glob
import os
import subprocess
import sys

import torch

from bench import ROOT


def host_facts():
    """What makes A's figure move between machines of one kind: A is many tiny torch calls per
    sample, so its speed follows torch's thread pools (each call may wake them) and the BLAS
    and OpenMP variables that size them, and the CPU a process may use (affinity, cgroup
    quota) rather than the host's core count; the with-workers figures also depend on seeing
    the workers at all (/proc/<pid>/task/*/children, or the ppid scan that replaces it). The
    CPU's identity (`cpu_identity`) and the steal each run records may tell a slower machine from
    slower code when two records are compared."""
    def cgroup_quota():
        try:
            with open("/sys/fs/cgroup/cpu.max") as f:
                quota, period = f.read().split()
            return None if quota == "max" else round(int(quota) / int(period), 2)
        except (OSError, ValueError):
            return None
    env = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_AFFINITY", "OMP_PROC_BIND")
    return {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "cgroup_cpus": cgroup_quota(),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads(),
            "env": {k: os.environ.get(k) for k in env},
            "proc_children": bool(glob.glob(f"/proc/{os.getpid()}/task/*/children")),
            "loadavg_at_start": os.getloadavg(), "torch": torch.__version__, "python": sys.version.split()[0],
            **cpu_identity()}


CPU_FIELDS = ("model name", "vendor_id", "cpu family", "model", "stepping", "microcode", "cache size",
              "CPU implementer", "CPU part", "CPU variant", "CPU revision")  # x86's, then ARM's; not the moving clock


def cpu_identity(text=None, max_khz=None):
    """{"cpu": the first processor's CPU_FIELDS found in /proc/cpuinfo, as text, plus its
    highest clock in kHz from cpufreq where the kernel gives one}; an empty dict where nothing
    can be read. The model name alone ("AMD EPYC") does not tell two hosts apart; the family,
    model, stepping, microcode and cache, or ARM's implementer and part, may."""
    found = {}
    try:
        if text is None:
            with open("/proc/cpuinfo", errors="replace") as f:
                text = f.read(1 << 16)
    except OSError:
        text = ""
    for line in text.replace("\r\n", "\n").split("\n\n")[0].splitlines():
        name, _, value = line.partition(":")
        if name.strip() in CPU_FIELDS and value.strip():
            found.setdefault(name.strip(), value.strip())
    try:
        if max_khz is None:
            with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
                max_khz = f.read()
        if int(max_khz) > 0:
            found["max kHz"] = str(int(max_khz))
    except (OSError, ValueError):
        pass
    return {"cpu": found}


def git_state():
    """The commit and any uncommitted change under pipeline/ or tools/: the figures belong to that
    code, and to the harness that measured them."""
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except OSError:
            return ""
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": git("status", "--porcelain", "--untracked-files=no", "--", "pipeline", "tools").splitlines()}
