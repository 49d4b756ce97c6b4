"""Where a MixedStream stands: one immutable `Cursor`, and the functions that make a new cursor
from an old one (an epoch set, a state loaded, a worker count given, a pass begun).

The stream holds one cursor and replaces it whole; no call changes part of it. What the
stream's consumer has trained since the cursor's plan was made (`arrived`: each worker's last
batch state) is kept beside it, and a stream's state (`MixedStream.state_dict`) is a function
of the two. The cursor's plan is made when first needed (a pass begins, or its length or state
is asked for), from its epoch, weights and workers, or from a loaded state dealt to those
workers (`dealt`). Also here: the checks of those calls' arguments (`epoch_number`,
`workers_number`) and `locked`, the stream's lock around each call, so that from several
threads each reads the cursor, makes the new one and puts it in place as one step.
"""
import dataclasses
import functools
import numbers

from pipeline.errors import short
from pipeline.ordering import deal, state_format
from pipeline.ordering.order import MAX_COUNT


@dataclasses.dataclass(frozen=True)
class Start:
    """Where each of this rank's logical workers starts in the segment: batches made,
    positions read per source; first_logical: the logical worker the loader's worker 0
    plays (worker w plays (first_logical + w) % workers), so batches arrive in the order an
    uninterrupted run has them."""

    done: dict = dataclasses.field(default_factory=dict)
    positions: dict = dataclasses.field(default_factory=dict)
    first_logical: int = 0


@dataclasses.dataclass(frozen=True)
class Plan:
    """One pass's plan, fixed when the pass begins and sent to the loader's workers: the segment
    and where this rank's workers start in it. `id` tags the pass's batches, so that batches
    of an older plan arriving late are not taken for this one's (`MixedStream.record`)."""

    id: int
    segment: deal.Segment
    start: Start
    targets: tuple  # the epoch's positions of each source (the reserves lie past them)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A checked stream state (state_format.check) not yet dealt: kept so that a worker count
    given after the load deals it again (`dealt`)."""

    segment: deal.Segment
    done: int
    ranks: tuple
    passed: tuple  # ((pair, positions passed over per source), ...)
    targets: tuple


@dataclasses.dataclass(frozen=True)
class Cursor:
    """The stream's place. epoch: the epoch it stands in; probs: the mixture's weights;
    workers: loader workers per rank (workers_given: a loader or the user said so); plan: the
    pass's Plan, None until first needed; loaded: a state the next plan is dealt from; pinned:
    (epoch, ended) of a state loaded since the last pass began (it decides the epoch);
    epoch_given: set_epoch was called; plans: plan ids handed out so far."""

    probs: tuple
    epoch: int = 0
    workers: int = 1
    workers_given: bool = False
    plan: Plan = None
    loaded: Loaded = None
    pinned: tuple = None
    epoch_given: bool = False
    plans: int = 0

    # ------------------------------------------------------------ read with what arrived

    def done(self, arrived):
        """Batches each logical worker made of the plan's segment: its start and what arrived."""
        done = dict(self.plan.start.done)
        done.update({w: s["batches"] for w, s in arrived.items()})
        return done

    def made(self, arrived):
        """Batches this rank made of the segment (0 before the plan is made)."""
        return sum(self.done(arrived).values()) if self.plan is not None else 0

    def finished(self, arrived):
        return self.plan is not None and self.made(arrived) >= self.plan.segment.batches

    def start_now(self, arrived):
        """Where this rank's workers stand: the plan's start and the batches arrived since."""
        positions = dict(self.plan.start.positions)
        positions.update({w: list(s["positions"]) for w, s in arrived.items()})
        done = self.done(arrived)
        return Start(done, positions, first_logical=sum(done.values()) % self.plan.segment.workers)

    # ------------------------------------------------------------ new cursors

    def with_plan(self, segment, start, targets):
        """This cursor with a new plan (a new id: batches of the old one are not counted)."""
        plan = Plan(self.plans + 1, segment, start, tuple(int(t) for t in targets))
        return dataclasses.replace(self, plan=plan, plans=self.plans + 1)

    def unpinned(self):
        """A pass begins: a state loaded before it no longer decides the epoch."""
        return dataclasses.replace(self, pinned=None)

    def folded(self, arrived):
        """A new plan whose start is where the batches that arrived left the workers."""
        return self.with_plan(self.plan.segment, self.start_now(arrived), self.plan.targets)

    def restarted(self, epoch):
        """Epoch `epoch` from its start (its plan is made when first needed)."""
        return dataclasses.replace(self, epoch=epoch, plan=None, loaded=None)

    def at_epoch(self, epoch, probs, arrived):
        """set_epoch(epoch) with weights `probs`: the epoch the cursor stands in goes on (started
        over once finished), another starts; right after a load only the state's epoch (or the
        next, for a state saved at its end) is taken. New weights inside an epoch are refused."""
        made = self.made(arrived)
        if epoch == self.epoch and made and not self.finished(arrived) and tuple(probs) != self.probs:
            raise ValueError(f"set_epoch({epoch}, weights) inside epoch {epoch}, after {made} batches: an epoch's "
                             f"mixture is fixed when it begins; give the new weights with the next epoch's set_epoch")
        cur = dataclasses.replace(self, probs=tuple(probs), epoch_given=True)
        if self.pinned is not None:
            saved, ended = self.pinned
            if epoch not in ((saved, saved + 1) if ended else (saved,)):
                raise ValueError(epoch_clash(saved, ended, epoch, "set_epoch after load_state_dict"))
            return cur
        return cur.restarted(epoch) if epoch != self.epoch or self.finished(arrived) else cur

    def with_workers(self, workers):
        """`workers` loader workers where none of the epoch was read on this rank: the plan is
        dealt again for them (a loaded state too)."""
        return dataclasses.replace(self, workers=workers, workers_given=True, plan=None)

    def after_load(self, seg, done, ranks, passed, ended, targets):
        """A checked state loaded: its epoch goes on where it stopped (dealt when the plan is
        made), or, saved at its epoch's end, the next epoch from its start (torchdata's rule)."""
        if ended:
            return self.restarted(seg.epoch + 1)
        return dataclasses.replace(self.restarted(seg.epoch),
                                   loaded=Loaded(seg, done, tuple(ranks), tuple(sorted(passed.items())),
                                                 tuple(targets)))


def dealt(loaded, rank, here):
    """(segment, start) of a loaded state on `here` (world, workers, batch size) as rank `rank`:
    its own segment where they are the state's, else what every pair left, dealt to them."""
    seg, done, passed = loaded.segment, loaded.done, dict(loaded.passed)
    if (seg.world, seg.workers, seg.batch_size) == tuple(here) and rank in loaded.ranks:
        return seg, Start({w: seg.worker_done(w, done) for w in range(seg.workers)},
                          state_format.positions(seg, done, passed, rank), first_logical=done % seg.workers)
    if len(loaded.ranks) != seg.world:
        raise ValueError(every_rank(seg, loaded.ranks, here))
    return state_format.redeal(seg, done, loaded.passed, *here), Start()


def every_rank(seg, ranks, here):
    return (f"resuming on {here[0]} ranks x {here[1]} workers (batch {here[2]}) from a run on {seg.world} x "
            f"{seg.workers} (batch {seg.batch_size}) needs every rank's stream state; have ranks "
            f"{sorted(ranks)} (load a list of every rank's state_dict())")


def epoch_clash(saved, ended, epoch, order_):
    where = f"at the end of epoch {saved}, which goes on at epoch {saved + 1}" if ended else f"inside epoch {saved}"
    allowed = f"{saved} or {saved + 1}" if ended else f"{saved}"
    return f"{order_}: the stream state was saved {where}; set_epoch({epoch}) disagrees (use {allowed})"


def epoch_number(epoch):
    """set_epoch's epoch as an int, or ValueError: an integer (numpy's too) in the range a state holds."""
    if isinstance(epoch, numbers.Integral) and not isinstance(epoch, bool) and 0 <= epoch <= MAX_COUNT:
        return int(epoch)
    raise ValueError(f"set_epoch({short(epoch, 60)}): the epoch is an integer in 0..{MAX_COUNT}")


def workers_number(workers):
    """set_workers' count as an int, or ValueError; 0 (a loader reading in this process) is 1."""
    most = state_format.MAX_WORKERS
    if isinstance(workers, numbers.Integral) and not isinstance(workers, bool) and 0 <= workers <= most:
        return max(1, int(workers))
    raise ValueError(f"set_workers({short(workers, 60)}): loader workers per rank are an integer in 0..{most} "
                     f"(0, no worker processes, reads as 1)")


def locked(method):
    """Run a call that reads the cursor and puts a new one in place under the stream's lock, so
    that calls from several threads never put back a cursor made from a stale one, nor read
    `arrived` while a batch is recorded into it."""
    @functools.wraps(method)
    def run(self, *args, **kw):
        with self._guard():
            return method(self, *args, **kw)
    return run
