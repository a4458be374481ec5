"""`embedfleet serve`: the OpenAI- and TEI-compatible HTTP gateway (``pip install
'embedfleet[gateway]'``).

Stateless: it talks to the workers through Redis exactly as the Producer does (small requests
on the query stream, large ones and Batch API batches as ingest jobs whose results come
back on reply lists), and keeps batch state in Redis and batch files in EMBEDFLEET_FILES_DIR,
so replicas scale out and a restart loses nothing. It never imports torch.
"""
