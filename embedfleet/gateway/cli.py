"""`embedfleet serve`: run the HTTP gateway with uvicorn."""

from __future__ import annotations

import ipaddress
import os

import click

from embedfleet.shared.extras import missing_modules
from embedfleet.shared.logging import configure_logging, get_logger
from embedfleet.shared.settings import Settings, SettingsError, load_settings

GATEWAY_MODULES = (
    "fastapi",
    "uvicorn",
    "multipart",
    "tokenizers",
    "prometheus_client",
    "grpc",
    "google.protobuf",
    "grpc_health",
    "grpc_reflection",
)
# names that resolve to this machine only, whatever resolver is configured
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})

log = get_logger("embedfleet.gateway")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the gateway to this machine (127.0.0.0/8, ::1,
    localhost); any other address or name may be reachable from elsewhere."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def open_gateway_warning(host: str, settings: Settings) -> str | None:
    """What to say when the gateway would answer anyone: no API key configured, and bound to an
    address other machines may reach. None when it has keys or listens on loopback only."""
    from embedfleet.gateway.auth import load_api_keys

    if load_api_keys(settings) or is_loopback(host):
        return None
    return (
        f"NO API KEY: the gateway listens on {host} and answers every request from anyone who "
        "can reach it. Set EMBEDFLEET_API_KEYS (comma-separated), EMBEDFLEET_API_KEYS_FILE or "
        "TEI's API_KEY, or bind a loopback address (--host 127.0.0.1, EMBEDFLEET_GATEWAY_HOST)"
    )


@click.command("serve")
@click.option("--host", default=None, help="Bind address (default EMBEDFLEET_GATEWAY_HOST).")
@click.option("--port", type=int, default=None, help="Port (default EMBEDFLEET_GATEWAY_PORT).")
@click.option("--workers", type=int, default=1, show_default=True, help="uvicorn processes.")
def serve_command(host: str | None, port: int | None, workers: int) -> None:
    """Serve OpenAI's /v1/embeddings, /v1/models and Batch API, and TEI's /embed, /info and
    /health over the fleet (stateless: run as many as you like behind a load balancer).

    Small requests ride the query stream, large ones the interactive stream (both ahead
    of any bulk backlog), batches the ingest streams. A request waits for a worker within
    EMBEDFLEET_GATEWAY_TIMEOUT_S (scale from zero). Settings: EMBEDFLEET_* (API keys, limits,
    EMBEDFLEET_FILES_DIR; see README).
    """
    missing = missing_modules(GATEWAY_MODULES)
    if missing:
        raise click.ClickException(
            f"`embedfleet serve` needs the gateway extra (missing: {', '.join(missing)}): "
            "pip install 'embedfleet[gateway]'"
        )
    import uvicorn

    try:
        settings = load_settings()
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    configure_logging(
        settings.log_level, "console" if settings.log_format == "auto" else settings.log_format
    )
    host = host or settings.gateway_host
    port = settings.gateway_port if port is None else port
    # the app (built in each uvicorn process from the environment) binds its gRPC port, if
    # any, on the address HTTP binds
    os.environ["EMBEDFLEET_GATEWAY_HOST"] = host
    from embedfleet.gateway.token_ids import TiktokenSettingError, tiktoken_ids_of

    try:
        warning = open_gateway_warning(host, settings)
        # read once here so that a bad encoding stops the start with its message, not with a
        # traceback from each uvicorn process
        tiktoken_ids_of(settings.gateway_tiktoken_encoding)
    except (FileNotFoundError, TiktokenSettingError) as error:  # (a keys file not there)
        raise click.ClickException(str(error)) from None
    if warning is not None:
        log.warning(warning)
    try:
        uvicorn.run(
            "embedfleet.gateway.cli:app_factory",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level=settings.log_level,
            access_log=False,  # /metrics counts requests; an access line each would cost more
        )
    except SystemExit as stop:
        if stop.code in (None, 0):
            raise
        # uvicorn exits 3 when it cannot start (a port taken), and 3 is DEAD_LETTERS in the
        # table of exit statuses: an error that stops the verb is 1 (its log said why)
        raise click.ClickException(
            f"the gateway did not start on {host}:{port} (uvicorn's error is above)"
        ) from None


def app_factory():
    """The app from the environment (uvicorn's factory: each worker process builds its own)."""
    from embedfleet.gateway.app import create_app

    return create_app(load_settings())
