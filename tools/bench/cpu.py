"""CPU time of the whole process tree around one run, and the share of it the hypervisor
took (steal); `measure` times one run with both."""
import gc
import os
import resource
import time

from bench.proc import proc_stat, tree_pids


def cpu_seconds():
    """(this process, all threads; its children that have been waited for) user + system CPU."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def tree_cpu():
    """(this process, the rest of its tree): CPU seconds used so far by the whole process tree.

    A process that exits and is waited for adds its own and its reaped children's time to
    its parent's "children" counters. So this process's getrusage(SELF) + getrusage(CHILDREN),
    plus, for every descendant still present (zombies included), its own time and its reaped
    children's, counts every process exactly once, whoever starts the DataLoader workers:
    forked from here (we reap them) or from a forkserver (it reaps them and lives on).
    """
    (me, kids), rest = cpu_seconds(), 0.0
    for pid in tree_pids(os.getpid())[1:]:
        st = proc_stat(pid)
        rest += st[1] if st else 0.0
    return me, kids + rest


def settle(timeout=10.0):
    """Wait while any descendant is a zombie (exited, not yet reaped); returns the descendants.

    A zombie's time has not yet moved to its parent's counters; reading the tree while it
    is reaped could count it twice or not at all. DataLoader has joined its workers when a
    run ends (the forkserver reaps before it reports the exit), so this returns at once.
    """
    deadline = time.time() + timeout
    while True:
        pids = tree_pids(os.getpid())[1:]
        if all((proc_stat(p) or ("X",))[0] != "Z" for p in pids) or time.time() > deadline:
            return pids
        time.sleep(0.02)


def host_ticks(text=None, cpus=None):
    """{cpu: (stolen, busy)} clock ticks so far of the CPUs this process may run on (`cpus`, by
    default its affinity), from /proc/stat's cpuN lines; None where they cannot be read. On a
    virtual machine, time the hypervisor gave those CPUs to others is steal; where it is not
    accounted as such it lands in the processes' own CPU time, and every samples/cpu-s figure
    drops with it. Busy is user, nice, system, irq and softirq (guest time is already inside
    user and nice); idle and iowait are left out, so an idle CPU does not dilute it. A line
    without the steal column (kernels before 2.6.11) gives no reading: 0 would be made up."""
    try:
        if text is None:
            with open("/proc/stat") as f:
                text = f.read(1 << 20)
        cpus = set(os.sched_getaffinity(0)) if cpus is None else set(cpus)
        found = {}
        for line in text.splitlines():
            name, *fields = line.split() or [""]
            number = name[3:]
            if not (name.startswith("cpu") and number.isascii() and number.isdigit() and int(number) in cpus):
                continue
            t = [int(x) for x in fields[:8]]
            if len(t) < 8 or min(t) < 0 or int(number) in found:
                return None
            found[int(number)] = (t[7], t[0] + t[1] + t[2] + t[5] + t[6])
    except (OSError, ValueError):
        return None
    return found or None


def steal_ticks(before, after):
    """(stolen, busy) ticks between two `host_ticks`, over the CPUs both saw; None when it cannot
    be told: no reading, no CPU in common, or a CPU's counter that went back."""
    if before is None or after is None:
        return None
    common = before.keys() & after.keys()
    deltas = [(after[c][0] - before[c][0], after[c][1] - before[c][1]) for c in common]
    if not deltas or any(d < 0 for pair in deltas for d in pair):
        return None
    return sum(d[0] for d in deltas), sum(d[1] for d in deltas)


def steal_fields(before, after):
    """A run's `steal_share` (stolen / (stolen + busy); None when no tick passed or it cannot be
    told) and the ticks behind it, for pooling over runs."""
    ticks = steal_ticks(before, after)
    if ticks is None or sum(ticks) == 0:
        return {"steal_share": None, "steal_ticks": ticks and ticks[0], "busy_ticks": ticks and ticks[1]}
    return {"steal_share": ticks[0] / sum(ticks), "steal_ticks": ticks[0], "busy_ticks": ticks[1]}


def measure(batches, expected):
    """Run one generator of batch sizes to its end; wall time, CPU time of the tree, samples/s,
    and the share of this process's CPUs' busy time meanwhile that was stolen (`host_ticks`)."""
    gc.collect()
    settle()
    ticks0 = host_ticks()  # outside the timed window: reading /proc/stat is not the run's work
    (m0, r0), t0 = tree_cpu(), time.perf_counter()
    n = sum(batches)
    wall = time.perf_counter() - t0
    helpers = settle()  # what outlives the run, e.g. a forkserver or multiprocessing's resource tracker
    m1, r1 = tree_cpu()
    ticks1 = host_ticks()
    if n != expected:
        raise RuntimeError(f"run delivered {n} samples, expected {expected}")
    cpu = (m1 - m0) + (r1 - r0)
    return {"samples": n, "wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "cpu_main_s": round(m1 - m0, 4),
            "cpu_workers_s": round(r1 - r0, 4), "samples_per_s": n / wall, "samples_per_cpu_s": n / cpu,
            "busy_cores": cpu / wall, "processes_left": len(helpers), **steal_fields(ticks0, ticks1)}
