"""The client ingestion services use (``from embedfleet import Producer`` re-exports it).

Each name is re-exported in the ``import X as X`` form, the typing convention for a re-export.
"""

from embedfleet.producer.client import EmbeddingOptions as EmbeddingOptions
from embedfleet.producer.client import JobTimeoutError as JobTimeoutError
from embedfleet.producer.client import Producer as Producer
from embedfleet.producer.client import QueryTimeoutError as QueryTimeoutError
from embedfleet.shared.jobs import JobProgress as JobProgress
from embedfleet.shared.protocol import QueryFailedError as QueryFailedError
from embedfleet.shared.retry import RedisUnavailableError as RedisUnavailableError
