"""The operator's verbs: `embedfleet enqueue`, `query`, `results` and `calibration`
(client_verbs.py), `status` (status.py, sparkline.py), `plan`, `dead`, `search` and `index`,
`prune` and `migrate` (migration.py, migrate_cli.py), and the results export (export.py).

They are built on the light client (``embedfleet.producer``), the contracts
(``embedfleet.shared``) and the sinks' reader side (``embedfleet.sinks``); waiting.py holds
what every verb shares (``--redis-url``, ``--model``, ``--json``, the wait for Redis). The
`embedfleet` command (embedfleet/cli.py) registers them; the client imports none of them.
"""
