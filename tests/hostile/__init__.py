"""Hostile use, repeatable: what a hostile user did, as tests.

Each module here reproduces a defect hostile use found (the test fails on the code before the
fix) or stands for a group of cases that held; groups already tested elsewhere are
listed with their tests instead of being copied.

- Output folders: test_output_dirs.py (rebuild / prepare / train / embed into an
  existing or foreign folder; --overwrite; index rollback).
- Damage: test_damage.py (truncated, object-dtype, bit-flipped shards; weights with
  flipped bytes; old files without records). Damaged run files: tests/app/test_cli_train.py
  (its DAMAGE table); damaged index files: tests/index/test_versions.py
  (test_damaged_index_is_one_line_exit_2).
- OS errors: test_os_errors.py (permissions in a child process without
  capabilities, a closed pipe, devices and FIFOs as --out, TRICLIP_CACHE, absurd sizes,
  duplicate CSV columns, offline --pretrained). The app's --port and bind failures:
  tests/app/test_app_robust.py.
- Housekeeping and counts: test_housekeeping.py (SIGKILLed writes, umask, every
  skip reason, one good record among bad ones).
- Bad option values: test_bad_values.py (a sweep over every command); more per command in
  tests/training/test_train.py, tests/index/test_versions.py, tests/app/test_options.py,
  tests/app/test_cli_data.py.
- Kills: test_kills.py (SIGKILL mid-training, resume bit-identical; slow);
  tests/training/test_train.py (resume after a crash); tests/index/test_stale_parts.py
  (SIGKILLed index builds).
- Concurrent writers and readers: tests/index/test_versions.py
  (test_two_concurrent_add_processes_keep_every_record, test_concurrent_add_threads_keep_every_record,
  test_readers_during_writes_see_whole_versions); the app during --add and rebuilds:
  tests/app/test_app_live.py.
- Path traversal: test_traversal.py (index pointer, on-disk lists, shard records); the app's
  routes: tests/app/test_app_files.py, tests/app/test_app.py.
- App bad inputs: tests/app/test_app_robust.py.

- Nothing lost: test_nothing_lost.py (the demo's own folder, reads that
  never delete, killed commands run again, atomic --overwrite, --init after a kill, versioned image
  URLs, a full 5 MB disk and permissions, one writer per folder, values that make nonsense, modes and
  the network); test_kill_matrix.py runs scripts/kill_matrix.py (slow), killing each writer at every
  step it takes (the files it writes, watched), and tests the watcher itself.
- Nothing served that the manifest does not vouch for: test_vouched.py (codes
  swapped between budgets, copied from another index, OPQ under a PQ manifest; FAISS indexes, vectors
  and meta of another index; truncated vectors; unreadable codes, a FIFO or a directory in their place;
  the app after a switch to a damaged version; an hf: source with no network). The records themselves
  and the lazy codes: tests/index/test_filecheck.py.

Everything runs on tiny synthetic data (conftest.py); the slow ones are marked.
"""
