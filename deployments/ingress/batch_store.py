"""Where the Files and Batch APIs keep their state: SQLite for the metadata, the files' bytes on disk.

    <batch_dir>/<app>/pdserve.sqlite3    files, batches, and each batch's lines with their results
    <batch_dir>/<app>/files/<file id>    the bytes of each file (inputs uploaded, outputs written)

(<app>: the Serve application's name; deployments/ingress/batch_service.py opens the store there.)

Every change is one SQLite transaction, so a restart of the ingress (or of the whole app) reads
back exactly what was committed: a batch's lines and, for each, whether it was answered and how.
A line's result is committed once (``record``: only a line still pending takes one), so a line run
again after a restart cannot be answered twice, and the output files are written from the
committed results. A file's bytes are written and renamed into place before its row is committed.

Several ingress replicas may share one directory (a path on shared storage: docs/operations.md):
a batch is driven by one of them at a time, the one holding its lease (``claim``), renewed while
it runs; a replica that stops leaves the lease to run out, and another (or its successor) goes on.
"""

from __future__ import annotations

from contextlib import contextmanager
import json
from pathlib import Path
import sqlite3
import time
from typing import Iterator

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (id TEXT PRIMARY KEY, created_at INTEGER, purpose TEXT, doc TEXT);
CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, created_at INTEGER, status TEXT, doc TEXT,
                                    key_name TEXT, owner TEXT, lease_until REAL DEFAULT 0);
CREATE TABLE IF NOT EXISTS lines (batch_id TEXT, line INTEGER, custom_id TEXT, body TEXT,
                                  state TEXT, result TEXT, PRIMARY KEY (batch_id, line));
"""
PENDING, COMPLETED, FAILED = "pending", "completed", "failed"  # a line's state; failed: in the error file
# The statuses a batch ends in (validating, in_progress, finalizing and cancelling move on: the
# Batch API's lifecycle, dialects/batches_api.py; the runner moves a batch through them).
FINAL = frozenset({"failed", "completed", "expired", "cancelled"})
FINALS = tuple(sorted(FINAL))
UNFINISHED_SQL = f"({','.join('?' * len(FINALS))})"  # "status NOT IN" this, with FINALS: not ended yet


class BatchStore:
    """The store under ``directory`` (made if missing). Calls are short and synchronous."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory).expanduser()
        self.files_dir = self.directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are the explicit BEGIN IMMEDIATE of ``_write``.
        self._db = sqlite3.connect(self.directory / "pdserve.sqlite3", timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._db.executescript(SCHEMA)

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction, the database locked for writing from its start (other replicas wait)."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    # ---- files -------------------------------------------------------------------------

    def add_file(self, doc: dict, content: bytes) -> dict:
        """Store a file (``doc``: its object, dialects/files_api.py); replaces one of the same id."""
        path = self.files_dir / doc["id"]
        partial = path.with_suffix(".partial")
        partial.write_bytes(content)
        partial.replace(path)
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
                       (doc["id"], doc["created_at"], doc["purpose"], json.dumps(doc)))
        return doc

    def file(self, file_id: str) -> dict | None:
        row = self._db.execute("SELECT doc FROM files WHERE id = ?", (file_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def content(self, file_id: str) -> bytes:
        return (self.files_dir / file_id).read_bytes()

    def files(self, purpose: str | None, after: str | None, limit: int, newest_first: bool) -> tuple[list[dict], bool]:
        """A page of files: up to ``limit`` after the file ``after``, and whether more follow."""
        order = "DESC" if newest_first else "ASC"
        query, args = "SELECT doc FROM files WHERE 1", []
        if purpose is not None:
            query, args = query + " AND purpose = ?", [purpose]
        if after is not None and (cursor := self._cursor("files", after)) is not None:
            compare = "<" if newest_first else ">"
            query += f" AND (created_at, rowid) {compare} (?, ?)"
            args += list(cursor)
        rows = self._db.execute(f"{query} ORDER BY created_at {order}, rowid {order} LIMIT ?", args + [limit + 1])
        docs = [json.loads(r[0]) for r in rows]
        return docs[:limit], len(docs) > limit

    def delete_file(self, file_id: str) -> bool:
        with self._write() as db:
            deleted = db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount
        (self.files_dir / file_id).unlink(missing_ok=True)
        return bool(deleted)

    def _cursor(self, table: str, row_id: str) -> tuple[int, int] | None:
        """Where the row ``row_id`` sits in the order of pages: its creation second, then its insertion."""
        row = self._db.execute(f"SELECT created_at, rowid FROM {table} WHERE id = ?", (row_id,)).fetchone()
        return tuple(row) if row else None

    # ---- batches -----------------------------------------------------------------------

    def add_batch(self, doc: dict, key_name: str) -> dict:
        """A new batch (``validating``), run under the budget of the key ``key_name``."""
        with self._write() as db:
            db.execute("INSERT INTO batches (id, created_at, status, doc, key_name) VALUES (?, ?, ?, ?, ?)",
                       (doc["id"], doc["created_at"], doc["status"], json.dumps(doc), key_name))
        return doc

    def batch(self, batch_id: str) -> dict | None:
        """The batch's object, its request_counts counted from its lines now."""
        row = self._db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return self._with_counts(json.loads(row[0])) if row else None

    def key_name(self, batch_id: str) -> str:
        return self._db.execute("SELECT key_name FROM batches WHERE id = ?", (batch_id,)).fetchone()[0]

    def batches(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """A page of batches, newest first, after the batch ``after``; and whether more follow."""
        query, args = "SELECT doc FROM batches", []
        if after is not None and (cursor := self._cursor("batches", after)) is not None:
            query, args = query + " WHERE (created_at, rowid) < (?, ?)", list(cursor)
        rows = self._db.execute(f"{query} ORDER BY created_at DESC, rowid DESC LIMIT ?", args + [limit + 1]).fetchall()
        docs = [self._with_counts(json.loads(r[0])) for r in rows]
        return docs[:limit], len(docs) > limit

    def _with_counts(self, doc: dict) -> dict:
        counts = dict(self._db.execute("SELECT state, COUNT(*) FROM lines WHERE batch_id = ? GROUP BY state",
                                       (doc["id"],)).fetchall())
        doc["request_counts"] = {"total": sum(counts.values()), "completed": counts.get(COMPLETED, 0),
                                 "failed": counts.get(FAILED, 0)}
        return doc

    def update(self, batch_id: str, only_from: tuple[str, ...] | None = None, **fields) -> dict | None:
        """Set fields of the batch (``status`` moves its status); None, and nothing changed, when its
        status is not one of ``only_from``."""
        with self._write() as db:
            row = db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()
            doc = json.loads(row[0])
            if only_from is not None and doc["status"] not in only_from:
                return None
            doc.update(fields)
            _save(db, doc)
        return self._with_counts(doc)

    def start(self, batch_id: str, requests: list[tuple[str, dict]]) -> None:
        """The checked lines stored and the batch ``in_progress``, in one transaction: a batch has all
        its lines or none."""
        with self._write() as db:
            db.executemany("INSERT OR IGNORE INTO lines VALUES (?, ?, ?, ?, ?, NULL)",
                           [(batch_id, i, cid, json.dumps(body), PENDING) for i, (cid, body) in enumerate(requests)])
            doc = json.loads(db.execute("SELECT doc FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])
            doc.update(status="in_progress", in_progress_at=int(time.time()))
            _save(db, doc)

    # ---- lines -------------------------------------------------------------------------

    def pending(self, batch_id: str) -> list[tuple[int, str, dict]]:
        """The lines not answered yet: (line, custom_id, body), in order."""
        rows = self._db.execute("SELECT line, custom_id, body FROM lines WHERE batch_id = ? AND state = ? "
                                "ORDER BY line", (batch_id, PENDING))
        return [(line, cid, json.loads(body)) for line, cid, body in rows]

    def record(self, batch_id: str, line: int, state: str, result: dict) -> bool:
        """Commit a line's result, unless it has one already (then False: nothing written)."""
        with self._write() as db:
            return bool(db.execute("UPDATE lines SET state = ?, result = ? WHERE batch_id = ? AND line = ? "
                                   "AND state = ?", (state, json.dumps(result), batch_id, line, PENDING)).rowcount)

    def results(self, batch_id: str, state: str) -> list[dict]:
        rows = self._db.execute("SELECT result FROM lines WHERE batch_id = ? AND state = ? ORDER BY line",
                                (batch_id, state))
        return [json.loads(r[0]) for r in rows]

    # ---- who drives which batch --------------------------------------------------------

    def unfinished(self) -> bool:
        """Whether any batch has not reached a final status (a read, no lock taken)."""
        return self._db.execute(f"SELECT 1 FROM batches WHERE status NOT IN {UNFINISHED_SQL} LIMIT 1",
                                FINALS).fetchone() is not None

    def claim(self, owner: str, lease_s: float) -> list[str]:
        """The unfinished batches ``owner`` drives now: those it leased before and those whose lease
        ran out, leased to it (or renewed) for ``lease_s``."""
        now = time.time()
        with self._write() as db:
            db.execute(f"UPDATE batches SET owner = ?, lease_until = ? WHERE status NOT IN {UNFINISHED_SQL} "
                       "AND (owner = ? OR owner IS NULL OR lease_until < ?)", (owner, now + lease_s, *FINALS, owner, now))
            rows = db.execute(f"SELECT id FROM batches WHERE owner = ? AND status NOT IN {UNFINISHED_SQL} "
                              "ORDER BY created_at", (owner, *FINALS)).fetchall()
        return [r[0] for r in rows]


def _save(db: sqlite3.Connection, doc: dict) -> None:
    db.execute("UPDATE batches SET doc = ?, status = ? WHERE id = ?", (json.dumps(doc), doc["status"], doc["id"]))
