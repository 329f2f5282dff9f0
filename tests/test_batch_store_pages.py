"""The Batch API's store (deployments/ingress/batch_store.py) as GET /v1/files and GET /v1/batches page
through it: oldest or newest first, one purpose only, after a cursor, ties within a creation second in
insertion order, and whether more follow; and which batches a driver's claim takes. Written for the
survivors of `make mutants`'s batch part (docs/testing.md); tests/test_batch_lines.py has the rest."""

from deployments.ingress.batch_store import BatchStore
from dialects.batches_api import CreateBatchRequest, new_batch
from dialects.files_api import file_object

CHAT = "/v1/chat/completions"


def ids(page: tuple[list[dict], bool]) -> tuple[list[str], bool]:
    docs, more = page
    return [d["id"] for d in docs], more


def files_store(tmp_path) -> BatchStore:
    """f0..f5 created over three seconds (two a second), purposes alternating batch / batch_output."""
    store = BatchStore(tmp_path)
    for i in range(6):
        purpose = "batch" if i % 2 == 0 else "batch_output"
        store.add_file(file_object(f"f{i}", "x.jsonl", purpose, 1, created_at=100 + i // 2), b"x")
    return store


def test_files_oldest_first_page_after_the_cursor_in_insertion_order_within_a_second(tmp_path):
    store = files_store(tmp_path)
    assert ids(store.files(None, None, 4, newest_first=False)) == (["f0", "f1", "f2", "f3"], True)
    assert ids(store.files(None, "f1", 2, newest_first=False)) == (["f2", "f3"], True)
    assert ids(store.files(None, "f3", 2, newest_first=False)) == (["f4", "f5"], False)
    assert ids(store.files(None, None, 6, newest_first=True)) == (["f5", "f4", "f3", "f2", "f1", "f0"], False)
    assert ids(store.files(None, "f4", 2, newest_first=True)) == (["f3", "f2"], True)


def test_files_of_one_purpose_only_and_an_unknown_cursor_starts_from_the_first(tmp_path):
    store = files_store(tmp_path)
    assert ids(store.files("batch", None, 10, newest_first=False)) == (["f0", "f2", "f4"], False)
    assert ids(store.files("batch_output", "f1", 10, newest_first=True)) == ([], False)
    assert ids(store.files("batch_output", "f5", 1, newest_first=True)) == (["f3"], True)
    assert ids(store.files("batch", "no-such-file", 2, newest_first=False)) == (["f0", "f2"], True)


def test_a_deleted_file_is_gone_from_the_pages_and_its_bytes_from_disk(tmp_path):
    store = files_store(tmp_path)
    assert store.delete_file("f2") and not store.delete_file("f2")
    assert ids(store.files("batch", None, 10, newest_first=False)) == (["f0", "f4"], False)
    assert store.file("f2") is None and not (store.files_dir / "f2").exists()
    assert store.file("f0")["purpose"] == "batch"


def test_batches_newest_first_after_the_cursor_with_their_counts(tmp_path):
    store = BatchStore(tmp_path)
    create = CreateBatchRequest(input_file_id="f", endpoint=CHAT, completion_window="24h")
    for i in range(5):
        store.add_batch(new_batch(create, f"b{i}", now=100 + i // 2), "default")
    store.start("b4", [("a", {}), ("b", {})])
    assert ids(store.batches(None, 2)) == (["b4", "b3"], True)
    assert ids(store.batches("b3", 2)) == (["b2", "b1"], True)
    assert ids(store.batches("b1", 2)) == (["b0"], False)
    assert ids(store.batches("no-such-batch", 5)) == (["b4", "b3", "b2", "b1", "b0"], False)
    assert store.batches(None, 1)[0][0]["request_counts"] == {"total": 2, "completed": 0, "failed": 0}


def test_a_claim_takes_only_unfinished_batches_oldest_first_and_leaves_anothers_lease(tmp_path):
    store = BatchStore(tmp_path)
    create = CreateBatchRequest(input_file_id="f", endpoint=CHAT, completion_window="24h")
    for i, now in enumerate([300, 100, 200]):
        store.add_batch(new_batch(create, f"b{i}", now=now), "default")
    store.update("b2", status="cancelled")
    assert store.claim("me", lease_s=600.0) == ["b1", "b0"]
    assert store.claim("other", lease_s=600.0) == []
    store.add_batch(new_batch(create, "b3", now=400), "default")
    assert store.claim("other", lease_s=600.0) == ["b3"]
    assert store.claim("me", lease_s=600.0) == ["b1", "b0"]
    assert store.unfinished()
