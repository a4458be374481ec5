"""The client ingestion services use (``from embedfleet import Producer`` re-exports it).

Each name is re-exported in the ``import X as X`` form, the typing convention for a re-export.
"""

# One module, one name: this folder is the package ``embedfleet.producer``. From a checkout the
# folder is also reachable as a top-level ``producer`` (a name other PyPI packages own); loading it
# so would load every module a second time under another name. The checkout itself on PYTHONPATH
# is enough: embedfleet/__init__.py maps this folder to its name.
if __name__ != "embedfleet.producer":
    raise ImportError(
        f"import embedfleet.producer, not {__name__}: install the checkout "
        "(pip install -e .) or put the checkout on PYTHONPATH"
    )


from embedfleet.producer.client import EmbeddingOptions as EmbeddingOptions
from embedfleet.producer.client import JobTimeoutError as JobTimeoutError
from embedfleet.producer.client import Producer as Producer
from embedfleet.producer.client import QueryTimeoutError as QueryTimeoutError
from embedfleet.producer.enqueue import Enqueued as Enqueued
from embedfleet.producer.token_ids import TokenIdsUnavailableError as TokenIdsUnavailableError
from embedfleet.shared.jobs import JobProgress as JobProgress
from embedfleet.shared.protocol import QueryFailedError as QueryFailedError
from embedfleet.shared.retry import RedisUnavailableError as RedisUnavailableError
