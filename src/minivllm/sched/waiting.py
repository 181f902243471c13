"""The waiting queue: in which order waiting sequences are admitted (the scheduler takes its head).

Fairness is between **groups**: `Sequence.group` names the client request a sequence belongs to.
The server gives all the prompts and all the samples of one HTTP request one group; a request
added on its own is a group of its own. The queue serves the groups **in turns** (round robin, the
fairness vLLM's schedulers give between requests), and each group first come first served:

* A preempted sequence goes back to the very front, before every group: it has a user waiting
  mid-answer (chapter 05). Coming back is not a turn.
* Otherwise the head is the next sequence of the group whose turn it is. A group that was just
  admitted from goes to the back of the turns; a group that arrives after that turn goes ahead of
  it. So a one-prompt request queued behind a 512-sequence one is admitted next, not after all
  512; and two big requests alternate.

With every sequence in a group of its own (`LLM.generate`, a test building sequences by hand) the
turns are arrival order: exactly first come first served, as before groups existed. One group
alone fills the batch as before, in the same order.

The bound: a group that arrives while k groups wait is at the head after at most k admissions
(each group ahead of it is admitted from at most once, then waits behind it). The scheduler still
admits only the head (nobody overtakes it: a request whose n samples wait for n free seats is not
starved by smaller ones), and only when a seat, the step's token budget and the blocks allow; so
in steps the wait is at most those k admissions, each waiting for a running sequence to finish
(at most its max_tokens steps).

**Why no cap on a group's running sequences.** Round robin alone already bounds the wait, and a cap
would leave seats empty while one client is alone (or would have to preempt its sequences when
another arrives). What round robin does not remove: a batch full of one client's long answers
still makes a newcomer wait for the first of them to finish. Shortening that wait means preempting
a running sequence for the newcomer (vLLM's priority scheduling) -- not done here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from itertools import islice

from minivllm.sched.sequence import Sequence


class WaitingQueue:
    """The scheduler's `waiting`: a deque's `append`, `appendleft` (preempted), `popleft`,
    `[0]` (the head), `remove`, `in`, `len` and iteration (in admission order, if every
    admission succeeded and nothing arrived meanwhile)."""

    def __init__(self) -> None:
        self._resumed: deque[Sequence] = deque()  # preempted: before every group
        # each group's waiting sequences, the group whose turn it is first (dicts keep order)
        self._groups: dict[Hashable, deque[Sequence]] = {}
        # the group admitted from last: a group that arrives after its turn goes ahead of it
        self._last_turn: Hashable | None = None
        self._size = 0

    def append(self, seq: Sequence) -> None:
        queue = self._groups.get(seq.group)
        if queue is None:
            queue = self._groups[seq.group] = deque()
            if self._last_turn in self._groups:  # it just had its turn: the newcomer goes first
                self._groups[self._last_turn] = self._groups.pop(self._last_turn)
        queue.append(seq)
        self._size += 1

    def appendleft(self, seq: Sequence) -> None:
        """A preempted sequence: first of all."""
        self._resumed.appendleft(seq)
        self._size += 1

    def popleft(self) -> Sequence:
        if not self._size:
            raise IndexError("pop from an empty WaitingQueue")
        self._size -= 1
        if self._resumed:
            return self._resumed.popleft()
        group = next(iter(self._groups))
        queue = self._groups.pop(group)
        seq = queue.popleft()
        if queue:
            self._groups[group] = queue  # to the back: every other group's turn comes first
        self._last_turn = group
        return seq

    def __getitem__(self, index: int) -> Sequence:
        if index == 0 and self._size:  # the head, without walking the queue
            return self._resumed[0] if self._resumed else next(iter(self._groups.values()))[0]
        if index < 0:
            index += self._size
        found = next(islice(iter(self), index, None), None) if index >= 0 else None
        if found is None:
            raise IndexError("WaitingQueue index out of range")
        return found

    def remove(self, seq: Sequence) -> None:
        if seq in self._resumed:
            self._resumed.remove(seq)
        else:
            queue = self._groups.get(seq.group)
            if queue is None or seq not in queue:
                raise ValueError(f"sequence {seq.seq_id} is not waiting")
            queue.remove(seq)
            if not queue:
                del self._groups[seq.group]
        self._size -= 1

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, Sequence):
            return False
        return seq in self._resumed or seq in self._groups.get(seq.group, ())

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Sequence]:
        """The resumed first, then one sequence per group per turn."""
        yield from self._resumed
        turns = [iter(queue) for queue in self._groups.values()]
        while turns:
            still_waiting = []
            for queue in turns:
                seq = next(queue, None)
                if seq is not None:
                    yield seq
                    still_waiting.append(queue)
            turns = still_waiting

    def __repr__(self) -> str:
        return f"WaitingQueue({[seq.seq_id for seq in self]})"
