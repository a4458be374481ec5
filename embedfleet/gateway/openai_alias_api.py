"""OpenAI's embeddings route without its ``/v1`` prefix: POST /embeddings, as TEI and Infinity
serve it (clients given a base URL without ``/v1``). The same handler as POST /v1/embeddings
(openai_api.create_embeddings), in OpenAI's error dialect."""

from __future__ import annotations

from embedfleet.gateway import openai_api
from embedfleet.gateway.errors import ErrorDialect, dialect_router

router = dialect_router(ErrorDialect.openai)
router.add_api_route("/embeddings", openai_api.create_embeddings, methods=["POST"])
