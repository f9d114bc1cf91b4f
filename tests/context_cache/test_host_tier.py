"""The context cache's Host tier and Snapshot pause through the public Engine (fp32, CPU).

Random multi-turn workloads under a tiny page pool and a small Host budget force demotion, Host
eviction, restore, Snapshot pauses, Snapshot revocation and Replay; outputs must equal cold runs
(cache off), the counters must show that each of those happened, and nothing may be left once the
cache is cleared and the engine closed. A corrupted Host record fails the engine loudly."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from ninfer.contracts.errors import EngineFailure
from ninfer.contracts.sampling import SamplingParams

from .conftest import settled
from .test_engine_cache import conversation_workload, run_conversations, toks

COMMON = dict(max_context=256, prefill_chunk_size=24, page_size=16)


def assert_nothing_left(engine):
    """After clear_context_cache: no checkpoint, no Host byte, no page, slot or prefix ref; the
    operation slot is free."""
    engine.clear_context_cache(timeout=30)
    s = settled(engine)
    assert (s.cache_checkpoints, s.cache_device_bytes, s.cache_host_bytes, s.cache_host_checkpoints) == (0, 0, 0, 0)
    assert (s.pages_used, s.state_slots_used) == (0, 0)
    program = engine._program
    usage = program.checkpoint_usage()
    assert usage.count == 0 and usage.free_slots == usage.total_slots and usage.host_bytes == 0
    assert program.host.count == 0 and program.host.used_bytes == 0
    assert program.kv.num_prefixes == 0 and program.kv.allocator.free_pages == program.kv.num_pages
    assert not engine._core.ops.busy
    assert engine._core.cache.snapshots() == {}
    engine.close(timeout=60)
    cap = program.capacity()
    assert cap.free_pages == cap.total_pages and cap.free_state_slots == cap.total_state_slots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_multi_turn_under_device_and_host_pressure_equals_cold(make_engine, seed):
    plans = conversation_workload(seed, conversations=6, turns=3, max_out=40 + 10 * seed)
    cold = run_conversations(make_engine(**COMMON, max_concurrency=4), plans)
    # 20 pages of 16 tokens for 4 running requests, 6 checkpoint slots, a Host budget of ~2.5 checkpoint images:
    # checkpoints are demoted and evicted from Host, hits restore, pauses keep Snapshots that younger
    # pauses and page pressure revoke, and those requests replay.
    engine = make_engine(**COMMON, max_concurrency=4, num_pages=20, context_cache=True, cache_checkpoint_interval=16,
                         cache_checkpoint_slots=6, cache_host_mib=0.02)
    warm = run_conversations(engine, plans)
    assert warm == cold
    s = settled(engine)
    print(f"seed {seed}: " + ", ".join(f"{k}={v}" for k, v in s.as_dict().items()
                                       if k.startswith(("cache_", "snapshot_", "replay", "preempt", "resumes"))))
    assert s.cache_demotions > 0 and s.cache_host_evictions > 0 and s.cache_restores > 0
    assert s.preemptions > 0 and s.snapshot_pauses > 0 and s.snapshot_resumes > 0
    assert s.snapshot_revocations > 0 and s.replays > 0 and s.replay_tokens > 0
    assert s.resumes == s.snapshot_resumes + s.replays
    assert s.cache_host_bytes <= s.cache_host_budget_bytes
    assert_nothing_left(engine)


def test_snapshot_resume_recomputes_nothing(make_engine):
    """With a Host budget that holds every snapshot, preempted requests resume from their Snapshot:
    no Replay token, no Replay resume, and the outputs equal the cold run."""
    plans = conversation_workload(5, conversations=4, turns=1, max_out=60)
    cold = run_conversations(make_engine(**COMMON, max_concurrency=4), plans)
    engine = make_engine(**COMMON, max_concurrency=4, num_pages=16, context_cache=True, cache_host_mib=64)
    warm = run_conversations(engine, plans)
    assert warm == cold
    s = settled(engine)
    assert s.preemptions > 0 and s.snapshot_pauses == s.preemptions and s.snapshot_resumes == s.resumes == s.preemptions
    assert s.replays == 0 and s.replay_tokens == 0 and s.snapshot_revocations == 0
    assert_nothing_left(engine)


def test_without_a_host_tier_pauses_replay(make_engine):
    plans = conversation_workload(5, conversations=4, turns=1, max_out=60)
    cold = run_conversations(make_engine(**COMMON, max_concurrency=4), plans)
    engine = make_engine(**COMMON, max_concurrency=4, num_pages=16, context_cache=True, cache_host_mib=0)
    assert run_conversations(engine, plans) == cold
    s = settled(engine)
    assert s.preemptions > 0 and s.replays == s.resumes == s.preemptions and s.replay_tokens > 0
    assert (s.snapshot_pauses, s.cache_demotions, s.cache_restores, s.cache_host_budget_bytes) == (0, 0, 0, 0)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, seed=1)


def demote_everything(engine):
    """Demote every shared checkpoint to Host while the worker is idle (no request in flight)."""
    program = engine._program
    entries = engine._core.cache.entries()
    for e in entries:
        assert program.demote_checkpoint(e.handle)
    assert all(not program.checkpoint_footprint(e.handle).on_device for e in entries)
    return entries


def test_a_hit_on_a_host_checkpoint_restores_it_and_equals_cold(make_engine):
    rng = random.Random(8)
    turn1 = toks(rng, 90)
    cold = make_engine(max_context=512, max_concurrency=1, prefill_chunk_size=64)
    engine = make_engine(max_context=512, max_concurrency=1, prefill_chunk_size=64, context_cache=True,
                         cache_checkpoint_interval=32, cache_host_mib=1)
    r1 = engine.generate(turn1, sampling=GREEDY)
    before = settled(engine)
    demote_everything(engine)
    usage = engine._program.checkpoint_usage()  # the worker is idle: its stats predate the demotion
    assert usage.host_count == usage.count == 4  # boundaries 32 and 64, prompt end 90, response end 97
    # Demotion moves the pages only one checkpoint holds; pages 0-4 are shared by several (the
    # prompt end's partial page 5 was copied on write by the decode), so they stay on the device.
    assert usage.device_bytes == 5 * engine._program.kv.page_bytes and usage.host_bytes > 0
    turn2 = turn1 + list(r1.token_ids) + toks(rng, 10)
    r2 = engine.generate(turn2, sampling=GREEDY)
    assert r2.token_ids == cold.generate(turn2, sampling=GREEDY).token_ids
    s = settled(engine)
    assert s.cache_restores == before.cache_restores + 1 and s.cache_hits == before.cache_hits + 1
    assert s.cache_hit_tokens - before.cache_hit_tokens == len(turn1) + len(r1.token_ids) - 1
    assert s.prefill_tokens - before.prefill_tokens == len(turn2) - (len(turn1) + len(r1.token_ids) - 1)
    assert s.cache_host_checkpoints == 3  # the restored one is on Device again
    assert engine._core.ops.completed["bind"] >= 2  # the restore and the open
    assert_nothing_left(engine)


def corrupt(program, cid, how):
    records = program._checkpoints
    rec = records[cid]
    host = rec.host
    if how == "host_pages":      # the Host copy lost a page the KV prefix says is on Host
        records[cid] = dataclasses.replace(rec, host=dataclasses.replace(
            host, positions=host.positions[:-1], pages=tuple((k[:-1], v[:-1]) for k, v in host.pages)))
    elif how == "image":         # the image is neither in a Device slot nor on Host
        records[cid] = dataclasses.replace(rec, host=dataclasses.replace(host, image=None))
    elif how == "prefix":        # the KV prefix says a page is on the device, the Host copy holds it too
        pages = list(rec.prefix.pages)
        pages[host.positions[0]] = 0
        records[cid] = dataclasses.replace(rec, prefix=dataclasses.replace(rec.prefix, pages=tuple(pages)))
    else:                        # the image has the wrong size
        records[cid] = dataclasses.replace(rec, host=dataclasses.replace(host, image=host.image[:-1]))


@pytest.mark.parametrize("how", ["host_pages", "image", "prefix", "image_size"])
def test_a_corrupted_host_checkpoint_is_an_engine_failure(make_engine, how):
    rng = random.Random(9)
    prompt = toks(rng, 50)
    engine = make_engine(max_context=256, max_concurrency=1, prefill_chunk_size=16, context_cache=True,
                         cache_host_mib=1)
    out = engine.generate(prompt, sampling=GREEDY).token_ids
    settled(engine)
    entries = demote_everything(engine)
    corrupt(engine._program, max(e.handle.checkpoint_id for e in entries), how)  # the response end
    with pytest.raises(EngineFailure, match="inconsistent"):
        engine.generate(prompt + list(out) + [5], sampling=GREEDY)
    assert engine.stats().status == "failed"


def test_operation_slot_allows_one_transaction_at_a_time():
    from ninfer.engine.context_cache.operation_slot import OperationSlot

    slot = OperationSlot()
    with slot.transaction("demote", "checkpoint 1"):
        assert slot.busy
        with pytest.raises(EngineFailure, match="still in flight"), slot.transaction("bind", "checkpoint 2"):
            pass
    assert not slot.busy and slot.completed["demote"] == 1 and slot.completed["bind"] == 0
    with pytest.raises(RuntimeError), slot.transaction("capture", "sequence 3"):
        raise RuntimeError("a failed copy")
    assert not slot.busy and slot.completed["capture"] == 0


def test_kv_pages_detach_and_attach_keep_contents_and_refcounts():
    from ninfer.storage.host_tier import HostTier
    from ninfer.storage.kv_pool import ON_HOST, KVPoolError, PagedKVCache

    kv = PagedKVCache([0, 3], num_pages=8, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                      device=torch.device("cpu"))
    assert kv.ensure("a", 10, write_from=0)
    for layer in (0, 3):
        k, v = kv.pools(layer)
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
    before = [(k.clone(), v.clone()) for k, v in (kv.pools(0), kv.pools(3))]
    ref = kv.share_prefix("a", 10)
    kv.release("a")
    assert kv.private_indices(ref) == (0, 1, 2) and kv.allocator.free_pages == 5
    tier = HostTier(10_000, pin=False)
    old_pages = ref.pages
    copy = tier.store(None, (0, 2), kv.read_pages([ref.pages[0], ref.pages[2]]))
    ref = kv.detach_pages(ref, (0, 2))
    assert ref.pages[0] == ref.pages[2] == ON_HOST and ref.host_indices == (0, 2) and kv.allocator.free_pages == 7
    with pytest.raises(KVPoolError):
        kv.adopt_prefix("b", ref)
    assert tier.store(None, (1,), kv.read_pages([ref.pages[1]] * 100)) is None  # over budget: nothing taken
    assert kv.ensure("x", 28)  # every free page is reused (and overwritten) meanwhile
    for layer in (0, 3):
        for pool in kv.pools(layer):
            pool[list(kv.table("x"))] = 0.0
    kv.release("x")
    ref, fresh = kv.attach_pages(ref)
    assert len(fresh) == 2 and ON_HOST not in ref.pages
    kv.write_pages([ref.pages[i] for i in copy.positions], copy.pages)
    tier.release(copy)
    assert tier.used_bytes == 0
    for (k0, v0), (k, v) in zip(before, (kv.pools(0), kv.pools(3)), strict=True):
        for i, p in enumerate(ref.pages):
            assert torch.equal(k[p], k0[old_pages[i]]) and torch.equal(v[p], v0[old_pages[i]])
    kv.release_prefix(ref)
    assert kv.allocator.free_pages == 8
