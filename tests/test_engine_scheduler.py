"""KV block manager and scheduler without a model: admission, refill, prefix sharing, growth, preemption, freeing."""

import pytest

from posttrain.rollout.kv import BlockManager, NoFreeBlocks
from posttrain.rollout.scheduler import Scheduler
from posttrain.rollout.sequence import Group, Sequence, Status


def group(tokens, n=1):
    return Group(Sequence(list(tokens), len(tokens), 0), list(range(n)))


# ------------------------------------------------------------------ block manager
def test_allocate_free_and_prefix_cache_hit():
    bm = BlockManager(num_blocks=8, block_size=4)
    table, cached = bm.allocate(list(range(10)))  # 3 blocks, nothing cached
    assert len(table) == 3 and cached == 0 and bm.num_free == 5
    bm.register(table, list(range(10)), 10)  # 2 full blocks enter the cache
    bm.free_table(table)
    assert bm.num_free == 8
    t2, cached2 = bm.allocate(list(range(8)) + [99, 98, 97])  # same first 8 tokens
    assert cached2 == 8 and t2[:2] == table[:2] and bm.num_free == 5
    t3, cached3 = bm.allocate(list(range(8)))  # whole prompt cached: last block recomputed
    assert cached3 == 4 and t3[0] == table[0] and t3[1] != table[1]
    assert bm.ref[table[0]] == 2


def test_cache_miss_after_divergence_and_eviction():
    bm = BlockManager(num_blocks=3, block_size=2)
    t, _ = bm.allocate([1, 2, 3, 4, 5])
    bm.register(t, [1, 2, 3, 4, 5], 5)
    bm.free_table(t)
    assert bm.lookup([1, 2, 9, 9, 5]) == t[:1]  # second block differs
    assert bm.lookup([7, 2, 3, 4, 5]) == []  # hash chain: later blocks need the earlier ones
    bm.allocate([8, 8, 8, 8, 8, 8])  # takes all 3 blocks: cached contents evicted
    assert bm.lookup([1, 2, 3, 4, 5]) == []


def test_fork_shares_full_blocks_and_copies_partial():
    bm = BlockManager(num_blocks=10, block_size=4)
    table, _ = bm.allocate(list(range(6)))  # blocks: full, partial
    child, copy = bm.fork(table, 6)
    assert child[0] == table[0] and child[1] != table[1] and copy == (table[1], child[1])
    assert bm.ref[table[0]] == 2 and bm.ref[table[1]] == 1
    child2, copy2 = bm.fork(list(range(0)) or table[:1], 4)  # block-aligned: nothing to copy
    assert copy2 is None and child2 == table[:1] and bm.ref[table[0]] == 3
    bm.free_table(child)
    bm.free_table(child2)
    bm.free_table(table)
    assert bm.num_free == 10 and all(r == 0 for r in bm.ref)


def test_no_free_blocks():
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate([1, 2, 3, 4])
    with pytest.raises(NoFreeBlocks):
        bm.append_block()
    assert not bm.can_allocate([5])


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    t, _ = bm.allocate([1, 2, 3])
    bm.register(t, [1, 2, 3], 3)
    bm.reset_prefix_cache()
    assert bm.lookup([1, 2, 3]) == []
    bm.register(t, [1, 2, 3, 4], 4)  # the sequence finishes after the weight update: its KV is stale
    assert bm.lookup([1, 2, 3, 4, 5]) == []
    bm.free_table(t)
    t2, _ = bm.allocate([1, 2, 3, 4, 5])  # blocks reused by a new sequence are fresh again
    bm.register(t2, [1, 2, 3, 4, 5], 5)
    assert len(bm.lookup([1, 2, 3, 4, 5])) == 2


# ------------------------------------------------------------------ scheduler
def run_decode(s, steps):
    """Decode `steps` steps (no model: every running sequence advances one token per step)."""
    out = []
    for _ in range(steps):
        b = s.schedule()
        assert b.kind == "decode"
        out.append(b)
    return out


def test_admission_limited_by_slots_and_refill():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_prefill_tokens=1000)
    for i in range(3):
        s.add(group([i] * 5, n=2))
    b = s.schedule()
    assert b.kind == "prefill" and len(b.groups) == 2  # 2 groups x 2 samples fill 4 slots
    for g in b.groups:
        seqs, copies, _ = s.start(g)
        assert len(seqs) == 2 and len(copies) == 1  # 5 tokens: partial last block copied for the fork
    assert len(s.running) == 4 and len(s.waiting) == 1
    assert s.schedule().kind == "decode"  # no slot for the third group
    first = s.running[0]
    s.finish(first)
    assert first.status is Status.FINISHED and len(s.free_groups) == 1
    assert s.schedule().kind == "decode"  # needs 2 slots, only 1 free
    s.finish(s.running[0])
    b = s.schedule()
    assert b.kind == "prefill" and b.groups[0].parent.token_ids == [2] * 5  # refilled without restarting others


def test_prefill_token_budget():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_prefill_tokens=10)
    for i in range(3):
        s.add(group([i] * 6))
    b = s.schedule()
    assert len(b.groups) == 1  # 6 + 6 > 10
    s.add(group([9] * 50))  # alone it may exceed the budget
    s.waiting.rotate(1)
    s.start(b.groups[0])
    b2 = s.schedule()
    assert len(b2.groups) == 1 and len(b2.groups[0].parent.token_ids) == 50


def test_prefix_sharing_across_requests():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=8, max_prefill_tokens=1000)
    s.add(group(list(range(12)), n=1))
    b = s.schedule()
    (seq,), *_ = s.start(b.groups[0])
    seq.token_ids = list(range(12)) + [50]
    s.finish(seq)
    s.add(group(list(range(12)) + [50, 51, 52], n=1))  # next turn of the conversation
    b = s.schedule()
    assert b.groups[0].parent.num_computed == 12  # 3 cached blocks reused; only 3 tokens to compute


def test_block_growth_timer_and_free():
    bm = BlockManager(64, 4)
    s = Scheduler(bm, max_num_seqs=4, max_prefill_tokens=1000)
    s.add(group([1, 2, 3], n=1))
    seq, *_ = s.start(s.schedule().groups[0])
    seq = seq[0]
    assert len(seq.block_table) == 1  # 3 tokens computed; the sampled 4th goes to position 3
    got = []
    for _step in range(10):  # decode step k writes position 3 + k
        b = s.schedule()
        got.append([j for _, j, _ in b.new_blocks])
    # new blocks exactly when positions 4, 8, 12 are written (steps 1, 5, 9)
    assert got[1] == [1] and got[5] == [2] and got[9] == [3] and sum(map(len, got)) == 3
    assert seq.computed_at(s.step) == 13
    used = bm.num_used
    s.finish(seq)
    assert used == 4 and bm.num_free == 64


def test_preemption_when_out_of_blocks_and_resume():
    bm = BlockManager(4, 2)
    s = Scheduler(bm, max_num_seqs=4, max_prefill_tokens=1000)
    s.add(group([1, 2], n=1))
    s.add(group([3, 4], n=1))
    b = s.schedule()
    assert len(b.groups) == 2  # 1 block each (+ 1 growth block of headroom for the second)
    (a,), *_ = s.start(b.groups[0])
    (c,), *_ = s.start(b.groups[1])
    bs = run_decode(s, 3)
    preempted = [x for b in bs for x in b.preempted]
    assert preempted == [c]  # the most recently admitted sequence gives way
    assert c.status is Status.WAITING and s.waiting[0].parent is c and s.waiting[0].resume
    assert a.status is Status.RUNNING and bm.num_used == len(a.block_table)
    s.finish(a)
    b = s.schedule()
    assert b.kind == "prefill" and b.groups[0].parent is c  # resumed first


def test_prompt_larger_than_cache_is_rejected():
    s = Scheduler(BlockManager(2, 2), max_num_seqs=2, max_prefill_tokens=100)
    s.add(group(list(range(9))))
    s.add(group([1, 2]))
    b = s.schedule()
    assert [len(g.parent.token_ids) for g in b.rejected] == [9] and len(b.groups) == 1


def test_group_larger_than_slots_refused():
    s = Scheduler(BlockManager(8, 2), max_num_seqs=2, max_prefill_tokens=100)
    with pytest.raises(ValueError):
        s.add(group([1, 2], n=3))


def test_group_slots_width():
    """width 4: a group of up to 4 samples takes one group slot (4 consecutive slots); it is free again
    only when all its samples have left; a bigger group takes several."""
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_prefill_tokens=1000)
    s.set_width(4)
    s.add(group([1] * 5, n=3))
    s.add(group([2] * 5, n=4))
    s.add(group([3] * 5, n=1))
    b = s.schedule()
    assert len(b.groups) == 2  # 2 group slots; the third group waits
    a, _, ga = s.start(b.groups[0])
    c, _, gc = s.start(b.groups[1])
    assert ga == [0] and gc == [1]
    assert [x.slot for x in a] == [0, 1, 2] and [x.slot for x in c] == [4, 5, 6, 7]
    s.finish(a[0])
    s.finish(a[1])
    assert s.schedule().kind == "decode"  # group slot 0 still holds a[2]
    s.finish(a[2])
    b = s.schedule()
    assert b.kind == "prefill" and b.groups[0].parent.token_ids == [3] * 5
    (d,), _, gd = s.start(b.groups[0])
    assert gd == [0] and d.slot == 0
    with pytest.raises(RuntimeError):
        s.set_width(2)  # not while running
    idle = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_prefill_tokens=1000)
    idle.set_width(4)
    idle.add(group([1] * 5, n=4))
    with pytest.raises(RuntimeError):
        idle.set_width(2)  # nor while a group waits (it was sized for width 4)


def test_group_larger_than_width_takes_several_group_slots():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_prefill_tokens=1000)
    s.set_width(2)
    s.add(group([1] * 3, n=5))
    seqs, _, gs = s.start(s.schedule().groups[0])
    assert gs == [0, 1, 2] and [x.slot for x in seqs] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        s.add(group([1] * 3, n=9))
    s3 = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_prefill_tokens=1000)
    s3.set_width(3)  # 2 group slots of 3: 6 usable slots
    with pytest.raises(ValueError):
        s3.add(group([1] * 3, n=7))
