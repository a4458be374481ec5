"""The gateway's /metrics: requests by route and status, and their latency, for Prometheus."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    """One registry per app, so tests can run several gateways in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "embedfleet_gateway_requests",
            "HTTP requests answered, by route template, method and status",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "embedfleet_gateway_request_seconds",
            "Time to answer a request, by route template and status",
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inputs = Counter(
            "embedfleet_gateway_inputs",
            "Texts embedded for HTTP requests, by lane (query or interactive) and model",
            ["lane", "model"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "embedfleet_gateway_requests_in_flight",
            "Requests being answered now",
            registry=self.registry,
        )
