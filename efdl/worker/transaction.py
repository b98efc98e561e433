"""The step as a transaction: where a rank's state stands after a failure, without copies.

The only thing that changes the tensors of a DDP-style state is ``optimizer.step()``, and it
runs only after the step's communication (the gradient all-reduce in ``backward``) has
succeeded on this rank (so on gloo; on NCCL, where the update is enqueued behind a collective
that may yet fail, efdl.worker.verdict makes it so). So a rank whose step failed holds one of
three states, told apart by the optimizer's own hooks:

- ``COMMITTED``: it failed before ``optimizer.step()`` (in the forward or backward pass): its
  tensors are exactly those of its last ``commit()``;
- ``STEPPED``: it failed after ``optimizer.step()`` but before ``commit()`` (in a user
  collective after the step): its tensors are those of the next step, which is counted
  ("rolled forward") instead of thrown away;
- ``STEPPING``: it failed inside ``optimizer.step()`` (an optimizer with collectives of its
  own): its tensors are torn and it holds nothing.

Ranks may then hold different steps (a peer dies after some ranks finished the all-reduce and
before others did), but never different tensors at the same step: the rebuild's sync takes
the newest step from a rank that holds it to every rank that does not (:func:`choose`), as
TorchFT's recovery takes the quorum's max step. No rollback copy is needed; scripts that
change state outside ``optimizer.step()`` can still ask for one (``snapshot_every``).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from efdl.worker.layout import Layout, covers


class StepPhase(enum.StrEnum):
    COMMITTED = "committed"  # the tensors are those of the last commit()
    STEPPING = "stepping"  # inside optimizer.step(): tensors partly updated
    STEPPED = "stepped"  # optimizer.step() done, commit() not yet called


class Recovery(enum.StrEnum):
    """What a rank does with its state after a failure inside a step (as logged)."""

    RESTORE_COPY = "rolled back to the last rollback copy"
    KEEP = "the state is the last commit's"
    ROLL_FORWARD = "optimizer.step() had run: that step counts"
    DISCARD = "the update was torn inside optimizer.step(): the state comes from a peer"


def recovery(phase: StepPhase, has_copy: bool, trusted: bool = True) -> Recovery:
    """What to do after a failure in ``phase``; a rollback copy, where kept, wins.
    ``trusted``: the step the rank would hold after it (the copy's, or the one
    ``optimizer.step()`` applied) had its communication verified (efdl.worker.verdict); if
    not, its tensors may come from torn gradients: it holds nothing."""
    if not trusted:
        return Recovery.DISCARD
    if has_copy:
        return Recovery.RESTORE_COPY
    return {
        StepPhase.COMMITTED: Recovery.KEEP,
        StepPhase.STEPPED: Recovery.ROLL_FORWARD,
        StepPhase.STEPPING: Recovery.DISCARD,
    }[phase]


# Steps and generations packed into one sortable key (Standing.key): 2**41 steps (two
# trillion) and 2**21 generations (a rescale a minute for four years) fit in an int64.
_STEP_BITS = 41
_GENERATION_LIMIT = 1 << 21


@dataclass(frozen=True, slots=True)
class Standing:
    """What a rank holds, as the rebuild's sync compares it.

    Attributes:
        step: the committed step its tensors are at; None if it holds none (a newcomer, or
            torn by a failure inside ``optimizer.step()`` or inside a sync).
        settled: the rest of its state (sampler, values, scheduler) was committed with the
            tensors; False after a roll-forward (code between ``optimizer.step()`` and
            ``commit()`` may not have run).
        torn: it held state and a failure tore it (only with ``step`` None).
        generation: the generation whose sync gave it this state's line (its lineage): a
            rank that trained on in a generation the job has since replaced (cut off from
            etcd, then back) holds a step of an older line, which never wins over the
            current line's, whatever its number.
    """

    step: int | None
    settled: bool = True
    torn: bool = False
    generation: int = 0

    def key(self) -> int:
        """One integer that orders standings: newer line first, then newer step, then
        settled; -1 for none, -2 for torn."""
        if self.step is None:
            return -2 if self.torn else -1
        generation = min(self.generation, _GENERATION_LIMIT - 1)
        return ((generation << _STEP_BITS) | self.step) * 2 + int(self.settled)

    @property
    def position(self) -> tuple[int, int]:
        """(generation, step): what is compared with the job's progress."""
        return (self.generation, self.step if self.step is not None else -1)

    @staticmethod
    def from_key(key: int) -> Standing:
        if key < 0:
            return Standing(None, torn=key == -2)
        packed, settled = key // 2, bool(key % 2)
        return Standing(packed & ((1 << _STEP_BITS) - 1), settled, generation=packed >> _STEP_BITS)


class Loss(enum.StrEnum):
    """Why no rank's state can be the job's, when none holds a step whole."""

    TORN = "torn"  # the holders' update was torn inside optimizer.step()
    UNCOVERED = "uncovered"  # sharded: no step's rows are all held by the ranks left
    GONE = "gone"  # every rank is new, and the job had committed steps before
    BEHIND = "behind"  # the newest step held is behind the job's (a stale holder is left)


@dataclass(frozen=True, slots=True)
class Choice:
    """Who sends what after a rebuild.

    Attributes:
        step: the newest step any rank holds; None if no rank holds any (then ``primary``'s
            own state, or the remote cache's, is the job's).
        primary: the rank whose whole state (tensors and the rest) every rank takes: the
            lowest rank holding ``step`` settled, else the lowest holding it.
        holders: the ranks whose tensors are at ``step``: they send, and receive no tensor.
        needy: every other rank: each receives every tensor.
        loss: set when no rank holds a step whole and rank 0's own state is not the job's,
            or when the newest step held is behind the job's committed step (``BEHIND``:
            ``step`` and the rest are then what the ranks hold, to be taken only if the remote
            cache has nothing newer): the job's state is gone but for the remote cache (see
            :class:`Loss`).
        generation: the line (:attr:`Standing.generation`) of ``step``.
        diverged: ranks that hold ``step`` with tensors unlike the other holders' (their
            digest differs): treated as torn, they are among ``needy``.
    """

    step: int | None
    primary: int
    holders: tuple[int, ...]
    needy: tuple[int, ...]
    loss: Loss | None = None
    diverged: tuple[int, ...] = ()
    generation: int = 0

    @property
    def lost(self) -> bool:
        return self.loss is not None


def choose(
    keys: Sequence[int],
    layouts: Sequence[Layout | None] | None = None,
    job_step: int = 0,
    digests: Sequence[int] | None = None,
    job_generation: int = 0,
) -> Choice:
    """Decide the sync from every rank's :meth:`Standing.key` (index = rank). Pure.

    With a sharded state, ``layouts`` says which rows each rank holds: a step can be taken
    only if its holders cover every row between them (efdl.worker.layout), so the newest
    step so covered is taken; if some rank held a step and none is covered, the state is
    lost (the rows of a dead rank are gone, and its peers have stepped past the ones
    before). ``job_step`` and ``job_generation``: the job's newest committed step as its
    agents know it (etcd's progress record), and the generation that committed it. When no
    rank holds any step and the step is above 0, the job is not at a cold start: its state
    is lost. When the newest step held is behind it (a holder of an older line, or of an
    older step: the ranks that trained past it are gone), the choice says ``BEHIND``: the
    caller takes a newer snapshot of the remote cache, or stops; never rolls the job back
    silently. ``digests``: each rank's digest of its replicated tensors (0: none, as for a
    sharded state); holders of the chosen step whose digest is not the one most of them
    share (a tie: the one the lowest settled holder has) hold no step: a replica that went
    its own way (a step taken on torn gradients, a fault in memory) is repaired from the
    others instead of spreading.
    """
    standings = [Standing.from_key(k) for k in keys]
    held = sorted({s.position for s in standings if s.step is not None}, reverse=True)
    positions = held
    if layouts is not None:
        positions = [
            at
            for at in held
            if covers(x for x, s in zip(layouts, standings, strict=True) if x and s.position == at)
        ]
    if not positions:  # a cold start (or a resume from the cache): rank 0's state is the job's
        loss = (
            Loss.UNCOVERED  # held, but no step whole
            if held
            else Loss.TORN
            if any(s.torn for s in standings)
            else Loss.GONE
            if job_step > 0
            else None
        )
        return Choice(None, 0, (0,), tuple(range(1, len(keys))), loss)
    best = positions[0]
    holders = tuple(r for r, s in enumerate(standings) if s.position == best)
    diverged: tuple[int, ...] = ()
    if digests is not None and len(holders) > 1 and all(digests[r] for r in holders):
        first = ([r for r in holders if standings[r].settled] or list(holders))[0]
        counts = Counter(digests[r] for r in holders)
        agreed = max(counts, key=lambda d: (counts[d], d == digests[first]))
        diverged = tuple(r for r in holders if digests[r] != agreed)
        holders = tuple(r for r in holders if digests[r] == agreed)
    settled = [r for r in holders if standings[r].settled]
    needy = tuple(r for r in range(len(keys)) if r not in holders)
    behind = best < (job_generation, job_step)
    return Choice(
        best[1],
        (settled or list(holders))[0],
        holders,
        needy,
        Loss.BEHIND if behind else None,
        diverged,
        best[0],
    )


def why_lost(
    choice: Choice, keys: Sequence[int], job: tuple[int, int], cache_url: str | None
) -> str:
    """The :class:`~efdl.errors.StateLostError` message for ``choice`` (lost): what was lost,
    why, and the ways on. ``keys``: each rank's :meth:`Standing.key`; ``job``: the job's
    (generation, committed step); ``cache_url``: the remote cache the ranks looked in (None:
    none)."""
    loss, (job_generation, job_step) = choice.loss, job
    cache = (
        f"the remote cache {cache_url} holds no snapshot yet"
        if cache_url is not None
        else "no remote cache holds a snapshot (run with --cache-url to survive this)"
    )
    if loss is Loss.BEHIND:
        newer = (
            f"the remote cache {cache_url} holds nothing newer"
            if cache_url is not None
            else "no remote cache holds anything newer (run with --cache-url)"
        )
        return (
            f"The job's state is lost: it had committed step {job_step} (in generation "
            f"{job_generation}), but the newest state any rank of this generation holds is "
            f"step {choice.step} of generation {choice.generation}: the ranks that trained "
            f"past it are gone, and {newer}. It will not go back "
            f"{max(0, job_step - (choice.step or 0))} steps by itself: resume it from a remote "
            "cache (--cache-url, persisted before the loss), or start it afresh with "
            "efdl-run --new-run."
        )
    if loss is Loss.UNCOVERED:
        held = sorted({k // 2 for k in keys if k >= 0})
        return (
            "The job's sharded state is lost: no step's rows are all held by the ranks left "
            "(a rank that held some died, and its peers have stepped past the step before; "
            f"steps held: {held}), and {cache}."
        )
    if loss is Loss.TORN:
        return (
            "The job's state is lost: every rank that held it was torn, by a failure "
            "inside optimizer.step() (an optimizer that communicates inside step()) or, on "
            "NCCL, by an update enqueued behind a step's communication that failed before "
            f"it was known complete, and {cache}. Keep rollback copies "
            "(efdl.elastic_state(..., snapshot_every=1)) or a remote cache (--cache-url)."
        )
    return (
        f"The job's state is lost: it had committed step {job_step}, but no rank of this "
        f"generation holds any step (every worker that held one is gone), and {cache}. "
        "It will not start over from step 0 by itself: resume it from a remote cache "
        "(--cache-url, persisted before the loss), or start it afresh with efdl-run "
        "--new-run."
    )
