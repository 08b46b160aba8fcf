"""Session records without Ray: incremental persistence, restarts, torn writes, corruption."""

import dataclasses

import pytest

from msaserve.kvcache.keys import IncompatibleModel, ModelIdentity
from msaserve.kvcache.session_records import SessionNotFound, SessionRecord, SessionStore

MODEL = ModelIdentity("tiny@test", num_layers=2, page_size=4, num_kv_heads=2, head_dim=8,
                      num_index_heads=1, index_dim=8, kv_dtype="float32", index_dtype="float32")


def record(session_id: str = "s1") -> SessionRecord:
    return SessionRecord(session_id, MODEL, token_ids=[1, 2, 3, 4, 5], page_hashes=[111],
                         sampling_state={"temperature": 0.0, "generated": 0})


def test_put_get_list_delete_in_memory():
    store = SessionStore()
    store.put(record("a"))
    store.put(record("b"))
    assert store.session_ids() == ["a", "b"] and store.get("a").token_ids == [1, 2, 3, 4, 5]
    store.delete("a")
    with pytest.raises(SessionNotFound, match="'a'"):
        store.get("a")


def test_append_writes_only_new_bytes_and_survives_restart(tmp_path):
    store = SessionStore(tmp_path)
    store.put(record())
    directory = next(tmp_path.iterdir())
    assert (directory / "tokens.bin").stat().st_size == 5 * 8
    store.append("s1", [6, 7, 8], [222], {"temperature": 0.0, "generated": 3})
    store.append("s1", [9], [], None)
    store.set_pinned("s1", True)
    assert (directory / "tokens.bin").stat().st_size == 9 * 8
    assert (directory / "pages.bin").stat().st_size == 2 * 8
    restarted = SessionStore(tmp_path).get("s1")
    assert restarted.token_ids == list(range(1, 10))
    assert restarted.page_hashes == [111, 222]
    assert restarted.sampling_state == {"temperature": 0.0, "generated": 3}
    assert restarted.pinned and restarted.model == MODEL


def test_page_hash_above_2_63_round_trips(tmp_path):
    store = SessionStore(tmp_path)
    big = (1 << 64) - 5
    store.put(dataclasses.replace(record(), page_hashes=[big]))
    assert SessionStore(tmp_path).get("s1").page_hashes == [big]


def test_torn_append_is_ignored_then_truncated(tmp_path):
    store = SessionStore(tmp_path)
    store.put(record())
    directory = next(tmp_path.iterdir())
    with open(directory / "tokens.bin", "ab") as f:  # a crash after the append, before the manifest
        f.write(b"\x07" * 20)
    restarted = SessionStore(tmp_path)
    assert restarted.get("s1").token_ids == [1, 2, 3, 4, 5] and restarted.corruptions == 0
    restarted.append("s1", [6], [])
    assert SessionStore(tmp_path).get("s1").token_ids == [1, 2, 3, 4, 5, 6]


def test_corrupt_session_file_is_dropped_and_counted(tmp_path):
    store = SessionStore(tmp_path)
    store.put(record("good"))
    store.put(record("bad"))
    bad_dir = store._dir("bad")
    raw = bytearray((bad_dir / "tokens.bin").read_bytes())
    raw[3] ^= 0x10
    (bad_dir / "tokens.bin").write_bytes(bytes(raw))
    restarted = SessionStore(tmp_path)
    assert restarted.session_ids() == ["good"] and restarted.corruptions == 1
    assert not bad_dir.exists()


def test_incompatible_model_is_refused_naming_the_fields():
    other = dataclasses.replace(MODEL, page_size=8, kv_dtype="bfloat16")
    with pytest.raises(IncompatibleModel, match=r"page_size: stored 4, this replica 8.*kv_dtype"):
        other.check_compatible(record().model, "session 's1'")
    MODEL.check_compatible(record().model, "session 's1'")


def test_records_past_the_limit_evict_the_least_recently_updated_unpinned(tmp_path):
    store = SessionStore(tmp_path, max_sessions=3)
    for name in ("a", "b", "c"):
        store.put(record(name))
    store.set_pinned("a", True)  # a live session: never evicted
    store.append("b", [6], [], None)  # b is now more recent than c
    store.put(record("d"))
    assert store.session_ids() == ["a", "b", "d"] and store.evictions == 1
    assert len(list(tmp_path.iterdir())) == 3  # c's files went too
    store.put(record("e"))  # b is now the least recently updated unpinned
    assert store.session_ids() == ["a", "d", "e"] and len(store) == 3
    restarted = SessionStore(tmp_path, max_sessions=2)  # a smaller limit on restart
    assert restarted.session_ids() == ["a", "e"] and restarted.evictions == 1


def test_a_new_record_is_kept_even_when_every_other_one_is_pinned(tmp_path):
    store = SessionStore(tmp_path, max_sessions=2)
    for name in ("a", "b"):
        store.put(record(name))
        store.set_pinned(name, True)
    store.put(record("c"))  # over the limit, but nothing else may go: c stays, files and all
    assert store.session_ids() == ["a", "b", "c"] and store.evictions == 0
    assert SessionStore(tmp_path, max_sessions=3).get("c").token_ids == [1, 2, 3, 4, 5]


def test_token_array_follows_appends_and_grows(tmp_path):
    store = SessionStore(tmp_path)
    record = SessionRecord("g", MODEL, token_ids=list(range(10)))
    store.put(record)
    for start in range(10, 200, 7):  # many appends: the array grows past its first buffer
        store.append("g", list(range(start, start + 7)), [])
    want = list(range(10)) + [t for start in range(10, 200, 7) for t in range(start, start + 7)]
    view = store.tokens("g")
    assert view.tolist() == want and not view.flags.writeable
    record.token_ids.append(-5)  # a caller in this process grew the stored record's list itself
    assert store.tokens("g").tolist() == [*want, -5]
    assert SessionStore(tmp_path).tokens("g").tolist() == want  # the disk holds what was appended
