"""OpenAI's Batch API (/v1/files, /v1/batches) over the ingest stream, in one package.

- ``api``: the routes;
- ``files``: the files folder (EMBEDFLEET_FILES_DIR) the routes and the runner share;
- ``runner``: the batches' records and life cycle (validate, enqueue as a job, collect,
  withdraw), and the slices it enqueues;
- ``lines``: the input file's request lines, checked as the online endpoint checks them;
- ``lease``: the lease a replica holds on a batch, and the writes it fences;
- ``output``: the output and error files a finished batch publishes;
- ``*.lua``: the Redis scripts only the Batch API runs, loaded by the fleet's one loader
  (embedfleet.shared.scripts) from this folder.
"""

SCRIPTS_PACKAGE = __name__  # where the Batch API's scripts lie: this package's folder
