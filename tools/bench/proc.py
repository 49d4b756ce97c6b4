"""The benchmark's process tree read from /proc: its descendants (DataLoader workers, a
forkserver), their CPU time, a memory value. Imports neither torch nor numpy."""
import glob
import os


CLK_TCK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid):
    """(state, utime + stime + cutime + cstime in seconds) from /proc/<pid>/stat; None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return fields[0], sum(int(x) for x in fields[11:15]) / CLK_TCK


def child_pids(pid):
    """Direct children of pid, zombies included.

    /proc/<pid>/task/*/children exists only on kernels built with CONFIG_PROC_CHILDREN; where
    it is missing, the tree would look empty and DataLoader workers' CPU time would go
    uncounted (a with-workers loader would look several times cheaper than it is), so the
    parent pid of every /proc/<n>/stat is read instead.
    """
    files = glob.glob(f"/proc/{pid}/task/*/children")
    if not files:
        return [n for n, ppid in all_parents() if ppid == pid]
    kids = []
    for path in files:
        try:
            with open(path) as f:
                kids += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return kids


def all_parents():
    """(pid, parent pid) of every process in /proc; field 4 of stat, after the parenthesised name."""
    out = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(path) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out.append((int(path.split("/")[2]), int(fields[1])))
    return out


def tree_pids(pid):
    """pid and all its descendants, parents before children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += child_pids(p)
    return out


def proc_kib(path, key):
    """A 'Key:   123 kB' value from a /proc file, 0 if the process is gone."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0
