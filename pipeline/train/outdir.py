"""Output folder: what a run may find in --out, and what it may delete there.

Apart from the training so that the one rule that deletes files (a run clears only a
folder that holds nothing but a run's files) sits in one place, next to the list of
the files a run writes.
"""
import collections
import contextlib
import json
import os
import re
import socket

from pipeline.errors import InputError
from pipeline.files import write_atomic
from pipeline.train import dist, guard, options

JOB = "torchrun-job.txt"  # the torchrun job that last started or resumed the run in --out (record_job)
OutPlan = collections.namedtuple("OutPlan", "ckpt why doomed")  # check_out's verdict, prepare_out's to carry out


def check_out(args, topo):
    """Refuse to overwrite a previous run unless told, and --eval-only without a checkpoint
    (InputError); returns the plan for prepare_out: the checkpoint to resume, or what a fresh start deletes. Every rank calls it
    before any shard is indexed or read: a mistaken --out is a one-line error at once, not after
    indexing a large set on first use. It deletes nothing: a run refused later (a batch too big)
    leaves the previous run as it was.

    After torchrun restarts a failed job (--max-restarts), the run in --out is this job's own
    if this job started or resumed it (JOB names it, same_job): continue from its checkpoint, or start
    over if it never wrote one. A run another job left there is refused as on the first attempt.
    """
    ckpt = os.path.join(args.out, "checkpoint.pt")
    if getattr(args, "eval_only", False):  # it reads the checkpoint and writes eval.json beside it
        if not os.path.exists(ckpt):
            raise InputError(f"--eval-only: no checkpoint at {ckpt}")
        return OutPlan(ckpt, None, [])
    previous = os.path.exists(os.path.join(args.out, "metrics.jsonl")) or os.path.exists(ckpt)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    if restarted:  # rank 0's verdict: on another node the job's identity reads otherwise (job_id)
        restarted = dist.all_gather(same_job(_recorded_job(args.out), job_id()) if topo.is_main else None)[0]
    either = getattr(args, "resume_or_start", False)
    if args.resume or ((restarted or either) and os.path.exists(ckpt)):
        if not os.path.exists(ckpt):
            raise InputError(options.resume_error(args))
        return OutPlan(ckpt, None, [])
    fresh = previous and never_saved(args.out)  # a run that died before its first checkpoint
    if previous and either and not (args.overwrite or restarted or fresh):  # an earlier run's files, not this job's
        raise InputError(guard.earlier_run(args.out, run_files(args.out, "--resume-or-start")))
    if previous and not (args.overwrite or restarted or either):
        if not os.path.exists(ckpt):  # --resume would be refused
            fix = ("pass --resume-or-start to start afresh there (it deletes them) or --overwrite"
                   if fresh else "pass --overwrite to replace it")
            raise InputError(f"{args.out} holds a previous run that saved no checkpoint.pt; {fix}")
        raise InputError(f"{args.out} holds a previous run; pass --resume to continue it or --overwrite to replace it")
    why = ("--overwrite" if args.overwrite else "restarted without a checkpoint" if restarted else
           "--resume-or-start without a checkpoint" if either else "--out")
    # a run starts only in a folder that holds nothing but a run's files, so --overwrite can always clear it;
    # without a previous run or --overwrite, a run's stray files (a keys-rank0.txt) are left alone
    found = run_files(args.out, why) if os.path.isdir(args.out) else []
    return OutPlan(None, why, found if previous or args.overwrite else [])


class Unstarted(Exception):
    """A stop signal came before the run changed anything in --out (prepare_out): the job ends
    there, every rank alike, with the signal's exit code and --out as it was."""

    def __init__(self, sig):
        super().__init__(sig.name)
        self.signal = sig


def prepare_out(args, topo, plan=None, stopper=None):
    """Carry out check_out's `plan` (made here when None) once the run will train: every rank
    has looked, and none was sent a stop signal (stopper: stop.StopRequest), before rank 0
    deletes the previous run's files and makes --out. Returns the checkpoint to resume, if any;
    raises Unstarted where some rank got a stop signal so far (while shards were indexed on
    first use, say): a Ctrl-C then must not cost the previous run an --overwrite deletes."""
    plan = check_out(args, topo) if plan is None else plan
    _stop_so_far(stopper)  # a collective: also every rank has looked before rank 0 clears the folder
    if plan.ckpt:
        return plan.ckpt
    why, doomed = plan.why, plan.doomed
    if topo.is_main:
        if doomed:
            print(f"{why}: deleting the previous run in {args.out}/: {', '.join(doomed)}", flush=True)
        for name in doomed:
            os.remove(os.path.join(args.out, name))
        os.makedirs(args.out, exist_ok=True)
    dist.barrier()
    return None


def _stop_so_far(stopper):
    """Unstarted(signal) where any rank noted a stop signal (the ranks' votes summed); else a
    barrier."""
    if stopper is None or not stopper.signals:
        dist.barrier()
        return
    import torch

    sig = stopper.agreed(dist.all_reduce_sum(torch.tensor(stopper.vector(), dtype=torch.float64)).tolist())
    if sig is not None:
        raise Unstarted(sig)


RUN_FILE = re.compile(r"(metrics\.jsonl|summary\.json|checkpoint\.pt|eval\.json|report\.png|keys-rank\d+\.txt|"
                      r"torchrun-job\.txt)"
                      r"(\.tmp)?\Z")  # what train, --eval-only and tools/report.py write into --out


def run_files(folder, why="--overwrite"):
    """The files of a previous run in `folder`, to delete; InputError if anything else is there
    (shards, manifests, folders, a mistyped --out): a run writes only into a folder of its own,
    and --overwrite deletes only what a run wrote."""
    names = sorted(n for n in os.listdir(folder) if n != guard.LOCK)  # the running trainer's own lock
    for name in names:
        path = os.path.join(folder, name)
        if not RUN_FILE.match(name) or os.path.islink(path) or not os.path.isfile(path):
            raise InputError(f"{why}: {folder} holds {name!r}, which no run of pipeline.train writes; "
                             f"nothing deleted (choose another --out, or empty the folder yourself)")
    return names


def never_saved(folder):
    """Whether `folder` holds only what a run leaves that ended before its first checkpoint:
    metrics.jsonl with lines of epoch 1 alone, training and evaluation (the first checkpoint is
    written after them: its save may be what failed); no stop, resume or second epoch, each of
    which comes after a checkpoint; key logs, temporary files, JOB; no summary.json, eval.json
    or report.png. --resume-or-start starts over in such a folder, as the trainer's advice after
    such a failure says."""
    try:
        names = run_files(folder)
        with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (InputError, OSError, UnicodeDecodeError):
        return False
    if any(re.fullmatch(r"(summary\.json|eval\.json|report\.png|checkpoint\.pt)", n) for n in names):
        return False
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i >= len(lines) - 2:  # the last line, torn by the failure, or the empty rest after it
                continue
            return False
        if not (isinstance(record, dict) and record.get("kind") in ("train", "nonfinite", "eval")
                and record.get("epoch") == 1):
            return False
    return True


def job_id(environ=None):
    """This torchrun job's identity, 'RUN@HOST:PID:START', the same in each attempt
    (--max-restarts) and another in each job; None outside torchrun. RUN is torchrun's run id:
    --rdzv-id, a new uuid under --standalone (or a single node without --master-port), 'none'
    under a static rendezvous; HOST:PID:START is rank 0's launcher (the torchrun agent: its
    host, pid and start time), which restarts its workers and lives as long as the job on that
    node. The run id alone is no identity: users copy fixed ids (--rdzv-id=100) from examples,
    and two jobs that share one took each other's runs over (hostileN 1)."""
    environ = os.environ if environ is None else environ
    run = environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    agent = os.getppid()
    try:
        with open(f"/proc/{agent}/stat", encoding="ascii") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]  # field 22, starttime
    except (OSError, IndexError):
        started = "?"
    return f"{run}@{socket.gethostname()}:{agent}:{started}"


def same_job(recorded, now):
    """Whether the job `recorded` (job_id, as JOB holds it) is this one, `now`: the same run id,
    and, where rank 0 runs on the host recorded, the same launcher there. After a restart of an
    elastic job rank 0 may sit on another node, whose launcher is another process of the same
    job: there the run id decides. A static rendezvous ('none') keeps each node's place over
    restarts, so its launcher must always match. A record of another form matches only itself."""
    if recorded is None or now is None:
        return False
    run, _, where = recorded.rpartition("@")
    run_now, _, where_now = now.rpartition("@")
    if not run or run != run_now or where.count(":") < 2 or where_now.count(":") < 2:
        return recorded == now
    host, host_now = where.rsplit(":", 2)[0], where_now.rsplit(":", 2)[0]
    return where == where_now or (host != host_now and run != "none")


def _recorded_job(folder):
    try:
        with open(os.path.join(folder, JOB), encoding="utf-8") as f:
            return f.read().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def record_job(folder):
    """Rank 0, once the job has started or resumed the run in `folder`: note the torchrun job
    (job_id) that a restart of this job takes the run over from; outside torchrun, no job."""
    job = job_id()
    if job is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, JOB))
        return
    write_atomic(os.path.join(folder, JOB), (job + "\n").encode())
