"""Scheduler: which groups prefill, which sequences decode, block growth, preemption, freeing.

Model-free (tested without a model). Each step is either a prefill of admitted groups or one
decode step of every running sequence (as in nano-vllm). Continuous batching: a finished sequence
leaves at once and its blocks (and, at width 1, its slot; see below) go to the next waiting group on
the next step.

No Python runs per token per sequence: a running sequence advances one token per decode step, so
the step at which it fills its last block is known when the block is given; a timer wheel keyed by
decode step wakes exactly the sequences that need a new block (once per block_size tokens).
When no block is free, the most recently admitted sequence is preempted (its blocks freed, it goes
back to the front of the queue and is recomputed later; its sampling is counter-based, so it draws
the same tokens again).

Slots come in group slots of `width` consecutive slots (`set_width`, only while idle). A group of n
samples takes ceil(n / width) group slots and its sample j runs in slot `group_slots[j // width] *
width + j % width`; a group slot is free again when all its samples have left. The runner keeps one
KV region per group slot (the prompt once, then the samples' tokens interleaved), so width > 1 lets
decode attention read a shared prompt once per group; width 1 gives every sequence its own slot.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

from posttrain.rollout.kv import BlockManager
from posttrain.rollout.sequence import Group, Sequence, Status


@dataclass
class Batch:
    kind: str  # "prefill" | "decode" | "idle"
    groups: list[Group] = field(default_factory=list)  # prefill
    new_blocks: list[tuple[Sequence, int, int]] = field(default_factory=list)  # decode: (seq, table index, block)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Group] = field(default_factory=list)  # can never fit in the KV cache


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_prefill_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_prefill_tokens = max_num_seqs, max_prefill_tokens
        self.waiting: deque[Group] = deque()
        self.running: list[Sequence] = []  # admission order; the last is preempted first
        self.step = 0  # decode steps scheduled so far
        self.timers: dict[int, list[tuple[Sequence, int]]] = defaultdict(list)
        self.set_width(1)

    def set_width(self, width: int) -> None:
        """Group slots of `width` slots each (max_num_seqs // width of them); only while nothing runs."""
        if self.running or self.waiting:
            raise RuntimeError("set_width while sequences are running or waiting")
        if not 1 <= width <= self.max_num_seqs:
            raise ValueError(f"width {width} not in [1, max_num_seqs={self.max_num_seqs}]")
        self.width = width
        n = self.max_num_seqs // width
        self.free_groups: list[int] = list(range(n - 1, -1, -1))  # a stack: freed group slots are reused first
        self.live = [0] * n  # running samples per group slot

    def group_slots_needed(self, size: int) -> int:
        return -(-size // self.width)

    def add(self, group: Group) -> None:
        if self.group_slots_needed(group.size) > len(self.live):
            raise ValueError(f"group of {group.size} samples > {len(self.live) * self.width} slots (max_num_seqs {self.max_num_seqs}, width {self.width})")
        self.waiting.append(group)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ scheduling
    def schedule(self) -> Batch:
        batch = Batch("prefill")
        slots, budget, reserved = len(self.free_groups), self.max_prefill_tokens, 0
        bs = self.blocks.block_size
        while self.waiting:
            g = self.waiting[0]
            toks = g.parent.token_ids
            need = self.group_slots_needed(g.size)
            if need > slots:
                break
            new_tokens = len(toks) - len(self.blocks.lookup(toks)) * bs
            if batch.groups and new_tokens > budget:
                break
            copies = (g.size - 1) * (len(toks) % bs != 0)
            idle = not batch.groups and not self.running
            # headroom: one growth block per sample, unless nothing else runs
            if not self.blocks.can_allocate(toks, reserved + copies + (0 if idle else g.size)):
                if idle and not self.blocks.can_allocate(toks, copies):
                    batch.rejected.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            g.parent.block_table, g.parent.num_computed = self.blocks.allocate(toks)
            slots -= need
            budget -= new_tokens
            reserved += copies
            batch.groups.append(g)
        if batch.groups or not self.running:
            return batch if (batch.groups or batch.rejected) else Batch("idle")
        return self._schedule_decode()

    def _schedule_decode(self) -> Batch:
        batch = Batch("decode")
        for seq, epoch in self.timers.pop(self.step, []):
            while seq.status is Status.RUNNING and seq.epoch == epoch and self.blocks.num_free == 0:
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
            if seq.status is not Status.RUNNING or seq.epoch != epoch:
                continue
            block = self.blocks.append_block()
            seq.block_table.append(block)
            batch.new_blocks.append((seq, len(seq.block_table) - 1, block))
            self._arm(seq)
        self.step += 1
        return batch

    # ------------------------------------------------------------ transitions
    def start(self, group: Group) -> tuple[list[Sequence], list[tuple[int, int]], list[int]]:
        """After the group's prefill: fork its samples, give them slots, start their block timers.
        Returns (sequences, block copies (src, dst) the runner must do before the next decode,
        the group slots taken)."""
        parent = group.parent
        L = len(parent.token_ids)
        parent.num_computed = L
        self.blocks.register(parent.block_table, parent.token_ids, L)
        seqs, copies = [parent], []
        for j in group.sample_indices[1:]:
            table, copy = self.blocks.fork(parent.block_table, L)
            child = Sequence(list(parent.token_ids), parent.prompt_len, j, parent.request, block_table=table, num_computed=L)
            seqs.append(child)
            if copy is not None:
                copies.append(copy)
        W = self.width
        gslots = [self.free_groups.pop() for _ in range(self.group_slots_needed(len(seqs)))]
        for j, s in enumerate(seqs):
            s.status, s.slot = Status.RUNNING, gslots[j // W] * W + j % W
            self.live[gslots[j // W]] += 1
            s.join_step, s.join_computed = self.step, L
            self._arm(s)
        self.running.extend(seqs)
        return seqs, copies, gslots

    def finish(self, seq: Sequence) -> None:
        """Release a finished sequence (its token_ids synced first): cache its full blocks, free them."""
        self.blocks.register(seq.block_table, seq.token_ids, seq.computed_at(self.step))
        self._release(seq)
        seq.status = Status.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_table(seq.block_table)
        seq.block_table = []
        gs = seq.slot // self.width
        self.live[gs] -= 1
        if self.live[gs] == 0:
            self.free_groups.append(gs)
        seq.epoch += 1

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status, seq.num_computed = Status.WAITING, 0
        self.waiting.appendleft(Group(seq, [seq.sample_index], resume=True))

    def _arm(self, seq: Sequence) -> None:
        """Wake `seq` at the decode step that writes the first position past its last block."""
        capacity = len(seq.block_table) * self.blocks.block_size
        due = seq.join_step + capacity - seq.join_computed
        self.timers[max(due, self.step)].append((seq, seq.epoch))
